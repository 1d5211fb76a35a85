"""What the cache holds and serves per top-level directory (per model in vLLM's layout) (pure).

Lookups and opens are counted as the master answers them, under the top-level directory they
fall in. Files, bytes and hits are running totals per directory (`DirTotals`), each covering
the directory's whole subtree, kept up to date as files are linked, sealed, read, offloaded
and removed, and as directories move: a file's change touches its directory's ancestors
(O(depth)), a directory's move its old and new ancestors, and a `kvfs du` reads the
top-level directories' totals, never the files. Files directly in the root, and names
looked up there that do not exist, count under "/" (so rows exist only for real
top-level directories, whatever names clients ask for).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfs.wire import messages as m
from kvfs.cluster.namespace import ROOT_INO, Inode, Namespace
from kvfs.cluster.objects import FileVersion, ObjectDirectory

ROOT_FILES = "/"


@dataclass
class Counters:
    lookups_found: int = 0
    lookups_absent: int = 0
    opens: int = 0
    open_bytes: int = 0


def top_name(ns: Namespace, parent: int, name: bytes) -> str:
    """The top-level directory that entry `name` of directory `parent` lies in."""
    if parent == ROOT_INO:
        return name.decode(errors="replace")
    inode = ns.inodes.get(parent)
    while inode is not None and inode.parent not in (ROOT_INO, 0):
        inode = ns.inodes.get(inode.parent)
    if inode is None or inode.parent == 0:
        return ""  # unlinked meanwhile: counted nowhere
    return inode.name.decode(errors="replace")


class DirectoryUsage:
    """Counters of lookups and opens by top-level directory, since the master started."""

    def __init__(self) -> None:
        self.counters: dict[str, Counters] = {}

    def _of(self, ns: Namespace, parent: int, name: bytes) -> Counters | None:
        top = top_name(ns, parent, name)
        if not top:
            return None
        counters = self.counters.get(top)
        if counters is None:
            counters = self.counters[top] = Counters()
        return counters

    def looked_up(self, ns: Namespace, parent: int, name: bytes, found: Inode | None) -> None:
        if parent == ROOT_INO and (found is None or found.children is None):
            # A file in the root, or an absent name: under "/", never a row per name asked for.
            counters: Counters | None = self._root_files()
        else:
            counters = self._of(ns, parent, name)
        if counters is not None:
            if found is not None:
                counters.lookups_found += 1
            else:
                counters.lookups_absent += 1

    def opened(self, ns: Namespace, parent: int, name: bytes, size: int) -> None:
        counters = self._of(ns, parent, name) if parent != ROOT_INO else self._root_files()
        if counters is not None:
            counters.opens += 1
            counters.open_bytes += size

    def _root_files(self) -> Counters:
        return self.counters.setdefault(ROOT_FILES, Counters())

    def rows(self, ns: Namespace, totals: DirTotals | None) -> list[m.DirUsageRow]:
        """One row per top-level directory: its counters and, given the totals, what it holds
        now (O(top-level directories))."""
        rows: dict[str, m.DirUsageRow] = {}
        for top, counters in self.counters.items():
            rows[top] = m.DirUsageRow(top, lookups_found=counters.lookups_found,
                                      lookups_absent=counters.lookups_absent, opens=counters.opens,
                                      open_bytes=counters.open_bytes)
        if totals is not None:
            for top, held in totals.tops(ns):
                row = rows.get(top)
                if row is None:
                    row = rows[top] = m.DirUsageRow(top)
                row.files, row.bytes, row.hits = held[FILES], held[BYTES], held[HITS]
                row.ssd_bytes, row.dram_only_bytes = held[SSD_BYTES], held[DRAM_ONLY_BYTES]
        return sorted(rows.values(), key=lambda row: (-row.bytes, row.name))


# A directory's totals: [files, bytes, hits, bytes on SSD, bytes only in DRAM] of the sealed
# files linked at or below it (the root's: of the files directly in it).
FILES, BYTES, HITS, SSD_BYTES, DRAM_ONLY_BYTES = range(5)


def held_by(inode: Inode, objects: ObjectDirectory) -> list[int] | None:
    """What a file adds to its directories' totals; None if nothing (a directory, a link, an
    unlinked inode, a file being written)."""
    if not inode.parent or inode.children is not None or not inode.version:
        return None
    version = objects.versions.get(inode.version)
    if version is None or not version.sealed:
        return None
    size = version.size
    return [1, size, version.hits, size, 0] if version.on_disk else [1, size, version.hits, 0, size]


def walk_tops(ns: Namespace, objects: ObjectDirectory) -> dict[str, list[int]]:
    """The top-level totals summed over every inode (O(all files)): for checks, never on a request."""
    tops: dict[str, list[int]] = {}
    names: dict[int, str] = {}  # directory -> its top-level name, memoized for this walk
    for inode in ns.inodes.values():
        held = held_by(inode, objects)
        if held is None:
            continue
        top = ROOT_FILES if inode.parent == ROOT_INO else names.get(inode.parent)
        if top is None:
            top = names[inode.parent] = top_name(ns, inode.parent, b"")
        if top:
            _add(tops.setdefault(top, [0] * 5), held, 1)
    return {top: held for top, held in tops.items() if held[FILES]}


def _add(into: list[int], held: list[int], sign: int) -> None:
    into[0] += sign * held[0]
    into[1] += sign * held[1]
    into[2] += sign * held[2]
    into[3] += sign * held[3]
    into[4] += sign * held[4]


class DirTotals:
    """Per directory, the totals of its subtree; the service calls `leave` before an inode's
    contribution changes (an unlink, a detach, a seal, a new version, an offload) and `enter`
    after, so that each change costs O(depth)."""

    def __init__(self, objects: ObjectDirectory) -> None:
        self.objects = objects
        self.by_dir: dict[int, list[int]] = {}
        self.top_dirs: set[int] = set()  # directories linked in the root

    def _chain(self, ns: Namespace, parent: int, of_dir: bool) -> list[list[int]]:
        """The totals that a file (or a directory's subtree) in directory `parent` counts in:
        `parent`'s and its ancestors' up to the top-level one (the root's only for a file)."""
        if parent == ROOT_INO:
            return [] if of_dir else [self.by_dir.setdefault(ROOT_INO, [0] * 5)]
        chain = []
        inodes = ns.inodes
        while True:
            held = self.by_dir.get(parent)
            if held is None:
                held = self.by_dir[parent] = [0] * 5
            chain.append(held)
            inode = inodes.get(parent)
            if inode is None or inode.parent in (ROOT_INO, 0):
                return chain
            parent = inode.parent

    def _move(self, ns: Namespace, inode: Inode | None, sign: int) -> None:
        if inode is None or not inode.parent:
            return
        if inode.children is not None:
            held = self.by_dir.get(inode.ino)
            if inode.parent == ROOT_INO:
                (self.top_dirs.add if sign > 0 else self.top_dirs.discard)(inode.ino)
            if held is None or not any(held):
                return
            for into in self._chain(ns, inode.parent, True):
                _add(into, held, sign)
            return
        if inode.version:
            version = self.objects.versions.get(inode.version)
            if version is not None and version.sealed:
                self._file(ns, inode.parent, version, sign)

    def _file(self, ns: Namespace, parent: int, version: FileVersion, sign: int) -> None:
        """Adds (or, with sign -1, takes away) a sealed file in directory `parent` to the totals
        it counts in (as `_chain` says; written out: this runs on every seal)."""
        _, size, _, _, on_disk = version.fields()  # (one read of the packed fields)
        size, hits = sign * size, sign * version.hits
        tier = SSD_BYTES if on_disk else DRAM_ONLY_BYTES
        by_dir, inodes = self.by_dir, ns.inodes
        while True:
            into = by_dir.get(parent)
            if into is None:
                into = by_dir[parent] = [0] * 5
            into[FILES] += sign
            into[BYTES] += size
            into[HITS] += hits
            into[tier] += size
            if parent == ROOT_INO:
                return
            directory = inodes.get(parent)
            if directory is None or directory.parent in (ROOT_INO, 0):
                return
            parent = directory.parent

    def sealed(self, ns: Namespace, inode: Inode | None, version: FileVersion) -> None:
        """The version was just sealed: it counts from now on if it is the file's current one
        (while being written it counted nowhere, so nothing leaves first)."""
        if inode is not None and inode.version == version.version and inode.parent and inode.children is None:
            self._file(ns, inode.parent, version, 1)

    def enter(self, ns: Namespace, inode: Inode | None) -> None:
        """The inode (a file, or a directory with its subtree) now counts where it is linked."""
        self._move(ns, inode, 1)

    def leave(self, ns: Namespace, inode: Inode | None) -> None:
        """The inode no longer counts where it is linked (about to change, move or go)."""
        self._move(ns, inode, -1)

    def hit(self, ns: Namespace, inode: Inode) -> None:
        """A counted file was opened for reading (its version's hits grew by one)."""
        if held_by(inode, self.objects) is not None:
            for into in self._chain(ns, inode.parent, False):
                into[HITS] += 1

    def removed_dir(self, ino: int) -> None:
        """An empty directory left the namespace."""
        self.by_dir.pop(ino, None)
        self.top_dirs.discard(ino)

    def recount(self, ns: Namespace) -> None:
        """Everything from scratch, once after loading a saved state: each file is added to its
        own directory's sum, then each directory's sum to its ancestors (O(files + dirs x depth))."""
        self.by_dir.clear()
        self.top_dirs = set()
        versions = self.objects.versions
        direct: dict[int, list[int]] = {}
        for inode in ns.inodes.values():
            if inode.children is not None:
                if inode.parent == ROOT_INO:
                    self.top_dirs.add(inode.ino)
                continue
            if not inode.parent or not inode.version:
                continue
            version = versions.get(inode.version)
            if version is None or not version.sealed:
                continue
            into = direct.get(inode.parent)
            if into is None:
                into = direct[inode.parent] = [0] * 5
            into[FILES] += 1
            into[BYTES] += version.size
            into[HITS] += version.hits
            into[SSD_BYTES if version.on_disk else DRAM_ONLY_BYTES] += version.size
        for parent, held in direct.items():
            for into in self._chain(ns, parent, False):
                _add(into, held, 1)

    def tops(self, ns: Namespace) -> list[tuple[str, list[int]]]:
        """(name, totals) of the top-level directories holding files, and of the root's own files."""
        out = []
        for ino in self.top_dirs:
            held = self.by_dir.get(ino)
            inode = ns.inodes.get(ino)
            if held is not None and held[FILES] and inode is not None:
                out.append((inode.name.decode(errors="replace"), held))
        root = self.by_dir.get(ROOT_INO)
        if root is not None and root[FILES]:
            out.append((ROOT_FILES, root))
        return out
