"""The interface every eviction policy implements."""

from __future__ import annotations

from typing import Any, Hashable, Iterator, MutableMapping, Protocol

ALL: Hashable = ("every group",)  # `candidates` of every group, in one order


class EvictionPolicy(Protocol):
    """Tracks evictable files (by key) and ranks them, least valuable first.

    A key may be filed under a group (the master's: the node that stores the file and
    whether its copy is on SSD): `candidates(group)` is then the policy's order with the
    other groups' keys left out, found without walking past them. The order itself never
    depends on groups."""

    name: str

    def insert(self, key: int, size: int, now: float, group: Hashable = None) -> None:
        """A file became evictable (sealed and published)."""

    def touch(self, key: int, now: float) -> None:
        """A file was used (opened for reading)."""

    def remove(self, key: int) -> None:
        """A file left the cache for any reason; unknown keys are ignored."""

    def regroup(self, key: int, group: Hashable) -> None:
        """The file is filed under another group now (its rank stays); unknown keys are ignored."""

    def identify(self, key: int, identity: int) -> None:
        """The file `key` now has the name whose hash is `identity` (it was published under
        it). A block stored again under a name it had before is the same block: a policy
        that learns from a block's past keys that past by its identity."""

    def keep_keys_in(self, table: MutableMapping[int, Any]) -> None:
        """The policy's key map is `table` (empty) from now on, not a dict. The master's keys
        are inode numbers, which only grow, and its records ints: it passes pages of packed
        ints (kvfs.cluster.inttable), 19 B per key and record instead of a dict entry's 42-52
        and an int object, and no dict of every key that resizes at once. Called while the
        policy holds no key."""

    def candidates(self, group: Hashable = ALL) -> Iterator[int]:
        """Keys in eviction order, of one group or of all. The caller must not change the
        policy while iterating."""

    def __len__(self) -> int: ...
