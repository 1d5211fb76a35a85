"""Least-recently-used eviction: the baseline every other policy is measured against."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator


class LruPolicy:
    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, key: int, size: int, now: float) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: int, now: float) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: int) -> None:
        self._order.pop(key, None)

    def identify(self, key: int, identity: int) -> None:
        pass  # LRU has no memory of evicted blocks

    def candidates(self) -> Iterator[int]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)
