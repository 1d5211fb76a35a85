"""Keys in the order of a stamp that mostly grows: the lists a policy ranks its keys by (pure).

A policy stamps a key with its clock when the key is used, so a list of keys kept in
the order they were last used is ordered by stamp, and appending keeps it so. A key
can also join a list with an older stamp: a file whose copy moved to another tier
joins that tier's list where its last use puts it, so that the list of one node's
files on one tier ranks them as the policy's whole order does. Those go to a small
sorted side list; readers merge the two.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from typing import Any, Callable, Hashable, Iterator

_MISSING = object()


class StampOrder:
    """Keys by (stamp, then arrival): O(1) for a key stamped with the newest stamp (the
    usual case), O(log n) search and a C memmove for one that arrives with an older one.

    A key's value in `main` is its stamp, or, given `stamp_of`, something the stamp is read
    from: the owner's record of the key (kvfs.policy.reuse), one int object for both."""

    __slots__ = ("main", "late", "late_stamps", "group", "cls", "number", "stamp_of")

    def __init__(self, group: Hashable = None, cls: int = 0, number: int = 0,
                 stamp_of: Callable[[Any], float] | None = None) -> None:
        # Appended with stamps that never go down: a plain dict keeps that order (and takes
        # about 60 B less per key than an OrderedDict: a master ranks millions).
        self.main: dict[int, Any] = {}
        self.late: list[tuple[float, int]] = []  # (stamp, key), sorted: keys that came with an older stamp
        self.late_stamps: dict[int, float] = {}
        self.group, self.cls = group, cls  # (what the owning policy files it under)
        self.number = number  # (how the owning policy's records name it)
        self.stamp_of = stamp_of

    def _last_stamp(self) -> float:
        value = self.main[next(reversed(self.main))]
        return value if self.stamp_of is None else self.stamp_of(value)

    def add(self, key: int, stamp: float, value: Any = None) -> None:
        """`key` must not be in the list. `value`: what `main` keeps (with `stamp_of`)."""
        main = self.main
        if main and stamp < self._last_stamp():
            insort(self.late, (stamp, key))
            self.late_stamps[key] = stamp
        else:
            main[key] = stamp if value is None else value

    def update(self, key: int, value: Any) -> None:
        """The key's value changed, not its stamp (`key` must be in the list)."""
        if key in self.main:
            self.main[key] = value

    def renew(self, key: int, stamp: float) -> None:
        """The key (in the list) was used now: `stamp` is the newest (lists without `stamp_of`)."""
        if key in self.main:
            del self.main[key]
        else:
            self.discard(key)
        self.main[key] = stamp

    def discard(self, key: int) -> float:
        """Takes the key out; returns its stamp. `key` must be in the list."""
        value = self.main.pop(key, _MISSING)
        if value is _MISSING:
            stamp = self.late_stamps.pop(key)
            del self.late[bisect_left(self.late, (stamp, key))]
            return stamp
        return value if self.stamp_of is None else self.stamp_of(value)

    def __len__(self) -> int:
        return len(self.main) + len(self.late)

    def keys(self) -> Iterator[int]:
        if not self.late:
            return iter(self.main)
        return (key for _, key in self.items())

    def items(self, shift: float = 0.0) -> Iterator[tuple[float, int]]:
        """(stamp + shift, key), lowest first."""
        if self.stamp_of is None:
            ordered = ((stamp + shift, key) for key, stamp in self.main.items())
        else:
            stamp_of = self.stamp_of
            ordered = ((stamp_of(value) + shift, key) for key, value in self.main.items())
        if not self.late:
            return ordered
        late = ((stamp + shift, key) for stamp, key in self.late)
        return heapq.merge(ordered, late)
