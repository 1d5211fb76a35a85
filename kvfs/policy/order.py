"""Keys in the order of a stamp that mostly grows: the lists a policy ranks its keys by (pure).

A policy stamps a key with its clock when the key is used, so a list of keys kept in
the order they were last used is ordered by stamp, and appending keeps it so. A key
can also join a list with an older stamp: a file whose copy moved to another tier
joins that tier's list where its last use puts it, so that the list of one node's
files on one tier ranks them as the policy's whole order does. Those go to a small
sorted side list; readers merge the two.

The keys are in parts of at most PART_KEYS, each two parallel arrays, stamps ('d') and
keys ('Q'): 16 bytes a key, no object per key (a dict entry and its share of the table
cost about 39). A key is found by bisection on the stamp the caller gives (the policy
keeps every key's stamp anyway): of the parts' first stamps, then in its part. A key that
leaves becomes a tombstone (key DEAD), skipped by readers; when a part's tombstones
outnumber its live keys it is compacted, a C pass amortized over the removals that made it
due and bounded by the part's size (one array of a million keys takes ~140 ms), and an
empty part goes. A key costs at most ~32 bytes, usually ~17.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_left, bisect_right
from itertools import chain, compress
from typing import Hashable, Iterator

DEAD = (1 << 64) - 1  # the key of a tombstone (no key may be this)
PART_KEYS = 1 << 13  # entries per part: a part's compaction is a pass over at most this many
COMPACT_MIN = 64  # tombstones a part keeps before it bothers to compact


class _Part:
    """Entries in stamp order, arrival order among equal stamps, tombstones included."""

    __slots__ = ("stamps", "keys", "head", "live")

    def __init__(self) -> None:
        self.stamps = array("d")
        self.keys = array("Q")
        self.head = 0  # entries before it are all tombstones: readers start here
        self.live = 0

    def find(self, key: int, stamp: float) -> int:
        """The key's index (-1: not here)."""
        stamps, keys = self.stamps, self.keys
        end = len(keys)
        at = bisect_left(stamps, stamp, self.head, end)
        while at < end and keys[at] != key:  # (equal stamps: arrival order, a short walk)
            if stamps[at] != stamp:
                return -1
            at += 1
        return at if at < end and stamps[at] == stamp else -1

    def kill(self, at: int) -> None:
        """The live entry at `at` becomes a tombstone (the part keeps a live key)."""
        keys = self.keys
        keys[at] = DEAD
        self.live -= 1
        if at == len(keys) - 1:
            self.trim()
        elif at == self.head:  # each tombstone is stepped over once
            at += 1
            while keys[at] == DEAD:
                at += 1
            self.head = at
        if len(keys) > 2 * self.live and len(keys) - self.live > COMPACT_MIN:
            # In C (compress): up to ~2.5 ms of CPU for a full part, amortized over the more
            # than as many removals that made it due.
            self.stamps = array("d", compress(self.stamps, map(DEAD.__ne__, keys)))
            self.keys = array("Q", filter(DEAD.__ne__, keys))
            self.head = 0

    def trim(self) -> None:
        """Drops the tombstones at the end (the part keeps a live key): the last part's end
        stays live, so a new key's place is one comparison."""
        keys, stamps = self.keys, self.stamps
        while keys[-1] == DEAD:
            keys.pop()
            stamps.pop()

    def pairs(self) -> Iterator[tuple[float, int]]:
        keys, head = self.keys, self.head
        return compress(zip(_from(self.stamps, head), _from(keys, head)), map(DEAD.__ne__, _from(keys, head)))

    def live_keys(self) -> Iterator[int]:
        return filter(DEAD.__ne__, _from(self.keys, self.head))


def _from(values: array, start: int) -> Iterator:
    """An iterator of `values` from `start` on, started there at once (the iterator's
    pickle state is its index): half the CPU per entry of a walk of indices."""
    walk = iter(values)
    walk.__setstate__(start)  # type: ignore[attr-defined]
    return walk


class StampOrder:
    """Keys by (stamp, then arrival): an append for a key stamped with the newest stamp
    (the usual case), a bisection and a C memmove of the side list for one that arrives
    with an older one; a key leaves by two bisections (a part's: a tombstone; the side
    list's: a memmove).

    Stamps must be exact in a double (integers below 2**53: the policies' clocks count
    accesses); keys are ints in [0, DEAD)."""

    __slots__ = ("parts", "firsts", "size", "late_stamps", "late_keys", "group", "cls", "number")

    def __init__(self, group: Hashable = None, cls: int = 0, number: int = 0) -> None:
        # Oldest first, appends to the last; a part's keys all have stamps between its first
        # stamp and the next part's. Never an empty part but a lone one, and the last part's
        # last entry is live, so a new key's place is one comparison.
        self.parts = [_Part()]
        self.firsts: list[float] = [0.0]  # the stamp each part started with (even if that key left)
        self.size = 0  # live keys in the parts
        # Keys that came with an older stamp, sorted by (stamp, key): what a merge of
        # (stamp, key) pairs with the parts puts in order.
        self.late_stamps = array("d")
        self.late_keys = array("Q")
        self.group, self.cls = group, cls  # (what the owning policy files it under)
        self.number = number  # (how the owning policy's records name it)

    def add(self, key: int, stamp: float) -> None:
        """`key` (not in the list) joins with `stamp`."""
        if not 0 <= key < DEAD:
            raise ValueError(f"key {key} out of range for a StampOrder")
        last = self.parts[-1]
        if self.size and stamp < last.stamps[-1]:
            at = self._late_at(key, stamp)
            self.late_stamps.insert(at, stamp)
            self.late_keys.insert(at, key)
            return
        if len(last.keys) >= PART_KEYS:
            last = _Part()
            self.parts.append(last)
            self.firsts.append(stamp)
        elif not last.keys:
            self.firsts[-1] = stamp
        last.stamps.append(stamp)
        last.keys.append(key)
        last.live += 1
        self.size += 1

    def _late_at(self, key: int, stamp: float) -> int:
        """Where (stamp, key) is, or goes, in the side list."""
        stamps = self.late_stamps
        low = bisect_left(stamps, stamp)
        return bisect_left(self.late_keys, key, low, bisect_right(stamps, stamp, low))

    def discard(self, key: int, stamp: float) -> float:
        """Takes the key, in the list with `stamp`, out; returns its stamp (KeyError: not
        there)."""
        stamp = float(stamp)  # (a bisection compares floats faster with a float)
        parts, firsts = self.parts, self.firsts
        index = max(0, bisect_left(firsts, stamp) - 1)  # (a stamp shared across parts' edges: the next too)
        while index < len(parts) and firsts[index] <= stamp:
            part = parts[index]
            at = part.find(key, stamp)
            if at >= 0:
                self.size -= 1
                if part.live > 1:
                    part.kill(at)
                elif len(parts) == 1:  # nothing live: start again (the memory goes at once)
                    self.parts, self.firsts = [_Part()], [0.0]
                else:
                    del parts[index], firsts[index]
                    if index == len(parts):  # the new last part's end
                        parts[-1].trim()
                return stamp
            index += 1
        at = self._late_at(key, stamp)
        if at < len(self.late_keys) and self.late_keys[at] == key and self.late_stamps[at] == stamp:
            del self.late_stamps[at], self.late_keys[at]
            return stamp
        raise KeyError(key)

    def __len__(self) -> int:
        return self.size + len(self.late_keys)

    def keys(self) -> Iterator[int]:
        if not self.late_keys:
            return chain.from_iterable(map(_Part.live_keys, self.parts))
        return (key for _, key in self.items())

    def items(self, shift: float = 0.0) -> Iterator[tuple[float, int]]:
        """(stamp + shift, key), lowest first. The list must not change while it is read."""
        ordered: Iterator[tuple[float, int]] = chain.from_iterable(map(_Part.pairs, self.parts))
        late: Iterator[tuple[float, int]] = zip(self.late_stamps, self.late_keys)
        if shift:
            ordered = ((stamp + shift, key) for stamp, key in ordered)
            late = ((stamp + shift, key) for stamp, key in late)
        if not self.late_keys:
            return ordered
        return heapq.merge(ordered, late)
