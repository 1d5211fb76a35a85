"""A mapping of small, only-growing numbers to ints, packed in pages of bytes (pure).

The eviction policy keeps one int per file (its record: kvfs.policy.reuse, kvfs.policy.lru),
keyed by inode number. In a `NumberTable` that is a slot (8 B) and an int object (32-48 B,
the reuse policy's 143-bit record 48 B); here it is 19 bytes of a page, the int itself
and a byte, and no object: 19 B per file instead of 56 (docs/cluster.md, "Memory per file").

A slot is a byte that says what it holds (0: nothing, 1: the value, little-endian in the
WIDTH bytes after it, 2: a value kept in a dict beside the pages, one too wide for them or
negative: never a policy's record, but the table takes any int as a dict would), so a
lookup reads one byte before it builds an int. Pages are freed as `NumberTable`'s are.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

from kvfs.cluster.table import PAGE_BITS, PAGE_SLOTS

WIDTH = 18  # value bytes per slot: 144 bits, the reuse policy's record (60-bit identity << 83) fits
SLOT = 1 + WIDTH
_MASK = PAGE_SLOTS - 1
_LIMIT = 1 << 8 * WIDTH  # values from 0 below this are kept in their slot
_EMPTY, _HELD, _WIDE = 0, 1, 2  # a slot's first byte
_CLEAR = bytes(SLOT)
_WIDE_SLOT = bytes((_WIDE,)) + bytes(WIDTH)
_from_bytes = int.from_bytes


class IntTable(MutableMapping[int, int]):
    """number -> int for numbers >= 0, as a dict with int keys and values behaves.
    Iteration goes in number order."""

    __slots__ = ("_pages", "_live", "_len", "_wide", "_last")

    def __init__(self) -> None:
        self._pages: dict[int, bytearray] = {}  # page n: numbers n * PAGE_SLOTS ... (as NumberTable)
        self._live: dict[int, int] = {}  # values per page
        self._len = 0
        self._wide: dict[int, int] = {}  # number -> a value its slot cannot hold
        # The number last read or written and its value: a policy reads a file's record
        # several times per request (4 reads and 2 writes per create), built once here.
        self._last: tuple[int | None, int] = (None, 0)

    # Written out, not built on each other: the policy calls these on every create and open.
    def get(self, key: int, default: int | None = None) -> int | None:  # type: ignore[override]
        last = self._last
        if key == last[0]:
            return last[1]
        page = self._pages.get(key >> PAGE_BITS)  # (a negative number's page is never there)
        if page is None:
            return default
        at = (key & _MASK) * SLOT
        kind = page[at]
        if kind == _HELD:
            value = _from_bytes(page[at + 1:at + SLOT], "little")
            self._last = (key, value)
            return value
        return default if kind == _EMPTY else self._wide[key]

    def __getitem__(self, key: int) -> int:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, int):
            return False
        page = self._pages.get(key >> PAGE_BITS)
        return page is not None and page[(key & _MASK) * SLOT] != _EMPTY

    def __setitem__(self, key: int, value: int) -> None:
        if key < 0 or type(value) is not int:
            raise ValueError(f"number {key} -> {value!r}: numbers are >= 0, values ints")
        number = key >> PAGE_BITS
        page = self._pages.get(number)
        if page is None:
            page = self._pages[number] = bytearray(PAGE_SLOTS * SLOT)
        at = (key & _MASK) * SLOT
        kind = page[at]
        if kind == _EMPTY:
            self._live[number] = self._live.get(number, 0) + 1
            self._len += 1
        elif kind == _WIDE:
            del self._wide[key]
        if 0 <= value < _LIMIT:
            page[at:at + SLOT] = (value << 8 | _HELD).to_bytes(SLOT, "little")
        else:
            page[at:at + SLOT] = _WIDE_SLOT
            self._wide[key] = value
        self._last = (key, value)

    def __delitem__(self, key: int) -> None:
        if self.pop(key, None) is None:
            raise KeyError(key)

    def pop(self, key: int, *default: int | None) -> int | None:  # type: ignore[override]
        number = key >> PAGE_BITS
        page = self._pages.get(number)
        at = (key & _MASK) * SLOT
        kind = _EMPTY if page is None else page[at]
        if kind == _EMPTY:
            if default:
                return default[0]
            raise KeyError(key)
        value = _from_bytes(page[at + 1:at + SLOT], "little") if kind == _HELD else self._wide.pop(key)  # type: ignore[index]
        page[at:at + SLOT] = _CLEAR  # type: ignore[index]
        if key == self._last[0]:
            self._last = (None, 0)
        self._len -= 1
        live = self._live[number] = self._live[number] - 1
        if not live:  # the page's last value went: its bytes go too
            del self._pages[number], self._live[number]
        return value

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        for number in sorted(self._pages):
            page, base = self._pages[number], number << PAGE_BITS
            for offset in range(PAGE_SLOTS):
                if page[offset * SLOT] != _EMPTY:
                    yield base + offset

    def clear(self) -> None:
        self._pages, self._live, self._len, self._wide, self._last = {}, {}, 0, {}, (None, 0)

    def __repr__(self) -> str:
        return f"IntTable({self._len} values in {len(self._pages)} pages)"
