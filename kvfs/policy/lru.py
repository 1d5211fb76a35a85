"""Least-recently-used eviction: the baseline every other policy is measured against."""

from __future__ import annotations

import heapq
from typing import Any, Hashable, Iterator, MutableMapping

from kvfs.policy.base import ALL
from kvfs.policy.order import StampOrder


class LruPolicy:
    """Keys in the order of their last use, in one list per group (see `EvictionPolicy`):
    a group's list is the whole order with the other groups' keys left out."""

    name = "lru"

    def __init__(self) -> None:
        self._clock = 0.0  # uses so far: a key's stamp is the clock at its last use (a float: 8 B less than an int)
        self._groups: dict[Hashable, StampOrder] = {}
        self._where: MutableMapping[int, StampOrder] = {}  # key -> its group's list

    def keep_keys_in(self, table: MutableMapping[int, Any]) -> None:
        if self._where or table:
            raise ValueError("keep_keys_in() on a policy that holds keys, or with a table that does")
        self._where = table

    def _list(self, group: Hashable) -> StampOrder:
        order = self._groups.get(group)
        if order is None:
            order = self._groups[group] = StampOrder(group)
        return order

    def insert(self, key: int, size: int, now: float, group: Hashable = None) -> None:
        self._clock += 1.0
        old = self._where.get(key)
        if old is not None:
            old.discard(key)
        order = self._where[key] = self._list(group)
        order.add(key, self._clock)

    def touch(self, key: int, now: float) -> None:
        order = self._where.get(key)
        if order is not None:
            self._clock += 1.0
            order.renew(key, self._clock)

    def remove(self, key: int) -> None:
        order = self._where.pop(key, None)
        if order is not None:
            order.discard(key)

    def regroup(self, key: int, group: Hashable) -> None:
        order = self._where.get(key)
        if order is not None and order.group != group:
            stamp = order.discard(key)
            order = self._where[key] = self._list(group)
            order.add(key, stamp)

    def identify(self, key: int, identity: int) -> None:
        pass  # LRU has no memory of evicted blocks

    def candidates(self, group: Hashable = ALL) -> Iterator[int]:
        if group is not ALL:
            order = self._groups.get(group)
            return order.keys() if order is not None else iter(())
        orders = [order for order in self._groups.values() if order]
        if len(orders) == 1:
            return orders[0].keys()
        return (key for _, key in heapq.merge(*(order.items() for order in orders)))

    def __len__(self) -> int:
        return len(self._where)
