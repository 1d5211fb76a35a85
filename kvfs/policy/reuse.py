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
from typing import Hashable, Iterator

from kvfs.policy.base import ALL
from kvfs.policy.order import StampOrder

BONUS_SCALE = 5e7  # bonus (in accesses) times resident blocks
CLASS_WEIGHTS = (0.0, 1.0, 1.3, 2.0)  # first use, 2nd, 3rd, later
HISTORY = 1 << 20  # use counts remembered, including for evicted blocks


class ReusePolicy:
    name = "reuse"

    def __init__(self, bonus: float | None = None, history: int = HISTORY) -> None:
        self.fixed_bonus = bonus  # None: BONUS_SCALE / resident blocks
        self.history = history
        # Per group (see `EvictionPolicy`), one LRU list per class; within a class, priority
        # grows with the last-use time.
        self._groups: dict[Hashable, list[StampOrder]] = {}
        self._where: dict[int, StampOrder] = {}  # resident key -> its list (its group and class)
        self._uses: OrderedDict[int, int] = OrderedDict()  # identity (or key) -> uses so far (bounded)
        self._identity: dict[int, int] = {}  # key -> identity, for keys given one
        self._clock = 0.0  # accesses so far: the policy's notion of time (a float: 8 B less than an int)

    def _lists(self, group: Hashable) -> list[StampOrder]:
        lists = self._groups.get(group)
        if lists is None:
            lists = self._groups[group] = [StampOrder(group, cls) for cls in range(len(CLASS_WEIGHTS))]
        return lists

    def _count_use(self, key: int) -> int:
        history = self._identity.get(key, key)
        uses = self._uses.pop(history, 0) + 1
        self._uses[history] = uses
        if len(self._uses) > self.history:
            self._uses.popitem(last=False)
        return uses

    def _place(self, key: int, uses: int, group: Hashable, renamed: bool = False) -> None:
        """Files the key under its class, as used now (or, `renamed`, as recent as it was:
        every key's last-use time is its own, so the order never depends on how keys are grouped)."""
        old = self._where.get(key)
        stamp = self._clock
        if old is not None:
            last_use = old.discard(key)
            if renamed:
                stamp = last_use
        order = self._where[key] = self._lists(group)[min(uses, len(CLASS_WEIGHTS)) - 1]
        order.add(key, stamp)

    def insert(self, key: int, size: int, now: float, group: Hashable = None) -> None:
        self._clock += 1.0
        self._place(key, self._count_use(key), group)

    def touch(self, key: int, now: float) -> None:
        self._clock += 1.0
        order = self._where.get(key)
        if order is not None:
            self._place(key, self._count_use(key), order.group)

    def remove(self, key: int) -> None:
        self._identity.pop(key, None)
        order = self._where.pop(key, None)
        if order is not None:
            order.discard(key)

    def regroup(self, key: int, group: Hashable) -> None:
        order = self._where.get(key)
        if order is not None and order.group != group:
            stamp = order.discard(key)
            order = self._where[key] = self._lists(group)[order.cls]
            order.add(key, stamp)

    def identify(self, key: int, identity: int) -> None:
        """Uses counted under the key so far join the identity's history (a block stored
        again under a name it had before is known as reused), and its class follows."""
        previous = self._identity.get(key, key)
        if previous == identity:
            return
        self._identity[key] = identity
        uses = self._uses.pop(previous, 0) + self._uses.pop(identity, 0)
        if not uses:
            return
        self._uses[identity] = uses
        order = self._where.get(key)
        if order is not None and uses > 1:  # named right after it was stored: as recent as it was
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
        return BONUS_SCALE / max(1, len(self._where))

    def __len__(self) -> int:
        return len(self._where)
