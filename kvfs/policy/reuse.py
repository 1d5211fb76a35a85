"""Reuse-aware eviction: LRU order, shifted by how likely a block is to be used again.

In KV-cache traces most blocks are used once, and the blocks that are reused
(shared prefixes) come back minutes later, after LRU has pushed them out for
one-off blocks. What predicts reuse, measured on the Mooncake conversation
trace (share of a block's uses that are followed by another use):

- a block used for the first time: 0.23 (0.11 in a request whose prefix was
  cached, the new tail of a continued conversation; 0.27 in one that started
  cold);
- used once before: 0.42; twice before: 0.47; three or more times: 0.65.

So a block's priority is its last-use time (in accesses, like LRU) plus a
bonus for its class: `bonus * (0, 1, 1.3, 2)` for those four classes.
With a bonus of 0 it is exactly LRU. A block that keeps being used keeps being
refreshed; the bonus only reorders blocks whose last uses are close. Use counts
are remembered for blocks that were evicted too (a bounded history), so a
block stored again after eviction is known as reused.

The bonus shrinks as the cache grows: `BONUS_SCALE / resident blocks`
accesses (10,000 at 5,000 blocks). In a small cache the reusable blocks compete
with a flood of one-off blocks and the reordering pays; in a large one nearly
everything reused soon fits anyway, LRU is close to the optimum, and a fixed
bonus kept blocks that had been popular long after their last use (a fixed
bonus of 10,000 fell below LRU at 40% of the conversation trace).

The split of first uses by request (continued or cold) is left out: it moved
the results by at most 4% of the LRU-to-optimum gap on the conversation trace
(none on the synthetic one), and a live node would have to pair a request's
loads with its stores, which vLLM makes hundreds of milliseconds later while
other requests' loads and stores interleave. Every signal used here is a
count of the block's own uses, so the policy ranks the same live and offline.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Any, Hashable, Iterator, MutableMapping

from kvfs.policy.base import ALL
from kvfs.policy.order import StampOrder

BONUS_SCALE = 5e7  # bonus (in accesses) times resident blocks
CLASS_WEIGHTS = (0.0, 1.0, 1.3, 2.0)  # first use, 2nd, 3rd, later
HISTORY = 1 << 20  # use counts remembered, including for evicted blocks


# A key's record, one int: its identity (when it was given one), its last use (the policy's
# clock then), its uses while resident (up to the last class: more rank no differently), the
# number of the list it is filed in (0: not resident) and a flag:
# `identity << 83 | stamp << 33 | uses << 30 | number << 1 | named`: one int per key (143
# bits with a 60-bit identity: 18 B in the master's table, kvfs.cluster.inttable; 44 B as an
# object in a dict's) instead of a float stamp, an entry in a key -> list
# map, one in a key -> identity map with its int, and one in the history (an OrderedDict
# entry, ~105 B). Its list keeps the stamp too (16 B with the key), and is given it to find
# the key. The history keeps the uses of keys that left, bounded with the resident ones
# (docs/cluster.md, "Memory per file"). 50 bits of stamp are 350 years of 100,000 uses a
# second (the clock starts at 0 with each master), exact in the list's doubles.
_NUMBER_BITS = 29
_NUMBER_MASK = (1 << _NUMBER_BITS) - 1
_USES_SHIFT = _NUMBER_BITS + 1
_STAMP_SHIFT = _USES_SHIFT + 3
_STAMP_BITS = 50
_STAMP_MASK = (1 << _STAMP_BITS) - 1
_IDENTITY_SHIFT = _STAMP_SHIFT + _STAMP_BITS
_MAX_USES = len(CLASS_WEIGHTS)


def _record(identity: int | None, stamp: int, uses: int, number: int) -> int:
    low = stamp << _STAMP_SHIFT | uses << _USES_SHIFT | number << 1
    return low if identity is None else identity << _IDENTITY_SHIFT | low | 1


def _stamp(record: int) -> int:
    return record >> _STAMP_SHIFT & _STAMP_MASK


def _history_key(key: int, record: int | None) -> int:
    """What the key's uses are remembered under once it leaves: its identity, or itself."""
    return record >> _IDENTITY_SHIFT if record is not None and record & 1 else key


class ReusePolicy:
    name = "reuse"

    def __init__(self, bonus: float | None = None, history: int = HISTORY) -> None:
        self.fixed_bonus = bonus  # None: BONUS_SCALE / resident blocks
        self.history = history  # use counts remembered, of resident keys and of keys that left
        # Per group (see `EvictionPolicy`), one LRU list per class; within a class, priority
        # grows with the last-use time.
        self._groups: dict[Hashable, list[StampOrder]] = {}
        self._orders: list[StampOrder | None] = [None]  # list number -> list (0: none)
        self._keys: MutableMapping[int, int] = {}  # key -> its record (above), for resident or named keys
        self._resident = 0
        # Identity (or key) of a key that left -> its uses, oldest departure first; with the
        # resident keys, at most `history` (the oldest go first).
        self._left: OrderedDict[int, int] = OrderedDict()
        self._clock = 0  # accesses so far: the policy's notion of time

    def keep_keys_in(self, table: MutableMapping[int, Any]) -> None:
        if self._keys or self._left or table:
            raise ValueError("keep_keys_in() on a policy that holds keys, or with a table that does")
        self._keys = table

    def _lists(self, group: Hashable) -> list[StampOrder]:
        lists = self._groups.get(group)
        if lists is None:
            first = len(self._orders)
            if first + _MAX_USES > _NUMBER_MASK:
                raise OverflowError(f"more than {_NUMBER_MASK} eviction lists")
            lists = self._groups[group] = [StampOrder(group, cls, first + cls) for cls in range(_MAX_USES)]
            self._orders += lists
        return lists

    def _order(self, record: int | None) -> StampOrder | None:
        """The list a key with this record is filed in (None: not resident)."""
        return None if record is None else self._orders[record >> 1 & _NUMBER_MASK]

    def _trim(self) -> None:
        left = self._left
        while left and len(left) + self._resident > self.history:
            left.popitem(last=False)

    def _place(self, key: int, uses: int, group: Hashable, renamed: bool = False) -> None:
        """Files the key under the class of `uses`, as used now (or, `renamed`, as recent as
        it was: every key's last-use time is its own, so the order never depends on how keys
        are grouped)."""
        record = self._keys.get(key)
        old = self._order(record)
        stamp = self._clock
        if old is not None:
            last_use = old.discard(key, _stamp(record))  # type: ignore[arg-type]
            if renamed:
                stamp = int(last_use)
        else:
            self._resident += 1
            self._trim()
        uses = min(uses, _MAX_USES)
        order = self._lists(group)[uses - 1]
        named = record is not None and record & 1
        self._keys[key] = _record(record >> _IDENTITY_SHIFT if named else None,  # type: ignore[operator]
                                  stamp, uses, order.number)
        order.add(key, stamp)

    def _uses(self, key: int, record: int | None) -> int:
        """Uses so far: a resident key's own, or those remembered under its identity."""
        if record is not None and record >> 1 & _NUMBER_MASK:
            return record >> _USES_SHIFT & 7
        return self._left.pop(_history_key(key, record), 0)

    def insert(self, key: int, size: int, now: float, group: Hashable = None) -> None:
        self._clock += 1
        self._place(key, self._uses(key, self._keys.get(key)) + 1, group)

    def touch(self, key: int, now: float) -> None:
        self._clock += 1
        record = self._keys.get(key)
        order = self._order(record)
        if order is not None:
            self._place(key, self._uses(key, record) + 1, order.group)

    def remove(self, key: int) -> None:
        record = self._keys.pop(key, None)
        order = self._order(record)
        if order is not None:
            order.discard(key, _stamp(record))  # type: ignore[arg-type]
            self._resident -= 1
            history = _history_key(key, record)
            self._left.pop(history, None)
            self._left[history] = record >> _USES_SHIFT & 7  # type: ignore[operator]
            self._trim()

    def regroup(self, key: int, group: Hashable) -> None:
        record = self._keys.get(key)
        order = self._order(record)
        if order is not None and order.group != group:
            stamp = order.discard(key, _stamp(record))  # type: ignore[arg-type]
            order = self._lists(group)[order.cls]
            self._keys[key] = record & ~(_NUMBER_MASK << 1) | order.number << 1  # type: ignore[operator]
            order.add(key, stamp)

    def identify(self, key: int, identity: int) -> None:
        """Uses counted under the key so far join the identity's history (a block stored
        again under a name it had before is known as reused), and its class follows."""
        record = self._keys.get(key)
        previous = _history_key(key, record)
        if previous == identity:
            return
        order = self._order(record)
        if order is None:  # not resident: what it is remembered under changes
            self._keys[key] = _record(identity, 0, 0, 0)
            uses = self._left.pop(previous, 0) + self._left.pop(identity, 0)
            if uses:
                self._left[identity] = min(uses, _MAX_USES)
            return
        uses = (record >> _USES_SHIFT & 7) + self._left.pop(identity, 0)  # type: ignore[operator]
        self._keys[key] = _record(identity, _stamp(record), min(uses, _MAX_USES), order.number)  # type: ignore[arg-type]
        if uses > 1:  # named right after it was stored: as recent as it was
            self._place(key, uses, order.group, renamed=True)

    def candidates(self, group: Hashable = ALL) -> Iterator[int]:
        """Keys by priority (last use + class bonus), lowest first: a lazy merge of the class
        lists (of one group, or of every group)."""
        if group is ALL:
            lists = [order for orders in self._groups.values() for order in orders]
        else:
            lists = self._groups.get(group, [])
        bonus = self.bonus
        streams = [order.items(bonus * CLASS_WEIGHTS[order.cls]) for order in lists if order]
        return (key for _, key in heapq.merge(*streams))

    @property
    def bonus(self) -> float:
        if self.fixed_bonus is not None:
            return self.fixed_bonus
        return BONUS_SCALE / max(1, self._resident)

    def __len__(self) -> int:
        return self._resident
