"""Items cut into batches in order, each within a size budget (pure)."""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

T = TypeVar("T")


def batches(items: Sequence[T], size_of: Callable[[T], int], max_bytes: int,
            max_items: int | None = None) -> list[list[T]]:
    """The items in order, cut so that a batch holds at most `max_items` of them and its
    sizes sum to at most `max_bytes` (an item larger than that goes alone)."""
    out: list[list[T]] = []
    batch: list[T] = []
    used = 0
    for item in items:
        size = size_of(item)
        if batch and ((max_items is not None and len(batch) >= max_items) or used + size > max_bytes):
            out.append(batch)
            batch, used = [], 0
        batch.append(item)
        used += size
    if batch:
        out.append(batch)
    return out
