"""What the cache holds and serves per top-level directory (per model in vLLM's layout) (pure).

Lookups and opens are counted as the master answers them, under the top-level directory they
fall in; files and bytes are summed from the namespace when asked. Files directly in the root,
and names looked up there that do not exist, count under "/" (so rows exist only for real
top-level directories, whatever names clients ask for).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfs.wire import messages as m
from kvfs.cluster.namespace import ROOT_INO, Inode, Namespace
from kvfs.cluster.objects import ObjectDirectory

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

    def rows(self, ns: Namespace, objects: ObjectDirectory, with_files: bool) -> list[m.DirUsageRow]:
        """One row per top-level directory: its counters and, if asked, what it holds now."""
        rows: dict[str, m.DirUsageRow] = {}
        for top, counters in self.counters.items():
            rows[top] = m.DirUsageRow(top, lookups_found=counters.lookups_found,
                                      lookups_absent=counters.lookups_absent, opens=counters.opens,
                                      open_bytes=counters.open_bytes)
        if with_files:
            tops: dict[int, str] = {}  # directory -> its top-level name, memoized for this walk
            for inode in ns.inodes.values():
                if inode.children is not None or not inode.version or not inode.parent:
                    continue
                version = objects.versions.get(inode.version)
                if version is None or not version.sealed:
                    continue
                top = ROOT_FILES if inode.parent == ROOT_INO else tops.get(inode.parent)
                if top is None:
                    top = tops[inode.parent] = top_name(ns, inode.parent, b"")
                if not top:
                    continue
                row = rows.get(top)
                if row is None:
                    row = rows[top] = m.DirUsageRow(top)
                row.files += 1
                row.bytes += version.size
                row.hits += version.hits
                if version.on_disk:
                    row.ssd_bytes += version.size
                else:
                    row.dram_only_bytes += version.size
        return sorted(rows.values(), key=lambda row: (-row.bytes, row.name))
