"""What the store shares with its node and between its parts: the owner it asks for the
master's decisions, its settings and its counters. No behaviour lives here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvfs.disk.index import DiskRecord
from kvfs.policy import DEFAULT_POLICY


class StoreOwner(Protocol):
    """What the store needs from its node: the master's decisions."""

    async def reclaim(self, tier: str, nbytes: int) -> bool:
        """Evicts whole files from `tier` ('dram' or 'disk'); True if any went."""

    async def describe(self, version: int) -> DiskRecord | None:
        """The index record (path, attributes) of a version, None if it is no longer a file."""

    async def offloaded(self, versions: list[int]) -> None:
        """These versions are now safe on SSD."""

    async def lost(self, version: int) -> None:
        """This version's only copy is corrupt: the file must disappear."""


@dataclass(frozen=True)
class TierSettings:
    offload: str = "eager"  # or "watermark"
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    backpressure_timeout_s: float = 30.0
    eviction_policy: str = DEFAULT_POLICY


@dataclass
class StoreStats:
    offloaded_files: int = 0
    offloaded_bytes: int = 0
    demoted_files: int = 0
    promoted_files: int = 0
    ssd_reads: int = 0
    ssd_read_bytes: int = 0
    backpressure_waits: int = 0
    backpressure_seconds: float = 0.0
    checksum_failures: int = 0
    quarantined_files: int = 0
