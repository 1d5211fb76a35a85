"""A node's copies of directories' entries, kept current by the master (pure).

Most lookups of a KV cache are misses, each for a new name, and the hits are for
names that other nodes wrote. With the master in another process every lookup
would be a round trip; instead a node that asks repeatedly about one directory
(or once about a small one: FIRST_COPY_NAMES) fetches the directory's complete
name set once, with the entry a lookup of each name answers, and subscribes to
its changes: the master pushes every name added
or removed there and every entry that changed (a new version, a seal, new
attributes). Misses and hits are then answered from the copy. A push arrives
within a round trip of the change, well inside the 1 s for which kernels cache
negative entries anyway.

A copy holds an entry only for a sealed file on a live node (immutable until a
push says otherwise); for other names (directories, files being written, files
whose node is down) it knows only that the name exists, and the node asks the
master.

Copies are bounded by a total number of names; the least recently used
directories are dropped (and unsubscribed) first. Every copy goes when the
connection to the master is lost, since pushes may have been missed.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

from kvfs.wire.messages import Attr, Entry

# The lookup in a directory that makes the node copy it: the copy answers that lookup (one round trip,
# the lookup's own). Not the first: a node that copies a directory watches it, and every name another
# node adds there then waits for its acknowledgement (docs/cluster.md); a reader that looks up one name
# in each of vLLM's ~1M small directories would watch them all (measured: other nodes' stores 20-30% slower).
LOOKUPS_BEFORE_COPY = 2
# Inodes the master said are gone whose names a copy may still hold, until the push of their removal
# arrives (a handful at a time: a dead node's files as its readers open them).
GONE_KEPT = 4096


class DirectoryCache:
    def __init__(self, max_names: int) -> None:
        self.max_names = max_names
        self._names: OrderedDict[int, dict[bytes, Entry | None]] = OrderedDict()
        self._asked: dict[int, int] = {}
        self._uncachable: set[int] = set()  # directories too large to copy
        self._gone: set[int] = set()  # inodes the master no longer has (see `gone`)
        self.total = 0
        self.answered = 0  # misses answered without the master
        self.found = 0  # present names answered without the master

    def absent(self, parent: int, name: bytes) -> bool:
        """True if `name` is known not to exist in `parent` (no need to ask the master)."""
        names = self._names.get(parent)
        if names is None or name in names:
            return False
        self._names.move_to_end(parent)
        self.answered += 1
        return True

    def present(self, parent: int, name: bytes) -> Entry | None:
        """The entry of a name the copy can answer for, or None (ask the master)."""
        names = self._names.get(parent)
        entry = names.get(name) if names is not None else None
        if entry is not None and self._gone and entry.attr is not None and entry.attr.ino in self._gone:
            return None
        if entry is not None:
            self._names.move_to_end(parent)
            self.found += 1
        return entry

    def gone(self, ino: int) -> None:
        """The master answered that inode `ino` no longer exists (an open or a getattr of it)
        while a copy may still name it: the push of its removal is a moment behind the answer.
        Until then a lookup of that name asks the master, so the kernel's retry of a stale
        open finds the name absent instead of the same gone inode (ESTALE to the caller)."""
        if len(self._gone) >= GONE_KEPT:
            self._gone.clear()
        self._gone.add(ino)

    def asked(self, parent: int) -> bool:
        """Records a lookup the master answered; True when the directory should be copied now."""
        if parent in self._names or parent in self._uncachable:
            return False
        count = self._asked.get(parent, 0) + 1
        self._asked[parent] = count
        if len(self._asked) > 4 * 65536:  # forget old counts
            self._asked.clear()
        return count >= LOOKUPS_BEFORE_COPY

    def copy_due(self, parent: int) -> bool:
        """True when this lookup in a directory not copied is the one that copies it."""
        return parent not in self._names and parent not in self._uncachable \
            and self._asked.get(parent, 0) + 1 >= LOOKUPS_BEFORE_COPY

    def too_large(self, parent: int) -> None:
        self._uncachable.add(parent)
        self._asked.pop(parent, None)

    def store(self, parent: int, names: list[bytes], entries: list[Entry | None] | None = None) -> list[int]:
        """Keeps a fetched name set; returns directories dropped to make room (to unsubscribe)."""
        self._asked.pop(parent, None)
        if len(names) > self.max_names:
            self.too_large(parent)
            return [parent]
        old = self._names.pop(parent, None)
        if old is not None:
            self.total -= len(old)
        self._names[parent] = dict(zip(names, entries)) if entries else dict.fromkeys(names)
        self.total += len(names)
        dropped = []
        # Past the bound, an eighth goes at once: one Unwatch for many small directories.
        keep = self.max_names - self.max_names // 8 if self.total > self.max_names else self.max_names
        while self.total > keep and len(self._names) > 1:
            victim, victim_names = self._names.popitem(last=False)
            self.total -= len(victim_names)
            dropped.append(victim)
        return dropped

    def added(self, parent: int, name: bytes, entry: Entry | None = None) -> None:
        """A name was added, or its entry changed."""
        names = self._names.get(parent)
        if names is not None:
            if name not in names:
                self.total += 1
            names[name] = entry
        self._not_gone(entry)  # (back: its node registered again)

    def removed(self, parent: int, name: bytes) -> None:
        names = self._names.get(parent)
        if names is not None and name in names:
            self._not_gone(names.pop(name))
            self.total -= 1

    def _not_gone(self, entry: Entry | None) -> None:
        """A push named the entry's inode: `gone` no longer needs to hold it."""
        if self._gone and entry is not None and entry.attr is not None:
            self._gone.discard(entry.attr.ino)

    def forget_directory(self, ino: int) -> None:
        names = self._names.pop(ino, None)
        if names is not None:
            self.total -= len(names)

    def clear(self) -> None:
        self._names.clear()
        self._gone.clear()
        self._asked.clear()
        self._uncachable.clear()
        self.total = 0

    def __contains__(self, parent: int) -> bool:
        return parent in self._names

    def __len__(self) -> int:
        return len(self._names)


class OwnChanges:
    """Directory attributes as the master answered them right after this node's own change,
    to answer the kernel's getattr that follows it (pure).

    The kernel drops its copy of a directory's attributes after every create, rename or
    unlink in it and asks again at the next permission check of a path walk: in vLLM's
    store (create, write, close, rename) twice per file, each a master round trip. The
    node asks for them in the same round trip as the change (pipelined behind it on the
    connection, which the master answers in order) and answers from them while they are
    certain to include every change of its own: only when no other change of this node was
    in flight when the change began, and none began since. Changes made through other
    nodes show after at most `fresh_s` (a kernel caches attributes far longer: 60 s)."""

    def __init__(self, fresh_s: float) -> None:
        self.fresh_s = fresh_s
        self.generation = 0  # changes of this node begun so far
        self.in_flight = 0
        self._attrs: dict[int, tuple[Attr, int, float]] = {}  # ino -> (attributes, generation, when)
        self.answered = 0  # getattrs answered from here

    def begin(self) -> int | None:
        """A change of this node begins. Returns its token when the attributes answered
        after it may be kept (nothing else in flight), else None."""
        self.generation += 1
        self.in_flight += 1
        self._attrs.clear()  # none holds this change
        return self.generation if self.in_flight == 1 else None

    def invalidate(self) -> None:
        """Directories changed behind this node's back (names removed by eviction, say)."""
        self.generation += 1
        self._attrs.clear()

    def end(self, token: int | None, attrs: list[Attr], now: float) -> bool:
        """The change was answered, with the attributes asked behind it: kept (True) if `token`
        still holds."""
        self.in_flight -= 1
        if token is None or token != self.generation:
            return False
        for attr in attrs:
            self._attrs[attr.ino] = (attr, token, now)
        return True

    def get(self, ino: int, now: float) -> Attr | None:
        kept = self._attrs.get(ino)
        if kept is None:
            return None
        attr, generation, when = kept
        if generation != self.generation or now - when > self.fresh_s:
            return None
        self.answered += 1
        return copy.copy(attr)
