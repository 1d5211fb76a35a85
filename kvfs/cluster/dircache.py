"""A node's copies of directories' name sets, kept current by the master (pure).

Most lookups of a KV cache are misses, each for a new name. With the master in
another process every miss would be a round trip; instead a node that misses
repeatedly in a directory fetches the directory's complete name set once and
subscribes to its changes: the master pushes every name added or removed there,
and misses are answered from the copy. A push arrives within a round trip of the
change, well inside the 1 s for which kernels cache negative entries anyway.

Copies are bounded by a total number of names; the least recently used
directories are dropped (and unsubscribed) first. Every copy goes when the
connection to the master is lost, since pushes may have been missed.
"""

from __future__ import annotations

from collections import OrderedDict

MISSES_BEFORE_COPY = 2  # misses in a directory before its names are fetched


class DirectoryCache:
    def __init__(self, max_names: int) -> None:
        self.max_names = max_names
        self._names: OrderedDict[int, set[bytes]] = OrderedDict()
        self._misses: dict[int, int] = {}
        self._uncachable: set[int] = set()  # directories too large to copy
        self.total = 0
        self.answered = 0  # misses answered without the master

    def absent(self, parent: int, name: bytes) -> bool:
        """True if `name` is known not to exist in `parent` (no need to ask the master)."""
        names = self._names.get(parent)
        if names is None or name in names:
            return False
        self._names.move_to_end(parent)
        self.answered += 1
        return True

    def missed(self, parent: int) -> bool:
        """Records a miss the master answered; True when the directory should be copied now."""
        if parent in self._names or parent in self._uncachable:
            return False
        count = self._misses.get(parent, 0) + 1
        self._misses[parent] = count
        if len(self._misses) > 4 * 65536:  # forget old counts
            self._misses.clear()
        return count >= MISSES_BEFORE_COPY

    def too_large(self, parent: int) -> None:
        self._uncachable.add(parent)
        self._misses.pop(parent, None)

    def store(self, parent: int, names: list[bytes]) -> list[int]:
        """Keeps a fetched name set; returns directories dropped to make room (to unsubscribe)."""
        self._misses.pop(parent, None)
        if len(names) > self.max_names:
            self.too_large(parent)
            return [parent]
        old = self._names.pop(parent, None)
        if old is not None:
            self.total -= len(old)
        self._names[parent] = set(names)
        self.total += len(names)
        dropped = []
        while self.total > self.max_names and len(self._names) > 1:
            victim, victim_names = self._names.popitem(last=False)
            self.total -= len(victim_names)
            dropped.append(victim)
        return dropped

    def added(self, parent: int, name: bytes) -> None:
        names = self._names.get(parent)
        if names is not None and name not in names:
            names.add(name)
            self.total += 1

    def removed(self, parent: int, name: bytes) -> None:
        names = self._names.get(parent)
        if names is not None and name in names:
            names.discard(name)
            self.total -= 1

    def forget_directory(self, ino: int) -> None:
        names = self._names.pop(ino, None)
        if names is not None:
            self.total -= len(names)

    def clear(self) -> None:
        self._names.clear()
        self._misses.clear()
        self._uncachable.clear()
        self.total = 0

    def __contains__(self, parent: int) -> bool:
        return parent in self._names

    def __len__(self) -> int:
        return len(self._names)
