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
from bisect import bisect_left, bisect_right, insort
from itertools import chain
from typing import Any, Callable, Hashable, Iterator

PART_KEYS = 1 << 16  # keys per part of a list (below)


class StampOrder:
    """Keys by (stamp, then arrival): O(1) for a key stamped with the newest stamp (the
    usual case), O(log n) search and a C memmove for one that arrives with an older one.

    A key's value in the parts is its stamp, or, given `stamp_of`, something the stamp is
    read from: the owner's record of the key (kvfs.policy.reuse), one int object for both.

    The keys in stamp order are in dicts of at most `part_keys` keys each (`parts`, oldest
    first; appends go to the last): a dict grows by copying itself whole, about 70 ms at
    1.4M keys, so one list of every file would stall the master's loop that long on one
    insert as the namespace grows; a part's copy is bounded (~3 ms). A key is found in its
    part by its stamp (`firsts`: each part's first stamp), given by the caller, or by
    asking the parts in turn."""

    __slots__ = ("parts", "firsts", "size", "part_keys", "late", "late_stamps", "group", "cls", "number",
                 "stamp_of")

    def __init__(self, group: Hashable = None, cls: int = 0, number: int = 0,
                 stamp_of: Callable[[Any], float] | None = None, part_keys: int | None = None) -> None:
        # Appended with stamps that never go down: a plain dict keeps that order (and takes
        # about 60 B less per key than an OrderedDict: a master ranks millions).
        self.parts: list[dict[int, Any]] = [{}]  # never an empty one but a lone one
        self.firsts: list[float] = [0.0]  # the stamp each part started with (of the first part: when it last did)
        self.size = 0  # keys in the parts
        self.part_keys = PART_KEYS if part_keys is None else part_keys
        self.late: list[tuple[float, int]] = []  # (stamp, key), sorted: keys that came with an older stamp
        self.late_stamps: dict[int, float] = {}
        self.group, self.cls = group, cls  # (what the owning policy files it under)
        self.number = number  # (how the owning policy's records name it)
        self.stamp_of = stamp_of

    def _last_stamp(self) -> float:
        last = self.parts[-1]
        value = last[next(reversed(last))]
        return value if self.stamp_of is None else self.stamp_of(value)

    def _part(self, key: int, stamp: float | None) -> dict[int, Any] | None:
        """The part that holds `key` (None: not in the parts)."""
        parts = self.parts
        if len(parts) > 1 and stamp is not None:
            part = parts[max(0, bisect_right(self.firsts, stamp) - 1)]
            if key in part:
                return part
        for part in parts:  # (one part; no stamp; or a stamp shared across a part's edge)
            if key in part:
                return part
        return None

    def _took(self, part: dict[int, Any]) -> None:
        """A key left `part`: an empty part goes, unless it is the only one."""
        self.size -= 1
        if not part and len(self.parts) > 1:
            at = next(i for i, p in enumerate(self.parts) if p is part)
            del self.parts[at], self.firsts[at]

    def add(self, key: int, stamp: float, value: Any = None) -> None:
        """`key` must not be in the list. `value`: what the parts keep (with `stamp_of`)."""
        if self.size and stamp < self._last_stamp():
            insort(self.late, (stamp, key))
            self.late_stamps[key] = stamp
            return
        last = self.parts[-1]
        if not self.size:
            self.firsts[0] = stamp
        elif len(last) >= self.part_keys:
            last = {}
            self.parts.append(last)
            self.firsts.append(stamp)
        last[key] = stamp if value is None else value
        self.size += 1

    def update(self, key: int, value: Any) -> None:
        """The key's value changed, not its stamp (`key` must be in the list)."""
        part = self._part(key, None if self.stamp_of is None else self.stamp_of(value))
        if part is not None:
            part[key] = value

    def renew(self, key: int, stamp: float) -> None:
        """The key (in the list) was used now: `stamp` is the newest (lists without `stamp_of`)."""
        self.discard(key)
        self.add(key, stamp)

    def discard(self, key: int, stamp: float | None = None) -> float:
        """Takes the key out; returns its stamp. `key` must be in the list; `stamp`, when the
        caller knows it, finds its part at once."""
        if key in self.late_stamps:
            stamp = self.late_stamps.pop(key)
            del self.late[bisect_left(self.late, (stamp, key))]
            return stamp
        part = self._part(key, stamp)
        if part is None:
            raise KeyError(key)
        value = part.pop(key)
        self._took(part)
        return value if self.stamp_of is None else self.stamp_of(value)

    def __len__(self) -> int:
        return self.size + len(self.late)

    def keys(self) -> Iterator[int]:
        if not self.late:
            return chain.from_iterable(self.parts)
        return (key for _, key in self.items())

    def items(self, shift: float = 0.0) -> Iterator[tuple[float, int]]:
        """(stamp + shift, key), lowest first."""
        if self.stamp_of is None:
            ordered = ((stamp + shift, key) for part in self.parts for key, stamp in part.items())
        else:
            stamp_of = self.stamp_of
            ordered = ((stamp_of(value) + shift, key) for part in self.parts for key, value in part.items())
        if not self.late:
            return ordered
        late = ((stamp + shift, key) for stamp, key in self.late)
        return heapq.merge(ordered, late)
