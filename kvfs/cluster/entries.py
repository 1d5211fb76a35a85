"""A directory's entries: names for lookups, an entry-id index for listings (pure).

A listing resumes after an entry id (the `next_id` the previous page ended with),
and must neither skip nor repeat a name while others come and go. Entry ids only
grow (every link takes a fresh one), so the directory keeps them in two parallel
arrays in id order: a new entry is an append, a removed one a tombstone (ino 0)
found by bisection, and a page is a bisection to its start and a walk of the page.
When tombstones outnumber live entries the arrays are compacted, so a whole
listing walks at most about twice its entries: a page costs O(log n + page)
amortized, never a scan of the directory from its start.

Per entry this costs 16 bytes of arrays and one dict slot (key -> ino); the
entry id itself lives on the inode. The dict's keys are the names as kept in memory
(kvfs.cluster.names: hex names packed). Lookups take and listings give names; an
entry is added and removed by its key, the inode's own (`Inode.key`), so that one
object serves the two.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, bisect_right
from itertools import compress
from typing import Iterator

from kvfs.cluster.names import Key, pack, unpack

COMPACT_MIN = 64  # tombstones a directory keeps before it bothers to compact


class Entries:
    """name -> ino, with each entry's id kept in id order for paged listings."""

    __slots__ = ("names", "_ids", "_inos", "_dead", "subdirs", "watchers", "steps")

    def __init__(self) -> None:
        self.names: dict[Key, int] = {}  # key (kvfs.cluster.names: bytes or int) -> ino
        self._ids = array("Q")
        self._inos = array("Q")  # 0: the entry was removed (a tombstone)
        self._dead = 0
        self.subdirs = 0  # directories among the entries (derived, not saved): st_nlink is 2 + subdirs
        self.watchers = 0  # bit n set: node n keeps a copy of this directory's names
        self.steps = 0  # index slots a listing walked, tombstones included (for tests of its cost)

    # The mapping a directory's callers use: name -> ino.
    def __len__(self) -> int:
        return len(self.names)

    def __bool__(self) -> bool:
        return bool(self.names)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, bytes) and pack(name) in self.names

    def __iter__(self) -> Iterator[bytes]:
        return map(unpack, self.names)

    def get(self, name: bytes) -> int | None:
        return self.names.get(pack(name))

    def inos(self) -> Iterator[int]:
        return iter(self.names.values())

    def add(self, key: Key, ino: int, entry_id: int) -> None:
        """A new entry under its key (kvfs.cluster.names.pack); its id is larger than every
        id the directory holds."""
        assert not self._ids or entry_id > self._ids[-1], "entry ids only grow"
        self.names[key] = ino
        self._ids.append(entry_id)
        self._inos.append(ino)

    def remove(self, key: Key, entry_id: int) -> None:
        del self.names[key]
        at = bisect_left(self._ids, entry_id)
        if at < len(self._ids) and self._ids[at] == entry_id:
            self._inos[at] = 0
            self._dead += 1
            if self._dead > COMPACT_MIN and self._dead * 2 > len(self._ids):
                self._compact()

    def _compact(self) -> None:
        # In C (compress, filter): tens of milliseconds for a million entries, amortized over
        # the half a million removals that made it due.
        self._ids = array("Q", compress(self._ids, self._inos))
        self._inos = array("Q", filter(None, self._inos))
        self._dead = 0

    def page(self, start_id: int, limit: int) -> list[tuple[int, int]]:
        """Up to `limit` (ino, entry id) after entry `start_id`, in id order."""
        out: list[tuple[int, int]] = []
        ids, inos = self._ids, self._inos
        first = at = bisect_right(ids, start_id)
        end = len(ids)
        while at < end and len(out) < limit:
            ino = inos[at]
            if ino:
                out.append((ino, ids[at]))
            at += 1
        self.steps += at - first
        return out
