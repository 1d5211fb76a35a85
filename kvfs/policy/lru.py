"""Least-recently-used eviction: the baseline every other policy is measured against."""

from __future__ import annotations

import heapq
from typing import Any, Hashable, Iterator, MutableMapping

from kvfs.policy.base import ALL
from kvfs.policy.order import StampOrder

# A key's record, one int: its last use (the clock then) and the number of its group's list,
# `stamp << 20 | number`. Its list finds the key by that stamp. One int object per key (32 B
# up to 2**40 uses), as the float stamp it replaces was.
_NUMBER_BITS = 20
_NUMBER_MASK = (1 << _NUMBER_BITS) - 1


class LruPolicy:
    """Keys in the order of their last use, in one list per group (see `EvictionPolicy`):
    a group's list is the whole order with the other groups' keys left out."""

    name = "lru"

    def __init__(self) -> None:
        self._clock = 0  # uses so far: a key's stamp is the clock at its last use
        self._groups: dict[Hashable, StampOrder] = {}
        self._orders: list[StampOrder] = []  # list number -> list
        self._records: MutableMapping[int, int] = {}  # key -> its record (above)

    def keep_keys_in(self, table: MutableMapping[int, Any]) -> None:
        if self._records or table:
            raise ValueError("keep_keys_in() on a policy that holds keys, or with a table that does")
        self._records = table

    def _list(self, group: Hashable) -> StampOrder:
        order = self._groups.get(group)
        if order is None:
            if len(self._orders) > _NUMBER_MASK:
                raise OverflowError(f"more than {_NUMBER_MASK + 1} eviction lists")
            order = self._groups[group] = StampOrder(group, number=len(self._orders))
            self._orders.append(order)
        return order

    def _take(self, key: int, record: int) -> tuple[StampOrder, int]:
        """Takes the key (its record given) out of its list: (the list, its stamp)."""
        order = self._orders[record & _NUMBER_MASK]
        stamp = record >> _NUMBER_BITS
        order.discard(key, stamp)
        return order, stamp

    def _file(self, key: int, order: StampOrder, stamp: int) -> None:
        """Files the key (in no list) in `order` with `stamp`, and records where."""
        self._records[key] = stamp << _NUMBER_BITS | order.number
        order.add(key, stamp)

    def insert(self, key: int, size: int, now: float, group: Hashable = None) -> None:
        self._clock += 1
        record = self._records.get(key)
        if record is not None:
            self._take(key, record)
        self._file(key, self._list(group), self._clock)

    def touch(self, key: int, now: float) -> None:
        record = self._records.get(key)
        if record is not None:
            order, _ = self._take(key, record)
            self._clock += 1
            self._file(key, order, self._clock)

    def remove(self, key: int) -> None:
        record = self._records.pop(key, None)
        if record is not None:
            self._take(key, record)

    def regroup(self, key: int, group: Hashable) -> None:
        record = self._records.get(key)
        if record is not None and self._orders[record & _NUMBER_MASK].group != group:
            _, stamp = self._take(key, record)
            self._file(key, self._list(group), stamp)

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
        return len(self._records)
