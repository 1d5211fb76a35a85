"""A single-node mount's directories, saved in its SSD index and brought back after a restart.

The index's file records name each file's path, so a restart rebuilds the files and the
directories above them; what those records cannot say (a directory's mode, owner and
time, an empty directory) is kept in the index's `dirs` table: one record per directory,
keyed by its inode number, naming its parent's number and its own name, so that a rename
or a chmod rewrites one record, never its descendants'. A chmod, chown, utimensat, rename
or rmdir of a directory is saved (one lmdb transaction, synced) before it is answered, as
a file's rename or chmod is; a mkdir within MKDIR_SAVE_S after, by a background task that
saves every mkdir waiting in one commit, as a new file is saved by its offload after its
close (vLLM's store makes two directories per new prefix: a synced commit each halved its
rate). At start, after the files are restored, the records are applied, then the table
is rewritten under the new namespace's inode numbers.
"""

from __future__ import annotations

import errno
import logging
import stat
from typing import Iterator, Protocol

import lmdb
import trio

from kvfs.cluster.master import MetadataService
from kvfs.cluster.namespace import ROOT_INO, Inode, Namespace, check_name
from kvfs.cluster.validate import time_ns
from kvfs.disk.records import DiskDir
from kvfs.errors import KvfsError, MetadataError
from kvfs.wire import messages as m

log = logging.getLogger(__name__)

MAX_ID = (1 << 32) - 1
WRITE_ERRORS = (lmdb.Error, OSError, KvfsError)
MKDIR_SAVE_S = 0.05  # how long after its answer a mkdir may wait to be saved


class DirTable(Protocol):
    """The index's directory table (kvfs.disk.index.DiskIndex)."""

    def put_dirs(self, changes: dict[int, DiskDir | None]) -> None: ...

    def replace_dirs(self, records: dict[int, DiskDir]) -> None: ...

    def dirs(self) -> Iterator[tuple[bytes, DiskDir | None]]: ...


def record_of(inode: Inode) -> DiskDir:
    if inode.ino == ROOT_INO:
        return DiskDir(0, b"", inode.mode, inode.uid, inode.gid, inode.mtime_ns)
    return DiskDir(inode.parent, inode.name, inode.mode, inode.uid, inode.gid, inode.mtime_ns)


def every_directory(ns: Namespace) -> dict[int, DiskDir]:
    """The records of every linked directory, the root's among them."""
    records: dict[int, DiskDir] = {}
    waiting = [ns.inodes[ROOT_INO]]
    while waiting:
        directory = waiting.pop()
        records[directory.ino] = record_of(directory)
        for ino in directory.children.inos():  # type: ignore[union-attr]
            child = ns.inodes[ino]
            if child.is_dir:
                waiting.append(child)
    return records


def check_record(ino: int, record: DiskDir) -> None:
    """Raises MetadataError (EINVAL) for a record no directory can have come from."""
    if not stat.S_ISDIR(record.mode) or record.mode >> 16:
        raise MetadataError(errno.EINVAL, f"mode {record.mode:o} is not a directory's")
    if not (0 <= record.uid <= MAX_ID and 0 <= record.gid <= MAX_ID):
        raise MetadataError(errno.EINVAL, f"owner {record.uid}:{record.gid} is out of range")
    time_ns(record.mtime_ns, "mtime")
    if ino == ROOT_INO:
        if record.parent or record.name:
            raise MetadataError(errno.EINVAL, "the root's record names a parent")
        return
    check_name(record.name)
    if record.name in (b".", b"..") or record.parent <= 0 or record.parent == ino:
        raise MetadataError(errno.EINVAL, f"it names parent {record.parent} and name {record.name!r}")


def load_records(table: DirTable) -> dict[int, DiskDir]:
    """The table's valid records; each bad one is named in a WARNING and left out."""
    records: dict[int, DiskDir] = {}
    for key, record in table.dirs():
        ino = int.from_bytes(key, "big") if len(key) == 8 else 0
        if record is None or ino <= 0:
            log.warning("directory record %s in the SSD index does not decode; dropped (its directory, if its "
                        "files bring it back, is root's with mode 0755)", key.hex())
            continue
        try:
            check_record(ino, record)
        except MetadataError as error:
            log.warning("directory record %d in the SSD index is invalid (%s); dropped", ino, error)
            continue
        records[ino] = record
    return records


def paths_of(records: dict[int, DiskDir]) -> Iterator[tuple[list[bytes], DiskDir]]:
    """Each record with its path from the root, parents before children; a record whose
    chain of parents breaks (a record missing or damaged) or loops is named and skipped."""
    resolved: dict[int, list[bytes] | None] = {ROOT_INO: []}

    def path(ino: int) -> list[bytes] | None:
        chain: list[int] = []
        while ino not in resolved:
            if ino in chain or ino not in records:
                for link in chain:
                    resolved[link] = None
                return None
            chain.append(ino)
            ino = records[ino].parent
        found = resolved[ino]
        for link in reversed(chain):
            found = None if found is None else [*found, records[link].name]
            resolved[link] = found
        return resolved[chain[0]] if chain else found

    found: list[tuple[list[bytes], DiskDir]] = []
    for ino, record in records.items():
        where = path(ino)
        if where is None:
            log.warning("directory record %d (%r) in the SSD index has no saved parent; dropped (its directory, "
                        "if its files bring it back, is root's with mode 0755)", ino, record.name)
        else:
            found.append((where, record))
    found.sort(key=lambda item: len(item[0]))
    return iter(found)


def restore_directories(service: MetadataService, table: DirTable) -> None:
    """Applies the saved records to the namespace rebuilt from the files (before mounting),
    to be saved under their new numbers (`DirectoryRecords.save_all_now`). Directories the files brought back
    that no record describes stay root's with mode 0755, and a WARNING says how many."""
    ns = service.ns
    described: set[int] = set()
    for path, record in paths_of(load_records(table)):
        directory: Inode | None = ns.inodes[ROOT_INO]
        if not path:
            service.set_directory(directory, record.mode, record.uid, record.gid, record.mtime_ns)
        else:
            parent = walk(ns, path[:-1])
            directory = None if parent is None else service.restore_directory(
                parent, path[-1], record.mode, record.uid, record.gid, record.mtime_ns)
        if directory is None:
            log.warning("directory /%s from the SSD index: a file holds its name or its parent's; not restored",
                        b"/".join(path).decode(errors="replace"))
            continue
        described.add(directory.ino)
    records = every_directory(ns)
    bare = [ino for ino in records if ino not in described and ino != ROOT_INO]
    if bare:
        log.warning("%d directories rebuilt from the SSD index's files have no directory record (an index "
                    "rebuilt from the segments, written by an earlier kvfs, or damaged): they are root's with "
                    "mode 0755, e.g. /%s", len(bare), b"/".join(path_in(ns, bare[0])).decode(errors="replace"))
    ns.dirty.clear()


def walk(ns: Namespace, path: list[bytes]) -> Inode | None:
    directory: Inode | None = ns.inodes[ROOT_INO]
    for name in path:
        found = ns.lookup(directory.ino, name) if directory is not None else None
        directory = found if found is not None and found.is_dir else None
    return directory


def path_in(ns: Namespace, ino: int) -> list[bytes]:
    names: list[bytes] = []
    inode = ns.inodes[ino]
    while inode.ino != ROOT_INO and inode.parent:
        names.append(inode.name)
        inode = ns.inodes[inode.parent]
    return names[::-1]


class DirectoryRecords:
    """Saves the directories each request changed: before its answer, a mkdir's just after (`run`)."""

    def __init__(self, table: DirTable, ns: Namespace) -> None:
        self.table = table
        self.ns = ns
        self.known: dict[int, DiskDir] = every_directory(ns)  # as saved, or about to be
        self.pending: set[int] = set()  # numbers whose record is yet to be written
        self.failures = 0
        self.whole = False  # the table still holds another namespace's numbers: replace it all
        self._writing = trio.Lock()  # writes in order: a later state never lands first
        self._wanted = trio.Event()  # a mkdir waits to be saved (`run`)

    def save_all_now(self) -> None:
        """Replaces the table with the namespace's directories (at start, before serving)."""
        try:
            self.table.replace_dirs(dict(self.known))
        except WRITE_ERRORS as error:
            self.whole = True
            self.failures += 1
            log.warning("cannot rewrite the directory records in the SSD index (%s); retried with the next "
                        "directory change", error)

    def note(self, request: m.Request, dirty: set[int]) -> bool:
        """Takes the directory changes among a request's changed inodes; True if any (those of
        an earlier failed write then go with them, never alone: no retry per request). A
        directory's time alone (an entry added) is not saved: only with its other fields or
        set by a SetAttr, so that making a file costs no write. A mkdir's is left to `run`."""
        times = isinstance(request, m.SetAttr)
        changed = False
        for ino in dirty:
            inode = self.ns.inodes.get(ino)
            old = self.known.get(ino)
            if inode is not None and inode.is_dir and (inode.parent or ino == ROOT_INO):
                record = record_of(inode)
                if old is None or (old.parent, old.name, old.mode, old.uid, old.gid) != (
                        record.parent, record.name, record.mode, record.uid, record.gid) or (
                        times and old.mtime_ns != record.mtime_ns):
                    self.known[ino] = record
                    self.pending.add(ino)
                    changed = True
            elif old is not None:  # removed, or detached while the kernel holds it
                del self.known[ino]
                self.pending.add(ino)
                changed = True
        if self._changes_a_directory(request):
            changed = True  # `save` then waits for a commit in flight, which may hold its mkdir
        if changed and isinstance(request, m.MkDir):
            self._wanted.set()
            return False
        return changed

    def _changes_a_directory(self, request: m.Request) -> bool:
        """A chmod, chown, utimensat or rename of a directory, or an rmdir (not a file's
        rename, which only touches its parents' times)."""
        try:
            if isinstance(request, m.SetAttr):
                inode = self.ns.inodes.get(request.ino)
            elif isinstance(request, m.Rename):
                inode = self.ns.lookup(request.parent_new, request.name_new)
            else:
                return isinstance(request, m.RmDir)
        except MetadataError:  # (a request that failed: its parent is gone)
            return False
        return inode is not None and inode.is_dir

    async def run(self) -> None:
        """Saves the mkdirs answered meanwhile, all in one commit, at most one commit per
        MKDIR_SAVE_S: a synced commit for each of a store's mkdirs halved its rate."""
        while True:
            await self._wanted.wait()
            await trio.sleep(MKDIR_SAVE_S)
            self._wanted = trio.Event()
            await self.save()

    async def save(self) -> None:
        """Writes what is pending, synced; a failure is logged and retried with the next
        change (the namespace's change stands: only a restart would show the older record)."""
        async with self._writing:
            if not self.pending:
                return
            inos, self.pending, whole = self.pending, set(), self.whole
            changes = {ino: self.known.get(ino) for ino in inos}
            try:
                if whole:
                    await trio.to_thread.run_sync(self.table.replace_dirs, dict(self.known))
                else:
                    await trio.to_thread.run_sync(self.table.put_dirs, changes)
            except WRITE_ERRORS as error:
                self.pending |= inos
                self.failures += 1
                log.warning("cannot save %d directory records in the SSD index (%s); retried with the next "
                            "directory change, and a restart before that brings back their older state",
                            len(inos), error)
                return
            self.whole = self.whole and not whole
