"""Per-mount tables the kernel protocol needs: open file handles and lookup counts."""

from __future__ import annotations

import errno
from typing import Generic, TypeVar

from kvfs.errors import KvfsError

T = TypeVar("T")


class HandleTable(Generic[T]):
    """Maps the integer handles given to the kernel to open-file objects."""

    def __init__(self) -> None:
        self._handles: dict[int, T] = {}
        self._next = 1

    def add(self, value: T) -> int:
        fh = self._next
        self._next += 1
        self._handles[fh] = value
        return fh

    def get(self, fh: int) -> T:
        try:
            return self._handles[fh]
        except KeyError:
            raise KvfsError(errno.EBADF, f"no open file handle {fh}") from None

    def pop(self, fh: int) -> T:
        value = self.get(fh)
        del self._handles[fh]
        return value

    def __len__(self) -> int:
        return len(self._handles)


class LookupCounts:
    """How many references the kernel holds on each inode (lookup minus forget)."""

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}

    def add(self, ino: int) -> None:
        self._counts[ino] = self._counts.get(ino, 0) + 1

    def forget(self, ino: int, count: int) -> bool:
        """Drops `count` references; True when the kernel no longer knows the inode."""
        left = self._counts.get(ino, 0) - count
        if left > 0:
            self._counts[ino] = left
            return False
        self._counts.pop(ino, None)
        return True

    def known(self, ino: int) -> bool:
        return ino in self._counts

    def __len__(self) -> int:
        return len(self._counts)
