"""The temp files a master knows of, taken round in bounded walks (pure).

Writers publish by rename (`x.tmp` -> `x`), so temp files are usually a few, being
written; a writer that never renames leaves many. Collecting orphans looks at a
bounded number per request, those it looked at longest ago first: every temp file
is looked at once per `len / count` walks, and no walk is O(temp files).
"""

from __future__ import annotations

from itertools import islice
from typing import Iterator


class TempFiles:
    """A set of inode numbers (add, discard, in) with a round-robin walk."""

    __slots__ = ("_inos",)

    def __init__(self) -> None:
        self._inos: dict[int, None] = {}  # in the order the walks take them

    def add(self, ino: int) -> None:
        self._inos.setdefault(ino, None)

    def discard(self, ino: int) -> None:
        self._inos.pop(ino, None)

    def __contains__(self, ino: object) -> bool:
        return ino in self._inos

    def __len__(self) -> int:
        return len(self._inos)

    def __iter__(self) -> Iterator[int]:
        return iter(self._inos)

    def take_round(self, count: int) -> list[int]:
        """The `count` looked at longest ago, which go to the back of the round."""
        inos = self._inos
        taken = list(islice(inos, count))
        for ino in taken:
            del inos[ino]
            inos[ino] = None
        return taken
