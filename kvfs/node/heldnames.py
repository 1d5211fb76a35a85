"""Names a node can still resolve while the master is unreachable (pure).

A file this node stores stays readable during a master outage (failover to a standby,
etcd without quorum): its open is served from here. But the kernel reaches it through a
path, and it drops cached entries whenever it likes (memory pressure), after which each
component is looked up again, which needs the master. So the node remembers, for the
names the master answered (lookups, its own creates, mkdirs and renames), which inode
each named; while the master is unreachable a lookup of a directory, or of a file stored
here, is answered at once as it was last seen. Other names (files elsewhere, names never
seen) wait for the master as before, and nothing answered from here is newer than the
master's last word. Bounded: the least recently used go first.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from kvfs.wire import messages as m

HELD_NAMES = 1 << 16  # (parent, name) pairs remembered, ~200 B each: the names in use lately


class HeldNames:
    def __init__(self, limit: int = HELD_NAMES) -> None:
        self.limit = limit
        self._inos: OrderedDict[tuple[int, bytes], int] = OrderedDict()

    def seen(self, parent: int, name: bytes, attr: m.Attr) -> None:
        """The master answered that `name` in `parent` is `attr` (a lookup, a mkdir, a create)."""
        key = (parent, name)
        self._inos[key] = attr.ino
        self._inos.move_to_end(key)
        if len(self._inos) > self.limit:
            self._inos.popitem(last=False)

    def moved(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes) -> None:
        """A rename: the new name resolves to what the old one did (a published temp file)."""
        ino = self._inos.pop((parent_old, name_old), None)
        if ino is not None:
            self._inos[(parent_new, name_new)] = ino
            self._inos.move_to_end((parent_new, name_new))
        else:
            self._inos.pop((parent_new, name_new), None)

    def answer(self, parent: int, name: bytes, known: Callable[[int], m.Attr | None]) -> m.Attr | None:
        """The last seen attributes of `name`, if `known(ino)` still has them (a directory's
        cached attributes, a file stored here); None otherwise."""
        ino = self._inos.get((parent, name))
        if ino is None:
            return None
        attr = known(ino)
        if attr is None:
            return None
        self._inos.move_to_end((parent, name))
        return attr
