"""The embedded master: the metadata service called in-process (single-node mode)."""

from __future__ import annotations

from typing import Any, Protocol

from kvfs.cluster.master import MetadataService
from kvfs.wire.messages import Request
from kvfs.histogram import OperationStats


class MasterClient(Protocol):
    """How a node talks to the master, in-process or (later) over the network."""

    async def call(self, request: Request, wait_s: float | None = None) -> Any:
        """Sends one request, returns its response or raises MetadataError. A remote client
        waits up to `wait_s` (None: its default) for an unreachable master."""


class EmbeddedMaster:
    def __init__(self, service: MetadataService) -> None:
        self.service = service
        self.calls = OperationStats()  # by request type: the master's part of each operation

    async def call(self, request: Request, wait_s: float | None = None) -> Any:
        return self.calls.timed(type(request).__name__, lambda: self.service.handle(request))
