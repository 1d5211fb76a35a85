"""The interface every eviction policy implements."""

from __future__ import annotations

from typing import Iterator, Protocol


class EvictionPolicy(Protocol):
    """Tracks evictable files (by key) and ranks them, least valuable first."""

    name: str

    def insert(self, key: int, size: int, now: float) -> None:
        """A file became evictable (sealed and published)."""

    def touch(self, key: int, now: float) -> None:
        """A file was used (opened for reading)."""

    def remove(self, key: int) -> None:
        """A file left the cache for any reason; unknown keys are ignored."""

    def identify(self, key: int, identity: int) -> None:
        """The file `key` now has the name whose hash is `identity` (it was published under
        it). A block stored again under a name it had before is the same block: a policy
        that learns from a block's past keys that past by its identity."""

    def candidates(self) -> Iterator[int]:
        """Keys in eviction order. The caller must not change the policy while iterating."""

    def __len__(self) -> int: ...
