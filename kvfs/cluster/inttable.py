"""A mapping of small, only-growing numbers to ints, packed in pages of bytes (pure).

The eviction policy keeps one int per file (its record: kvfs.policy.reuse, kvfs.policy.lru),
keyed by inode number. In a `NumberTable` that is a slot (8 B) and an int object (32-48 B,
the reuse policy's 143-bit record 48 B); here it is WIDTH bytes of a page, the int itself,
and no object: 18 B per file instead of 56 (docs/cluster.md, "Memory per file").

A slot holds the value + 2, little-endian; 0 marks an empty slot and 1 a value kept in a
dict beside the pages (one too wide for WIDTH bytes, or negative: never a policy's record,
but the table takes any int as a dict would). Pages are freed as `NumberTable`'s are.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping

from kvfs.cluster.table import PAGE_BITS, PAGE_SLOTS

WIDTH = 18  # bytes per slot: 144 bits, the reuse policy's record (60-bit identity << 83) fits
_MASK = PAGE_SLOTS - 1
_LIMIT = (1 << 8 * WIDTH) - 2  # values below this are kept in their slot
_EMPTY = bytes(WIDTH)
_WIDE = (1).to_bytes(WIDTH, "little")


class IntTable(MutableMapping[int, int]):
    """number -> int for numbers >= 0, as a dict with int keys and values behaves.
    Iteration goes in number order."""

    __slots__ = ("_pages", "_live", "_len", "_wide")

    def __init__(self) -> None:
        self._pages: dict[int, bytearray] = {}  # page n: numbers n * PAGE_SLOTS ... (as NumberTable)
        self._live: dict[int, int] = {}  # values per page
        self._len = 0
        self._wide: dict[int, int] = {}  # number -> a value its slot cannot hold

    # Written out, not built on each other: the policy calls these on every create and open.
    def get(self, key: int, default: int | None = None) -> int | None:  # type: ignore[override]
        page = self._pages.get(key >> PAGE_BITS)  # (a negative number's page is never there)
        if page is None:
            return default
        at = (key & _MASK) * WIDTH
        stored = int.from_bytes(page[at:at + WIDTH], "little")
        if stored > 1:
            return stored - 2
        return default if stored == 0 else self._wide[key]

    def __getitem__(self, key: int) -> int:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, int):
            return False
        page = self._pages.get(key >> PAGE_BITS)
        at = (key & _MASK) * WIDTH
        return page is not None and page[at:at + WIDTH] != _EMPTY

    def __setitem__(self, key: int, value: int) -> None:
        if key < 0 or type(value) is not int:
            raise ValueError(f"number {key} -> {value!r}: numbers are >= 0, values ints")
        number = key >> PAGE_BITS
        page = self._pages.get(number)
        if page is None:
            page = self._pages[number] = bytearray(PAGE_SLOTS * WIDTH)
        at = (key & _MASK) * WIDTH
        old = page[at:at + WIDTH]
        if old == _EMPTY:
            self._live[number] = self._live.get(number, 0) + 1
            self._len += 1
        elif old == _WIDE:
            del self._wide[key]
        if 0 <= value < _LIMIT:
            page[at:at + WIDTH] = (value + 2).to_bytes(WIDTH, "little")
        else:
            page[at:at + WIDTH] = _WIDE
            self._wide[key] = value

    def __delitem__(self, key: int) -> None:
        if self.pop(key, None) is None:
            raise KeyError(key)

    def pop(self, key: int, *default: int | None) -> int | None:  # type: ignore[override]
        number = key >> PAGE_BITS
        page = self._pages.get(number)
        at = (key & _MASK) * WIDTH
        stored = 0 if page is None else int.from_bytes(page[at:at + WIDTH], "little")
        if stored == 0:
            if default:
                return default[0]
            raise KeyError(key)
        value = stored - 2 if stored > 1 else self._wide.pop(key)
        page[at:at + WIDTH] = _EMPTY  # type: ignore[index]
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
                if page[offset * WIDTH:(offset + 1) * WIDTH] != _EMPTY:
                    yield base + offset

    def clear(self) -> None:
        self._pages, self._live, self._len, self._wide = {}, {}, 0, {}

    def __repr__(self) -> str:
        return f"IntTable({self._len} values in {len(self._pages)} pages)"
