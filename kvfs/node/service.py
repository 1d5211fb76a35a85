"""A node's file service: the POSIX operations, on top of the master and the local tiers.

The FUSE adapter calls these methods; they ask the master for every metadata
decision, keep the bytes of file versions in the node's tiered store, and keep
the per-node state the master does not need: sizes of versions being written,
open handles and what the kernel page cache holds. The node is also the store's
owner: it carries the store's requests (evict, describe, offloaded, lost) to the
master.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import logging
import os
import stat
import time
from dataclasses import asdict, dataclass
from typing import Any, Awaitable, Callable, Iterable, Iterator

import msgspec
import trio

from kvfs import progress
from kvfs.clock import Clock
from kvfs.wire import messages as m
from kvfs.node.dircache import DirectoryCache, OwnChanges
from kvfs.node.kernelattrs import KernelDirAttrs
from kvfs.node.misses import RecentMisses, adds_temp_name
from kvfs.node.relocations import BATCH as RECORD_BATCH
from kvfs.cluster.embedded import MasterClient
from kvfs.node.batching import FetchBatcher
from kvfs.node.prefetch import Prefetches
from kvfs.node.releases import DELAY_S as RELEASE_DELAY_S, PendingReleases
from kvfs.node.quota import UnsealedBytes
from kvfs.cluster.namespace import check_name
from kvfs.notices import Notices
from kvfs.net.rpc import MasterUnavailable
from kvfs.net.transport import FetchRun, Transport
from kvfs.config import format_size
from kvfs.disk.records import DiskRecord
from kvfs.errors import KvfsError, MetadataError, StorageError
from kvfs.node.membership import Membership, to_disk_file, to_file_record
from kvfs.node.private import BLOCK as NUMBER_BLOCK, NumberBlocks, PrivateFile, PrivateFiles
from kvfs.node.xattrs import NodeXattrs
from kvfs.store.evictions import EvictionSummary
from kvfs.store.faults import STORAGE_ERRORS
from kvfs.store.tiered import ReadSource, TieredStore

log = logging.getLogger("kvfs.node")



@dataclass(slots=True, eq=False)
class OpenFile:
    ino: int
    version: int
    writable: bool
    size: int  # the size of a sealed version (versions being written track theirs in WriteState)
    source: ReadSource | None = None  # where a reader's bytes come from
    leased: bool = True  # the master counts this handle (not when opened while it was unreachable)


@dataclass(slots=True)
class WriteState:
    """A version being written on this node, shared by all its writers."""

    size: int
    writers: int
    mtime_ns: int
    ctime_ns: int = 0  # the last write or truncate (mtime_ns may since have been set by utimensat)
    uid: int = 0  # whose cap of unsealed bytes the version counts against (kvfs/node/quota.py)
    charged: int = 0  # bytes counted against it: the furthest end written, set before the write awaits


@dataclass(frozen=True)
class NodeStats:
    capacity: int
    used: int
    inodes: int
    files: int


DIR_ATTR_CACHE = 65536
DIRECTORY_CACHE_NAMES = 1_000_000  # names of watched directories kept per node (~300 B each with entries)
REMOTE_STREAMS = 2  # parallel chunk runs per remote file
PEER_BUDGET_S = 3.0  # an open of another node's file tries that long, then fails with EIO
RETRY_PAUSE_S = 0.05  # the first pause before asking the master and the owner again (doubling)
SEAL_WAIT_S = 2.0  # the longest an open waits for another node's writer to seal a file it closed
TIERS = ("dram", "ssd", "peer")  # where a reader is served from (ReadSource.tier)
OWN_CHANGE_ATTRS_S = 1.0  # directory attributes fetched with a change answer getattr that long (OwnChanges)


@contextlib.contextmanager
def _stale_if_gone(ino: int, dircache: DirectoryCache | None) -> Iterator[None]:
    """An inode the kernel holds that the master no longer has at all is a stale name, not
    an absent one: the master forgets this node's kernel references when it registers again
    (after a partition, say), and an inode removed meanwhile is then gone for good. ESTALE
    makes the kernel look the name up again and retry (ENOENT only if the name is gone too:
    the node's directory copy, which may not have the push of the removal yet, no longer
    answers with that inode)."""
    try:
        yield
    except MetadataError as error:
        if error.errno != errno.ENOENT:
            raise
        if dircache is not None:
            dircache.gone(ino)
        raise MetadataError(errno.ESTALE, f"inode {ino} no longer exists: {error}") from None


class Node:
    """The POSIX file service of one node (its part in a cluster: `self.membership`)."""

    def __init__(self, master: MasterClient, store: TieredStore, clock: Clock, node_id: int = 1,
                 forget_entries: Callable[[list[tuple[int, bytes, int]]], None] = lambda entries: None,
                 transport: Transport | None = None,
                 invalidate_attrs: Callable[[int], Awaitable[None]] | None = None,
                 unsealed_per_user: int = 0, temp_suffix: bytes = b"", temp_grace_s: float = 300.0) -> None:
        self.master = master
        self.store = store
        store.owner = self
        self.clock = clock
        self.node_id = node_id
        self._forget_entries = forget_entries  # tells the kernel that names were removed behind its back
        self.transport = transport  # chunk fetches from other nodes (cluster mode)
        # Cluster mode: a file written on another node may be cached by this kernel with the
        # attributes (size) of an older version; opening a newer one drops them first.
        self.invalidate_attrs = invalidate_attrs
        self._kernel_versions: dict[int, tuple[int, int]] = {}  # ino -> (version, size) the kernel was told
        # Copies of directories' names, for misses without the master (cluster mode).
        self.dircache = DirectoryCache(DIRECTORY_CACHE_NAMES) if transport is not None else None
        self.prefetches = Prefetches(store, clock.monotonic) if transport is not None else None
        # Prefetches waiting for a turn go to their owner together (a transport that batches).
        self.batcher = FetchBatcher(transport, self.prefetches.turns) \
            if self.prefetches is not None and hasattr(transport, "fetch_batch") else None
        # Cluster mode: readers' releases ride on the next OpenRead (kvfs.node.releases).
        self.releases = PendingReleases() if transport is not None else None
        self._writing: dict[int, WriteState] = {}
        self.unsealed = UnsealedBytes(unsealed_per_user)  # each version's size, by the uid writing it
        self._cached_version: dict[int, int] = {}  # ino -> version the kernel page cache holds
        # Files stored here, for reads while the master is unreachable: ino -> (version, last attributes).
        self._local: dict[int, tuple[int, m.Attr]] = {}
        self._local_inos: dict[int, int] = {}  # version -> ino, the reverse of _local
        self._opens: dict[tuple[int, bool], int] = {}  # (version, writer) -> open handles (reported on registration)
        # Readers of versions still being written here: their size is the seal's once it comes.
        self._early_readers: dict[int, list[OpenFile]] = {}
        self._dir_attrs: dict[int, m.Attr] = {}  # last known directory attributes (for a master outage)
        self.own_changes = OwnChanges(OWN_CHANGE_ATTRS_S)  # directory attributes that came with a change
        self.kernel_dirs = KernelDirAttrs()  # directory attributes the kernel holds (after a private change)
        self.evicted_files = 0
        self.evictions = EvictionSummary()  # logged at INFO, at most every few seconds
        self.remote_reads = 0
        self.fetch_reports = [0, 0]  # a fetch's reports to the event loop, and those that woke it
        self.degraded_reads = 0
        # Activity, for metrics and `kvfs status`: names found or absent, and by which
        # tier reader opens and the bytes read through the daemon were served.
        self.lookups_found = 0
        self.lookups_absent = 0
        self.reader_opens = dict.fromkeys(TIERS, 0)
        self.served_bytes = dict.fromkeys(TIERS, 0)
        self.written_bytes = 0
        # Registration, heartbeats and the directory copies' fetches and pushes.
        self.membership = Membership(master, store, self.dircache, self)
        self.xattrs = NodeXattrs(master, store, self)  # user.* and the virtual user.kvfs.* attributes
        # Cluster mode: temp files stay on this node until renamed (kvfs.node.private).
        self.temp_suffix = temp_suffix if transport is not None else b""
        self.misses = RecentMisses(self.temp_suffix)  # the master's misses of the last second (cluster mode)
        self.temp_grace_s = temp_grace_s
        self.private = PrivateFiles()
        self.numbers = NumberBlocks()
        self._numbers_lock = trio.Lock()
        self.number_requests = 0  # GrantNumbers sent
        self.published = 0

    def forget_entries(self, entries: list[tuple[int, bytes, int]]) -> None:
        """Names removed behind the kernel's back (eviction, collection, another node): their
        directories changed, so attributes fetched with a change of this node no longer answer."""
        self.own_changes.invalidate()
        for parent, _, ino in entries:
            self.kernel_dirs.changed(parent)
            self.kernel_dirs.changed(ino)  # (a removed directory's own attributes are gone too)
        self._forget_entries(entries)

    def use_master(self, master: MasterClient) -> None:
        """Cluster mode: the link to the master process replaces the embedded one (every
        later call, the membership's too, goes over it)."""
        self.master = self.membership.master = self.xattrs.master = master

    @property
    def chunk_size(self) -> int:
        return self.store.chunk_size

    # Attributes --------------------------------------------------------------------------

    def _current(self, attr: m.Attr) -> m.Attr:
        """Overlays what only this node knows: the size of a version it is writing. (Every
        attribute handed to the kernel passes here: it remembers which version they show.)"""
        state = self._writing.get(attr.version)
        if state is not None:
            attr.size, attr.mtime_ns = state.size, state.mtime_ns
            attr.ctime_ns = max(attr.ctime_ns, state.ctime_ns)
        if self.invalidate_attrs is not None and attr.version:
            self._kernel_versions[attr.ino] = (attr.version, attr.size)
        return attr

    async def lookup(self, parent: int, name: bytes) -> m.Attr | None:
        check_name(name)  # as the master would: a name that cannot exist is no miss (ENAMETOOLONG)
        private = self.private.named(parent, name) if self.temp_suffix else None
        if private is not None:  # this node's own temp file: nobody else knows it
            self.lookups_found += 1
            return self._current(private.attr())
        if self.dircache is not None:  # cluster mode: the node's copy of the directory first
            if self.membership.copies_current() and self.dircache.absent(parent, name):  # (kvfs.net.pushes)
                self.lookups_absent += 1
                return None
            copied = self.dircache.present(parent, name)
            if copied is not None:
                return self._found(copied, copy.copy(copied.attr))  # (_current may change the copy it gets)
            if self.misses.absent(parent, name, self.clock.monotonic()):  # (kvfs.node.misses)
                self.lookups_absent += 1
                return None
            if self.dircache.copy_due(parent) and self.membership.copies_current() and \
                    await self.membership.copy_directory(parent):
                if self.dircache.absent(parent, name):  # copied in the lookup's own round trip
                    self.lookups_absent += 1
                    return None
                copied = self.dircache.present(parent, name)
                if copied is not None:
                    return self._found(copied, copy.copy(copied.attr))
        # A directory or a file held here resolves as last seen while the master is
        # unreachable, at once (kvfs.node.heldnames); other names wait for it.
        held = self.membership.names.answer(parent, name, self._held_attr)
        asked, token = self.clock.monotonic(), self.misses.token()
        try:
            entry = await self.master.call(m.Lookup(parent, name, self.temp_suffix),
                                           wait_s=0 if held is not None else None)
        except MasterUnavailable:
            if held is None:
                raise
            return self._current(copy.copy(held))
        if self.dircache is not None and self.dircache.asked(parent):
            await self.membership.copy_directory(parent)
        attr = entry.attr
        if attr is None:
            if entry.no_temps:  # (kvfs.node.misses)
                self.misses.missed(parent, name, asked, token)
            self.lookups_absent += 1
            return None
        self.membership.names.seen(parent, name, attr)
        return self._found(entry, attr)

    def _held_attr(self, ino: int) -> m.Attr | None:
        local = self._local.get(ino)
        return self._dir_attrs.get(ino) or (local[1] if local is not None and local[0] in self.store else None)

    def _found(self, entry: m.Entry, attr: m.Attr) -> m.Attr:
        """A name that exists: a sealed file on another node starts coming here (prefetch)."""
        if entry.node and self.prefetches is not None and self.prefetches.wanted(attr.version, attr.size):
            self.prefetches.add(self._start_remote(attr.version, attr.size, entry.address, entry.checksums,
                                                   prefetch=True))
        self._remember_dir(attr)
        self.lookups_found += 1
        return self._current(attr)

    async def getattr(self, ino: int) -> m.Attr:
        # The kernel re-reads a directory's attributes after every change in it (to check
        # permissions on path walks): those that came with this node's own change answer
        # (kvfs.node.dircache.OwnChanges); while the master is unreachable the last known
        # ones do, so that files stored here stay readable.
        private = self.private.of_ino(ino)
        if private is not None:
            return self._current(private.attr())
        fresh = self.own_changes.get(ino, self.clock.monotonic())
        if fresh is not None:
            return fresh
        cached = self._dir_attrs.get(ino)
        if cached is None and ino in self._local:
            cached = self._local[ino][1]
        try:
            with _stale_if_gone(ino, self.dircache):
                attr = await self.master.call(m.GetAttr(ino), wait_s=0 if cached is not None else None)
        except MasterUnavailable:
            if cached is None:
                raise
            return cached
        self._remember_dir(attr)
        if ino in self._local and self._local[ino][0] == attr.version:
            self._local[ino] = (attr.version, attr)
        return self._current(attr)

    def _remember_dir(self, attr: m.Attr) -> None:
        if stat.S_ISDIR(attr.mode):
            if len(self._dir_attrs) >= DIR_ATTR_CACHE and attr.ino not in self._dir_attrs:
                self._dir_attrs.pop(next(iter(self._dir_attrs)))
            self._dir_attrs[attr.ino] = attr

    async def setattr(self, ino: int, size: int | None, mode: int | None, uid: int | None, gid: int | None,
                      atime_ns: int | None, mtime_ns: int | None, handle: OpenFile | None) -> m.Attr:
        private = self.private.of_ino(ino)
        if private is not None:
            if (mode, uid, gid, atime_ns, mtime_ns) == (None,) * 5 and private.version in self._writing:
                self._check_file_size(size or 0)  # a truncate while written: this node's alone
                if size is not None:
                    self._resize(private.version, size)
                return await self.getattr(ino)
            await self.promote(ino)  # anything else: the master's, as for any file
        if size is not None:
            await self._truncate(ino, size, handle)
        if (mode, uid, gid, atime_ns, mtime_ns) != (None,) * 5:
            attr = await self.change(m.SetAttr(ino, mode, uid, gid, atime_ns, mtime_ns))
            state = self._writing.get(attr.version)
            if mtime_ns is not None and state is not None:  # else the seal would put back the last write's
                state.mtime_ns = mtime_ns
            if mode is not None or uid is not None or gid is not None:
                await self.store.refresh_record(attr.version)
        return await self.getattr(ino)

    async def _truncate(self, ino: int, size: int, handle: OpenFile | None) -> None:
        self._check_file_size(size)
        if handle is not None and handle.writable:
            self._resize(handle.version, size)
            return
        # A path truncate is a short write session: copy-on-write, resize, seal.
        opened = await self._open_version(ino, truncate=size == 0)
        try:
            self._resize(opened.version, size)
        finally:
            await self.release(opened)

    def _resize(self, version: int, size: int) -> None:
        state = self._writing[version]
        if size < state.size:
            self.store.truncate(version, size)
        if size < state.charged:
            self.unsealed.credit(state.uid, state.charged - size)
            state.charged = size
        else:  # the gaps are filled with zeros in DRAM at the seal
            self._charge(state, size, f"version {version}")
        state.size = size
        state.mtime_ns = state.ctime_ns = self.clock.wall_ns()

    def _charge(self, state: WriteState, end: int, what: str) -> None:
        """Counts a version's bytes up to `end` against its writer's cap (EDQUOT past it)."""
        if end > state.charged:
            self.unsealed.charge(state.uid, end - state.charged, what)
            state.charged = end

    def _check_file_size(self, size: int) -> None:
        capacity = self.store.dram.capacity
        if size > capacity:
            raise StorageError(errno.EFBIG, f"a file of {size} bytes cannot fit in the {capacity}-byte DRAM tier")

    # Namespace -----------------------------------------------------------------------------

    async def mkdir(self, parent: int, name: bytes, mode: int, uid: int, gid: int) -> m.Attr:
        asked, token = self.clock.monotonic(), self.misses.token()
        made = await self.change(m.MkDir(parent, name, mode, uid, gid))
        attr = m.Attr(**{field: getattr(made, field) for field in m.Attr.__struct_fields__})  # (not the parent's)
        self._remember_dir(attr)
        self.membership.names.seen(parent, name, attr)
        self._own_change(parent, name, present=True)
        if self.dircache is not None:  # a new directory holds no temp name (kvfs.node.misses)
            self.misses.missed(attr.ino, b"", asked, token)
        return attr

    async def symlink(self, parent: int, name: bytes, target: bytes, uid: int, gid: int) -> m.Attr:
        attr = await self.change(m.Symlink(parent, name, target, uid, gid))
        self._own_change(parent, name, present=True)
        return attr

    async def readlink(self, ino: int) -> bytes:
        return (await self.master.call(m.ReadLink(ino))).target

    async def unlink(self, parent: int, name: bytes) -> None:
        private = self.private.named(parent, name) if self.temp_suffix else None
        if private is not None:
            self._unlink_private(private)
            self.kernel_dirs.private_change(parent)
            return
        done = await self.change(m.Unlink(parent, name))
        self.drop(done.dropped)
        self._own_change(parent, name, False, done)

    async def rmdir(self, parent: int, name: bytes) -> None:
        done = await self.change(m.RmDir(parent, name))
        self._own_change(parent, name, False, done)

    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes, noreplace: bool) -> None:
        private = self.private.named(parent_old, name_old) if self.temp_suffix else None
        if private is not None:
            await self._rename_private(private, parent_new, name_new, noreplace)
            return
        replaced = self.private.named(parent_new, name_new) if self.temp_suffix else None
        if replaced is not None and noreplace:
            raise MetadataError(errno.EEXIST, f"{name_new!r} exists in directory {parent_new}")
        done = await self.change(m.Rename(parent_old, name_old, parent_new, name_new, noreplace))
        if replaced is not None:  # a file renamed over this node's temp file: that one goes
            self._unlink_private(replaced)
        self.membership.names.moved(parent_old, name_old, parent_new, name_new)
        self._own_change(parent_old, name_old, False, done)
        self._own_change(parent_new, name_new, True, done)
        self.drop(done.dropped)
        relocated = done.relocated  # rewritten before replying: a crash must not resurrect the old name
        for at in range(0, len(relocated), RECORD_BATCH):  # (a sync per batch, not per record)
            await self.store.refresh_records(relocated[at:at + RECORD_BATCH])

    async def change(self, request: m.Request) -> Any:
        """This node's change of the namespace or of attributes: the master's answer. The
        attributes of directories that come with it (a create's, a rename's) answer the
        kernel's getattr that follows, while no other change of this node can have moved
        them (kvfs.node.dircache.OwnChanges)."""
        token = self.own_changes.begin()
        directories: list[m.Attr] = []
        self.kernel_dirs.changed_request(request)
        if self.dircache is not None:
            self.misses.changed_request(request)
        try:
            try:
                answer = await self.master.call(request)
            except MetadataError as error:
                if error.errno == errno.EEXIST:
                    self._found_existing(request)
                raise
            if isinstance(answer, (m.Opened, m.Made)) and answer.parent is not None:
                directories = [answer.parent]
            elif isinstance(answer, (m.Done, m.Published)):
                directories = answer.directories
            for attr in directories:
                self._remember_dir(attr)
        finally:
            now = self.clock.monotonic()
            kept = self.own_changes.end(token, directories, now)
            self.kernel_dirs.changed_request(request)  # (a getattr answered while it was in flight)
            if kept:  # (and the kernel's getattr after that second: kvfs.node.kernelattrs)
                self.kernel_dirs.change_answered(directories, now)
            if self.dircache is not None:
                self.misses.changed_request(request)
        if self.dircache is not None and adds_temp_name(request, self.temp_suffix):
            # Other nodes may answer temp names there absent for a second after a miss the
            # master answered before this change (kvfs.node.misses): that second passes first.
            await trio.sleep(self.misses.window_s)
        return answer

    def _found_existing(self, request: m.Request) -> None:
        """The master refused to make a name because it exists: another node made it since
        this node last looked (vLLM's store ignores that EEXIST and walks on through the
        name). The node's copy may not hold that node's change yet; from now its lookups of
        the name ask the master, so the walk finds it instead of ENOENT."""
        added = m.added_name(request)
        if added is not None:
            self._own_change(*added, present=True)

    def _own_change(self, parent: int, name: bytes, present: bool, answer: Any = None) -> None:
        """This node's own change, in its directory copies before the reply (the master's
        push of it follows, with the entry): the copy never answers a lookup with what a
        name was before this node changed it (a new directory absent, a removed file there).
        A name added is known only to exist until the push: lookups of it ask the master.
        When the master's account of the change came with its answer (`changes`, applied
        as it arrived), that account stands: it may hold the entry, which this would erase."""
        changes = getattr(answer, "changes", None)
        if changes and any(change[0] == parent and change[1] == name for change in changes):
            return
        self.membership.name_changed((parent, name, present, None))

    async def readdir(self, ino: int, start_id: int, limit: int) -> list[m.DirEntry]:
        entries = (await self.master.call(m.ReadDir(ino, start_id, limit))).entries
        self.misses.forget(ino)
        for entry in entries:
            self._current(entry.attr)
        return entries

    async def forget(self, inos: list[int]) -> None:
        for ino in inos:
            self._cached_version.pop(ino, None)
            self._kernel_versions.pop(ino, None)
        self.drop((await self.master.call(m.Forget(inos))).dropped)  # bytes of unlinked files that lingered

    # Files ---------------------------------------------------------------------------------

    async def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int, exclusive: bool) -> tuple[OpenFile, m.Attr]:
        if self.temp_suffix and name.endswith(self.temp_suffix):
            created = await self._create_private(parent, name, mode, uid, gid, exclusive)
            if created is not None:
                return created
        opened = await self.change(m.Create(parent, name, mode, uid, gid, self.node_id, exclusive))
        self._own_change(parent, name, True, opened)
        self.membership.names.seen(parent, name, opened.attr)
        handle = await self._start_writing(opened, truncate=False, uid=uid)
        return handle, self._current(opened.attr)

    # Private temp files (kvfs.node.private) --------------------------------------------

    def is_private(self, version: int) -> bool:
        """A version of a temp file only this node knows (not reported to the master)."""
        return self.private.of_version(version) is not None

    def is_private_ino(self, ino: int) -> bool:
        return ino in self.private

    async def _create_private(self, parent: int, name: bytes, mode: int, uid: int, gid: int,
                              exclusive: bool) -> tuple[OpenFile, m.Attr] | None:
        """A temp file created here, with numbers from the granted block: no request. None:
        the name is a private file no writer has open, which a non-exclusive create opens
        through the master (it is handed over first, as for a second write session)."""
        check_name(name)
        existing = self.private.named(parent, name)
        if existing is not None:
            if exclusive:
                raise MetadataError(errno.EEXIST, f"{name!r} exists in directory {parent}")
            state = self._writing.get(existing.version)
            if state is None:
                await self._publish(existing, existing.parent, existing.name, noreplace=False)
                return None
            state.writers += 1  # joining the version being written, as the master would
            self._count_open(existing.version, True, 1)
            return OpenFile(existing.ino, existing.version, True, 0), self._current(existing.attr())
        ino, version = await self._take_numbers()
        now = self.clock.wall_ns()
        private = PrivateFile(parent, name, ino, version, mode, uid, gid, now, now, now,
                              last_used=self.clock.monotonic())
        self.private.add(private)
        try:
            handle = await self._start_writing(m.Opened(private.attr(), version), truncate=False, uid=uid)
        except BaseException:
            self.private.forget(private)
            raise
        self.kernel_dirs.private_change(parent)
        return handle, self._current(private.attr())

    async def _take_numbers(self) -> tuple[int, int]:
        """An inode and a version number from the granted blocks; the next block is asked
        for in the background before they run out (here, only if they did)."""
        taken = self.numbers.take()
        if taken is None:
            await self._refill_numbers()
            taken = self.numbers.take()
            if taken is None:  # (taken by other creates meanwhile: one more block)
                await self._refill_numbers(force=True)
                taken = self.numbers.take()
                assert taken is not None
        if self.numbers.low() and not self._numbers_lock.locked():
            self.store.spawn(self._refill_in_background)
        return taken

    async def _refill_numbers(self, force: bool = False) -> None:
        async with self._numbers_lock:
            if self.numbers.low() or force:
                self.number_requests += 1
                self.numbers.add(await self.master.call(m.GrantNumbers(NUMBER_BLOCK)))

    async def _refill_in_background(self) -> None:
        try:
            await self._refill_numbers()
        except KvfsError as error:  # the next create that finds none left asks again
            log.debug("asking the master for inode and version numbers failed: %s", error)

    async def _open_private(self, ino: int, flags: int) -> tuple[OpenFile, bool] | None:
        """A reader of a private file opens it here; a writer (a second write session,
        O_TRUNC) is served by the master once the file is handed to it (None)."""
        private = self.private.of_ino(ino)
        assert private is not None
        if flags & os.O_ACCMODE != os.O_RDONLY:
            await self.promote(ino)
            return None
        source = await self.store.open_read(private.version)
        self._count_open(private.version, False, 1)
        self.reader_opens[source.tier] += 1
        handle = OpenFile(ino, private.version, False, private.size, source, leased=False)
        if private.version in self._writing:
            self._early_readers.setdefault(private.version, []).append(handle)
        return handle, False

    def _release_private(self, handle: OpenFile, private: PrivateFile) -> None:
        """A handle of a private file closed: the last writer seals it here (the master
        learns of it at the rename); an unlinked one goes with its last handle."""
        version = handle.version
        self._count_open(version, handle.writable, -1)
        if handle.source is not None:
            self.store.close_read(handle.source)
            self._forget_early_reader(handle)
        state = self._writing.get(version)
        if handle.writable and state is not None:
            state.writers -= 1
            if state.writers:
                return
            del self._writing[version]
            self.unsealed.credit(state.uid, state.charged)
            if private.linked:
                private.checksums = self.store.seal(version, state.size)
                private.size, private.sealed = state.size, True
                private.mtime_ns, private.ctime_ns = state.mtime_ns, max(state.ctime_ns, state.mtime_ns)
                private.last_used = self.clock.monotonic()
                for reader in self._early_readers.pop(version, []):
                    reader.size = state.size
        if not private.linked and (version, False) not in self._opens and (version, True) not in self._opens:
            self._discard_private(private)

    def _unlink_private(self, private: PrivateFile) -> None:
        self.private.unlink(private)  # (the kernel made the change: it needs no invalidation)
        if (private.version, False) not in self._opens and (private.version, True) not in self._opens:
            self._discard_private(private)

    def _discard_private(self, private: PrivateFile) -> None:
        self.private.forget(private)
        self._early_readers.pop(private.version, None)
        self.store.drop(private.version)

    async def _rename_private(self, private: PrivateFile, parent: int, name: bytes, noreplace: bool) -> None:
        """To another temp name: here alone. To any other name: published."""
        if not name.endswith(self.temp_suffix):
            await self._publish(private, parent, name, noreplace)
            return
        target = self.private.named(parent, name)
        if target is private:
            return
        if target is not None:
            if noreplace:
                raise MetadataError(errno.EEXIST, f"{name!r} exists in directory {parent}")
            self._unlink_private(target)
        self.kernel_dirs.private_change(private.parent)
        self.kernel_dirs.private_change(parent)
        self.private.move(private, parent, name)
        private.ctime_ns = self.clock.wall_ns()
        private.last_used = self.clock.monotonic()

    async def promote(self, ino: int) -> None:
        """Hands a private file to the master under its own name, for what is not handled
        here (chmod, xattrs, a second write session): from then on it is any file."""
        private = self.private.of_ino(ino)
        if private is not None:
            await self._publish(private, private.parent, private.name, noreplace=False)

    async def _publish(self, private: PrivateFile, parent: int, name: bytes, noreplace: bool) -> None:
        """One request: the master creates, seals and renames the file, saves that and
        answers once the other nodes have the name (kvfs.net.pushes). A refusal leaves the
        temp file as it was (a failed rename changes nothing)."""
        state = self._writing.get(private.version)
        request = m.Publish(parent, name, self.node_id, private.ino, private.version, private.mode, private.uid,
                            private.gid, private.size, private.checksums, private.mtime_ns, private.ctime_ns,
                            sealed=state is None, writers=state.writers if state is not None else 0,
                            noreplace=noreplace)
        if state is not None:
            request.size, request.mtime_ns = state.size, state.mtime_ns
        published = await self.change(request)
        self.private.forget(private)
        self.published += 1
        self.membership.names.seen(parent, name, published.attr)
        self._own_change(parent, name, True, published)
        self.drop(published.dropped)
        if state is None:
            self._remember_local(private.ino, private.version, published.attr)
            if self.store.ssd is not None and self.store.settings.offload == "eager":
                self.store.offloader.queue(private.version)  # (passed over while it was private)

    def _collect_private_orphans(self) -> None:
        """Private temp files closed and untouched for the grace period go, as the master's
        orphans do (a writer that died between close and rename)."""
        deadline = self.clock.monotonic() - self.temp_grace_s
        for private in self.private:
            if private.sealed and private.last_used < deadline and (private.version, False) not in self._opens:
                self.private.unlink(private)
                self.forget_entries([(private.parent, private.name, private.ino)])
                self._discard_private(private)

    async def open(self, ino: int, flags: int, uid: int = 0) -> tuple[OpenFile, bool]:
        """Opens a file; returns the handle and whether the kernel may keep its cached pages."""
        if ino in self.private:  # (kvfs.node.private: a read here, a write through the master)
            opened = await self._open_private(ino, flags)
            if opened is not None:
                return opened
        with _stale_if_gone(ino, self.dircache):
            return await self._open(ino, flags, uid)

    async def _open(self, ino: int, flags: int, uid: int) -> tuple[OpenFile, bool]:
        if flags & os.O_ACCMODE == os.O_RDONLY:
            try:
                opened, source = await self._open_reader(ino)
            except MasterUnavailable:
                return await self._open_without_master(ino)
            self._count_open(opened.version, False, 1)
            self.reader_opens[source.tier] += 1
            handle = OpenFile(ino, opened.version, False, opened.attr.size, source)
            if opened.version in self._writing:
                self._early_readers.setdefault(opened.version, []).append(handle)
            shown = (opened.version, opened.attr.size)
            if self.invalidate_attrs is not None and self._kernel_versions.get(ino, shown) != shown:
                await self.invalidate_attrs(ino)  # the kernel re-reads the size before reading
                self._kernel_versions[ino] = shown
            if opened.attr.sealed and not opened.node:
                self._remember_local(ino, opened.version, opened.attr)
            keep_cache = opened.attr.sealed and self._cached_version.get(ino) == opened.version
            if opened.attr.sealed:
                self._cached_version[ino] = opened.version
            else:
                self._cached_version.pop(ino, None)
            return handle, keep_cache
        self._cached_version.pop(ino, None)
        return await self._open_version(ino, truncate=bool(flags & os.O_TRUNC), uid=uid), False

    async def _open_reader(self, ino: int) -> tuple[m.Opened, ReadSource]:
        """A reader's version and where its bytes come from. When the node that stores them
        does not answer (slow, a connection that failed), the master is asked again and the
        node tried again within PEER_BUDGET_S, then the open fails with EIO: only the
        master says that a file is absent (ENOENT), never a failed connection."""
        deadline = trio.current_time() + PEER_BUDGET_S
        pause = RETRY_PAUSE_S
        while True:
            opened = await self._open_read(ino)
            remote = bool(opened.node) and opened.node != self.node_id
            try:
                return opened, await self._open_source(opened, deadline)
            except StorageError as error:
                self.drop((await self.master.call(m.Release(opened.version, writer=False))).dropped)
                if not remote:
                    raise
                if trio.current_time() + pause >= deadline:
                    raise StorageError(errno.EIO, f"inode {ino}: node {opened.node} ({opened.address}) did not "
                                                  f"serve version {opened.version} within {PEER_BUDGET_S:g} s: "
                                                  f"{error}") from None
                log.debug("inode %d: node %d did not serve version %d (%s); asking again", ino, opened.node,
                          opened.version, error)
            except BaseException:  # (a corrupt first chunk's file is dropped here, its reader gone)
                self.drop((await self.master.call(m.Release(opened.version, writer=False))).dropped)
                raise
            await trio.sleep(pause)
            pause = min(2 * pause, 0.5)

    async def _open_read(self, ino: int) -> m.Opened:
        """The master's OpenRead. A version still being written on another node is waited
        for, up to SEAL_WAIT_S: the kernel sends a writer's RELEASE, which seals the file,
        only after close() returned, so the seal of a file just closed there may still be
        on its way (close-to-open). A file written for longer reads as empty."""
        released = self.releases.take() if self.releases is not None else []
        opened = await self.master.call(m.OpenRead(ino, released), wait_s=0)
        if self.releases is not None:
            self.releases.carried += len(released)
        self.drop(opened.dropped)
        if opened.attr.sealed or not opened.node or opened.node == self.node_id:
            return opened
        self.drop((await self.master.call(m.Release(opened.version, writer=False))).dropped)
        await self._wait_for_seal(ino, opened.version)
        return await self.master.call(m.OpenRead(ino))

    async def _wait_for_seal(self, ino: int, version: int | None) -> None:
        """Until the file is sealed or has a newer version than `version` (None: the current
        one), for at most SEAL_WAIT_S."""
        deadline = trio.current_time() + SEAL_WAIT_S
        pause = 0.002
        while trio.current_time() < deadline:
            await trio.sleep(pause)
            pause = min(2 * pause, 0.05)
            attr = await self.master.call(m.GetAttr(ino))
            version = attr.version if version is None else version
            if attr.sealed or attr.version != version:
                return

    async def _open_source(self, opened: m.Opened, deadline: float) -> ReadSource:
        """Where a reader's bytes come from: this node's tiers, or the node that stores them
        (already on their way if the lookup started a prefetch of this version)."""
        if not opened.node or opened.node == self.node_id:
            return await self.store.open_read(opened.version)
        self.remote_reads += 1
        prefetched = self.prefetches.claim(opened.version) if self.prefetches is not None else None
        if prefetched is not None and opened.attr.sealed:
            try:
                return await self._answered(prefetched, deadline)
            except StorageError as error:  # the owner refused it then; ask again now
                log.debug("version %d: prefetch failed (%s); fetching again", opened.version, error)
        elif prefetched is not None:
            self.store.close_read(prefetched)
        size = opened.attr.size if opened.attr.sealed else 0  # close-to-open: nothing until sealed
        return await self._open_remote(opened.version, size, opened.node, opened.address, opened.checksums,
                                       deadline)

    async def _open_remote(self, version: int, size: int, node: int, address: str, checksums: list[int],
                           deadline: float | None = None) -> ReadSource:
        if self.transport is None:
            raise StorageError(errno.EIO, f"version {version} is on node {node} and this node has no transport")
        if deadline is None:
            deadline = trio.current_time() + PEER_BUDGET_S
        return await self._answered(self._start_remote(version, size, address, checksums), deadline)

    async def _answered(self, source: ReadSource, deadline: float) -> ReadSource:
        """Waits, until `deadline`, for the node streaming `source` to answer."""
        with trio.move_on_at(deadline):
            return await self.store.remote_answered(source)
        self.store.close_read(source)  # (the stream gives its buffers back when it ends)
        raise StorageError(errno.EIO, f"version {source.version}: its node did not answer in time")

    def _start_remote(self, version: int, size: int, address: str, checksums: list[int],
                      prefetch: bool = False) -> ReadSource:
        """Starts streaming a version from the node at `address` into read buffers (a
        prefetch's runs take turns, and those waiting for one go out together)."""
        transport = self.transport
        assert transport is not None

        # A transport that verifies pieces hands each on as it arrives: the kernel's READs of
        # a chunk's first pieces are answered while its last ones are still on their way.
        by_piece = getattr(transport, "reports_pieces", False)
        deferred = getattr(transport, "takes_notices", False)
        batcher = self.batcher if prefetch else None
        turns = self.prefetches.turns if prefetch and self.prefetches is not None else None

        async def fetch(source: ReadSource, start: int, stop: int) -> None:
            lengths = [min(self.chunk_size, size - i * self.chunk_size) for i in range(start, stop)]

            def arrived(index: int) -> None:
                source.ready[index].set()

            answered = source.answered.set if start == 0 else lambda: None
            # The thread's reports reach the loop when a reader waits for them, or at the end.
            notices = Notices() if deferred else None
            if notices is not None:
                source.add_notices(notices)
            try:
                if batcher is not None:
                    await batcher.fetch(address, FetchRun(version, start, source.chunks[start:stop], lengths,
                                                          checksums, arrived, answered, source.piece_arrived,
                                                          notices))
                    return
                pieces: dict[str, Any] = {"on_piece": source.piece_arrived} if by_piece else {}
                if notices is not None:
                    pieces["notices"] = notices
                async with turns or contextlib.nullcontext():
                    await transport.fetch(address, version, start, source.chunks[start:stop], lengths, checksums,
                                          arrived, answered, **pieces)
            finally:
                if notices is not None:
                    source.end_notices(notices)
                    self.fetch_reports[0] += notices.posted
                    self.fetch_reports[1] += notices.wakeups

        return self.store.start_remote(version, size, fetch, REMOTE_STREAMS)

    async def _open_without_master(self, ino: int) -> tuple[OpenFile, bool]:
        """The master is unreachable: a file this node stores is still served from here."""
        known = self._local.get(ino)
        if known is None or known[0] not in self.store:
            raise MasterUnavailable(f"inode {ino}: the master is unreachable and this node does not store the file")
        version, attr = known
        source = await self.store.open_read(version)
        self.degraded_reads += 1
        self.reader_opens[source.tier] += 1
        return OpenFile(ino, version, False, attr.size, source, leased=False), self._cached_version.get(ino) == version

    def _remember_local(self, ino: int, version: int, attr: m.Attr) -> None:
        previous = self._local.get(ino)
        if previous is not None:
            self._local_inos.pop(previous[0], None)
        self._local[ino] = (version, attr)
        self._local_inos[version] = ino

    def open_counts(self) -> list[tuple[int, bool, int]]:
        """(version, writer, handles) of every handle open here, for a registration."""
        if self.releases is not None:  # released here, not yet there: the master learns these are closed
            self.releases.forget()
        return [(version, writer, count) for (version, writer), count in self._opens.items()
                if self.private.of_version(version) is None]  # (the master knows nothing of those)

    def writing(self) -> list[m.Held]:
        """The versions being written here, for a registration."""
        return [m.Held(version, state.size, False, False, state.mtime_ns) for version, state in self._writing.items()
                if self.private.of_version(version) is None]

    def _count_open(self, version: int, writer: bool, delta: int) -> None:
        key = (version, writer)
        count = self._opens.get(key, 0) + delta
        if count > 0:
            self._opens[key] = count
        else:
            self._opens.pop(key, None)

    async def _open_version(self, ino: int, truncate: bool, uid: int = 0) -> OpenFile:
        try:
            opened = await self.master.call(m.OpenWrite(ino, self.node_id, truncate))
        except MetadataError as error:
            if error.errno != errno.EBUSY:
                raise
            # Being written on another node: maybe a file closed there a moment ago, whose
            # RELEASE (the seal) is still on its way, as for readers (_open_read).
            await self._wait_for_seal(ino, None)
            opened = await self.master.call(m.OpenWrite(ino, self.node_id, truncate))
        return await self._start_writing(opened, truncate, uid)

    async def _start_writing(self, opened: m.Opened, truncate: bool, uid: int = 0) -> OpenFile:
        self.drop(opened.dropped)
        version = opened.version
        self._count_open(version, True, 1)
        state = self._writing.get(version)
        if state is not None:  # joining a version this node is already writing
            state.writers += 1
            if truncate:
                self._resize(version, 0)
        else:
            self.store.create(version)
            now = self.clock.wall_ns()
            state = self._writing[version] = WriteState(0, 1, now, now, uid=uid)
            if opened.copy_from:
                self._count_open(opened.copy_from, False, 1)
                try:
                    reader = None
                    if opened.node and opened.node != self.node_id:  # the old bytes are on another node
                        reader = await self._open_remote(opened.copy_from, opened.copy_size, opened.node,
                                                         opened.address, opened.checksums)
                    # Counted without the cap (refusing here would strand the opened version): the
                    # writes that follow are what the cap refuses.
                    self.unsealed.charge(uid, opened.copy_size, f"inode {opened.attr.ino}", capped=False)
                    state.charged = opened.copy_size
                    await self.store.copy(opened.copy_from, version, opened.copy_size, reader)
                    state.size = opened.copy_size
                finally:
                    self._count_open(opened.copy_from, False, -1)
                    self.drop((await self.master.call(m.Release(opened.copy_from, writer=False))).dropped)
        return OpenFile(opened.attr.ino, version, True, 0)

    def size_of(self, handle: OpenFile) -> int:
        state = self._writing.get(handle.version)
        return handle.size if state is None else state.size

    async def read(self, handle: OpenFile, offset: int, length: int) -> memoryview | bytes:
        """Exactly `length` bytes, or up to end of file: never short before it."""
        size = self.size_of(handle)
        if offset >= size or length <= 0:
            return b""
        length = min(length, size - offset)
        if handle.source is None:  # a writer reading its own version
            return self.store.dram.read(handle.version, offset, length)
        data = await self.store.read(handle.source, offset, length)
        self.served_bytes[handle.source.tier] += len(data)
        return data

    async def write(self, handle: OpenFile, offset: int, data: bytes) -> int:
        if not handle.writable:
            raise StorageError(errno.EBADF, f"inode {handle.ino} is not open for writing")
        end = offset + len(data)
        self._check_file_size(end)
        state = self._writing[handle.version]
        self._charge(state, end, f"inode {handle.ino}")
        await self.store.write(handle.version, offset, data)
        self.written_bytes += len(data)
        state.size = max(state.size, end)
        state.mtime_ns = state.ctime_ns = self.clock.wall_ns()
        return len(data)

    def _finish_writing(self, handle: OpenFile) -> m.Seal | None:
        """A writer's release. The last one seals the version, as on a local file system a
        file is final once its last open file description is gone: a descriptor closed while
        a duplicate of it (dup, a shell's `> file`) is still open ends nothing, since the
        kernel sends RELEASE only when every duplicate is closed. Returns the seal for the
        master (None if writers remain)."""
        state = self._writing[handle.version]
        state.writers -= 1
        if state.writers:
            return None
        del self._writing[handle.version]  # the last writer is done: the bytes are final
        self.unsealed.credit(state.uid, state.charged)
        checksums = self.store.seal(handle.version, state.size)
        for reader in self._early_readers.pop(handle.version, []):
            reader.size = state.size
        # Until the master confirms, a registration reports the seal (with its mtime) itself.
        self.membership.unreported_seals[handle.version] = state.mtime_ns
        return m.Seal(handle.version, state.size, state.mtime_ns, checksums, state.ctime_ns)

    async def release(self, handle: OpenFile) -> None:
        private = self.private.of_version(handle.version)
        if private is not None:
            self._release_private(handle, private)
            return
        self._count_open(handle.version, handle.writable, -1)
        seal = None
        try:
            if handle.source is not None:
                self.store.close_read(handle.source)
                self._forget_early_reader(handle)
            if handle.writable:
                seal = self._finish_writing(handle)
        finally:  # the reference goes even if sealing failed, or the version would leak
            if seal is not None:
                seal.release = handle.leased  # one request: the master seals, then releases
                await self._seal(handle, seal)
            elif handle.leased and not handle.writable and self.releases is not None:
                if self.releases.add(handle.version, trio.current_time()):  # the next OpenRead carries it, or a flush
                    self.store.spawn(self._flush_releases)
            elif handle.leased:
                try:
                    self.drop((await self.master.call(m.Release(handle.version, handle.writable))).dropped)
                except MasterUnavailable:
                    pass  # a new registration reports only the handles still open

    async def _flush_releases(self) -> None:
        """Sends the readers' releases that no OpenRead carried within RELEASE_DELAY_S."""
        assert self.releases is not None
        try:
            # Only releases that waited RELEASE_DELAY_S: younger ones ride on the next open.
            while (oldest := self.releases.oldest()) is not None:
                await trio.sleep_until(oldest + RELEASE_DELAY_S)
                versions = self.releases.take_due(max(oldest, trio.current_time() - RELEASE_DELAY_S))
                generation = self.releases.generation
                for version in versions:
                    if self.releases.generation != generation:  # registered again meanwhile: moot
                        break
                    # Never waiting for an unreachable master: the registration that follows
                    # reports only the handles still open, and a release sent after it could
                    # end another handle's lease on the same version.
                    self.drop((await self.master.call(m.Release(version, writer=False), wait_s=0)).dropped)
                    self.releases.flushed += 1
        except MasterUnavailable:
            pass  # a new registration reports only the handles still open (and forgets these)
        except Exception:  # a bug must not take the store's tasks down
            log.exception("releasing %d reader handles at the master failed", len(self.releases))
        finally:
            self.releases.flushing = False

    async def _seal(self, handle: OpenFile, seal: m.Seal) -> None:
        """Tells the master (the RELEASE is answered once it has the seal: an acknowledged
        close is durable there); with `seal.release`, the lease goes in the same request,
        released by the master even if the seal is refused."""
        try:
            sealed = await self.master.call(seal)
        except MasterUnavailable:
            log.warning("inode %d: the master is unreachable; its seal is reported on reconnection", handle.ino)
            return  # (and a new registration reports only the handles still open)
        self.membership.unreported_seals.pop(handle.version, None)
        self._remember_local(handle.ino, handle.version, sealed)
        if isinstance(sealed, m.Sealed):  # (an in-process master answers a seal without release with Attr)
            self.drop(sealed.dropped)

    def _forget_early_reader(self, handle: OpenFile) -> None:
        readers = self._early_readers.get(handle.version)
        if readers is not None and handle in readers:
            readers.remove(handle)
            if not readers:
                del self._early_readers[handle.version]

    async def fsync(self, handle: OpenFile) -> None:
        """A sealed file is durable once it is on SSD: fsync waits for its offload, and
        fails with EIO if the SSD tier cannot take it."""
        if not handle.writable and self.store.ssd is not None:
            await self.store.wait_saved(handle.version)

    # The store's owner: its requests to the master ------------------------------------

    async def reclaim(self, tier: str, nbytes: int) -> bool:
        removed = await self.master.call(m.Reclaim(self.node_id, nbytes, tier))
        self._apply_removed(removed)
        self.drop(removed.released)
        self.evicted_files += len(removed.dropped)
        if removed.dropped:
            log.debug("evicted %d files (%s) from %s", len(removed.dropped), format_size(removed.freed_bytes), tier)
            self.evictions.record(tier, len(removed.dropped), removed.freed_bytes)
            self.log_evictions()
        return bool(removed.dropped or removed.released)

    def log_evictions(self) -> None:
        line = self.evictions.summary(self.clock.monotonic())
        if line is not None:
            log.info(line)

    async def describe(self, version: int) -> DiskRecord | None:
        if self.private.of_version(version) is not None:
            return None  # not copied to SSD while private: a restart must not bring it back
        try:
            info = await self.master.call(m.GetRecord(version))
        except KvfsError:
            return None
        return DiskRecord(version, to_disk_file(info), [])

    async def offloaded(self, versions: list[int]) -> None:
        try:
            await self.master.call(m.Offloaded(versions))
        except MasterUnavailable as error:  # the re-registration that follows reports them on SSD
            log.debug("versions %s on SSD, not told to the master (%s)", versions[:5], error)

    async def lost(self, version: int) -> None:
        removed = await self.master.call(m.Lost(version))
        self._apply_removed(removed)
        self.evictions.record("lost", len(removed.entries), removed.freed_bytes)

    async def recover(self, temp_suffix: bytes) -> None:
        """Rebuilds the namespace from the SSD index after a restart (before mounting)."""
        ssd = self.store.ssd
        if ssd is None:
            return
        started = time.monotonic()
        total = ssd.index.count()
        restored = restored_bytes = 0
        discard: list[int] = []
        last_report = started
        for count, record in enumerate(ssd.recovered_records(), 1):
            if not record.file.path or record.file.path[-1].endswith(temp_suffix):
                discard.append(record.version)  # its writer died before publishing it
                continue
            checksums = [chunk[2] for chunk in record.chunks]
            restore = m.Restore(record.version, self.node_id, to_file_record(record.file), checksums)
            result = await self.master.call(restore)
            discard.extend(result.dropped)
            if result.kept:
                self.store.adopt_recovered(record.version, record.file.size, checksums)
                restored += 1
                restored_bytes += record.file.size
            if time.monotonic() - last_report > 1:
                last_report = time.monotonic()
                progress.report(f"recovering from {ssd.directory}: {count} of {total} files", log)
        for version in discard:
            self.store.drop_recovered(version)
        try:
            ssd.forget_recovered(discard)
        except STORAGE_ERRORS as error:  # (a full index file system): the offloader retries
            self.store.remove_later(discard, error)
        log.info("recovered %d files (%s) from %s in %.2f s; discarded %d", restored, format_size(restored_bytes),
                 ssd.directory, time.monotonic() - started, len(discard))

    # Capacity ------------------------------------------------------------------------------

    async def collect_orphans(self) -> int:
        """Runs every gc interval; also gives the eviction summary held back by its rate limit."""
        self.log_evictions()
        self._collect_private_orphans()
        try:
            removed = await self.master.call(m.CollectOrphans(), wait_s=0)
        except MasterUnavailable:
            return 0  # next time
        if removed.dropped:
            log.info("collected %d orphaned temp files (%d bytes)", len(removed.dropped), removed.freed_bytes)
            self.evictions.record("orphan", len(removed.dropped), removed.freed_bytes)
        self._apply_removed(removed)
        return len(removed.entries)

    def _apply_removed(self, removed: m.Removed) -> None:
        self.drop(removed.dropped)
        if removed.entries:
            self.forget_entries(removed.entries)

    def drop(self, versions: Iterable[int]) -> None:
        """Frees versions the master no longer knows (or never will again)."""
        for version in versions:
            self.store.drop(version)
            self.membership.unreported_seals.pop(version, None)
            ino = self._local_inos.pop(version, None)
            if ino is not None:
                del self._local[ino]

    async def stats(self) -> NodeStats:
        """Capacity as statfs reports it: the largest tier that holds every file (SSD when present)."""
        master = await self.master.call(m.Stats())
        tier = self.store.ssd if self.store.ssd is not None else self.store.dram
        return NodeStats(tier.capacity, tier.used, master.inodes, master.files)

    # Statistics ----------------------------------------------------------------------------

    def activity(self) -> m.Activity:
        backlog_files, backlog_bytes = self.store.offload_backlog()
        failed_files, failed_bytes = self.store.offload_failed()
        error = self.store.faults.last_error()
        return m.Activity(self.lookups_found, self.lookups_absent, self.reader_opens["dram"],
                          self.reader_opens["ssd"], self.reader_opens["peer"], backlog_files, backlog_bytes,
                          sum(self.served_bytes.values()), self.written_bytes, self.evicted_files,
                          getattr(self.transport, "kind", ""),
                          self.store.ssd.engine.kind if self.store.ssd is not None else "",
                          failed_files, failed_bytes, error)

    def store_stats(self) -> dict[str, float]:
        stats = asdict(self.store.stats)
        stats.update(dram_capacity=self.store.dram.capacity, dram_used=self.store.dram.used,
                     evicted_files=self.evicted_files, read_buffer_misses=self.store.read_buffers.misses,
                     node=self.node_id, remote_reads=self.remote_reads, degraded_reads=self.degraded_reads,
                     storage_errors=self.store.faults.total)
        stats.update(msgspec.structs.asdict(self.activity()))
        stats.update({f"served_bytes_{tier}": count for tier, count in self.served_bytes.items()})
        if self.prefetches is not None:
            stats.update(prefetches_started=self.prefetches.started, prefetches_claimed=self.prefetches.claimed,
                         prefetches_wasted=self.prefetches.wasted, prefetch_pauses=self.prefetches.gate.pauses)
        if self.batcher is not None:
            stats.update(prefetch_batches=self.batcher.batches, prefetch_batched_runs=self.batcher.batched_runs)
        if self.releases is not None:
            stats.update(releases_carried=self.releases.carried, releases_flushed=self.releases.flushed)
        if self.dircache is not None:
            stats.update(cached_directories=len(self.dircache), cached_names=self.dircache.total,
                         misses_answered_locally=self.dircache.answered,
                         hits_answered_locally=self.dircache.found)
        if self.transport is not None:
            stats.update(fetched_bytes=self.transport.fetched_bytes, fetch_reports=self.fetch_reports[0],
                         fetch_report_wakeups=self.fetch_reports[1])
        if self.store.ssd is not None:
            stats.update(ssd_capacity=self.store.ssd.capacity, ssd_used=self.store.ssd.used)
        return stats
