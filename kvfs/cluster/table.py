"""A mapping of small, only-growing numbers to objects, in pages of slots (pure).

The master numbers inodes and file versions from 1 upwards and never reuses a number.
A dict spends 42-52 bytes per entry (hash, key, value and the table's spare room); a
slot of a list spends 8. Numbers are kept in pages of PAGE_SLOTS slots, and a page whose
last object went is freed: the numbers of files evicted long ago cost one list slot per
page (8 B per 4,096 numbers), not one slot each, so a master that has seen a billion
numbers and holds a million objects keeps about what the million need.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping
from functools import partial
from operator import is_not
from typing import Generic, TypeVar

PAGE_BITS = 12
PAGE_SLOTS = 1 << PAGE_BITS
_MASK = PAGE_SLOTS - 1

T = TypeVar("T")


class NumberTable(MutableMapping[int, T], Generic[T]):
    """number -> object for numbers >= 0, as a dict with int keys behaves (None is never a
    value: it marks an empty slot). Iteration goes in number order."""

    __slots__ = ("_pages", "_live", "_len")

    def __init__(self, items: Iterable[tuple[int, T]] = ()) -> None:
        # Page n holds numbers n * PAGE_SLOTS ... (n + 1) * PAGE_SLOTS - 1; one dict entry per
        # page in use (a page is 32 KiB of slots: the entry is noise).
        self._pages: dict[int, list[T | None]] = {}
        self._live: dict[int, int] = {}  # objects per page
        self._len = 0
        for key, value in items:
            self[key] = value

    # The hot paths (every request looks up inodes and versions) are written out, not
    # built on each other: a Python call costs as much as the lookup itself.
    def get(self, key: int, default: T | None = None) -> T | None:  # type: ignore[override]
        page = self._pages.get(key >> PAGE_BITS)  # (a negative number's page is never there)
        if page is None:
            return default
        value = page[key & _MASK]
        return default if value is None else value

    def __getitem__(self, key: int) -> T:
        page = self._pages.get(key >> PAGE_BITS)
        if page is not None:
            value = page[key & _MASK]
            if value is not None:
                return value
        raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, int):
            return False
        page = self._pages.get(key >> PAGE_BITS)
        return page is not None and page[key & _MASK] is not None

    def __setitem__(self, key: int, value: T) -> None:
        if key < 0 or value is None:
            raise ValueError(f"number {key} -> {value!r}: numbers are >= 0 and None marks an empty slot")
        number = key >> PAGE_BITS
        page = self._pages.get(number)
        if page is None:
            page = self._pages[number] = [None] * PAGE_SLOTS
        if page[key & _MASK] is None:
            self._live[number] = self._live.get(number, 0) + 1
            self._len += 1
        page[key & _MASK] = value

    def __delitem__(self, key: int) -> None:
        if key not in self:
            raise KeyError(key)
        number = key >> PAGE_BITS
        self._pages[number][key & _MASK] = None
        self._len -= 1
        self._live[number] -= 1
        if not self._live[number]:  # the page's last object went: its slots go too
            del self._pages[number], self._live[number]

    def pop(self, key: int, *default: T | None) -> T | None:  # type: ignore[override]
        value = self.get(key)
        if value is None:
            if default:
                return default[0]
            raise KeyError(key)
        del self[key]
        return value

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for number in sorted(self._pages):
            base = number << PAGE_BITS
            for offset, value in enumerate(self._pages[number]):
                if value is not None:
                    yield base + offset

    def values(self) -> Iterator[T]:  # type: ignore[override]
        """The objects in number order (no copy: the caller must not add or remove meanwhile)."""
        for number in sorted(self._pages):
            yield from filter(partial(is_not, None), self._pages[number])  # type: ignore[misc]

    def scan(self, start: int, end: int, slots: int) -> tuple[list[T], int]:
        """The objects numbered from `start`, looking at up to `slots` numbers below `end`
        (pages not in use are passed over free), and the number to go on from: `end`
        once past it. For walks in slices, which may add and remove objects between them."""
        pages = self._pages
        while start < end:
            number = start >> PAGE_BITS
            page = pages.get(number)
            if page is None:  # the next page in use, if any below `end`
                start = min((n for n in pages if n > number), default=end >> PAGE_BITS) << PAGE_BITS
                start = min(max(start, (number + 1) << PAGE_BITS), end)
                continue
            stop = min(start + slots, (number + 1) << PAGE_BITS, end)
            found = list(filter(partial(is_not, None), page[start & _MASK:((stop - 1) & _MASK) + 1]))
            return found, stop  # type: ignore[return-value]
        return [], end

    def clear(self) -> None:
        self._pages, self._live, self._len = {}, {}, 0

    def __repr__(self) -> str:
        return f"NumberTable({self._len} objects in {len(self._pages)} pages)"
