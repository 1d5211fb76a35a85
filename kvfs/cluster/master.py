"""The metadata service: one request in, one response out, no I/O (pure).

It owns the namespace, the object directory and the eviction policy. Every
decision (names, versions, leases, what to evict, which temp files are orphans)
is made here, synchronously, against an injected clock, so that it can be tested
without a mount and moved behind RPC without change.
"""

from __future__ import annotations

import errno
import stat
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import xxhash

from kvfs.clock import Clock
from kvfs.wire import messages as m
from kvfs.cluster.backlog import STEP_ITEMS, Backlog
from kvfs.cluster.liveness import Liveness
from kvfs.cluster.membership import Membership, take_ids
from kvfs.cluster.namespace import ROOT_INO, Inode, Namespace, check_name, check_target
from kvfs.cluster.objects import FileVersion
from kvfs.cluster.opens import OpenHandles
from kvfs.cluster.registry import LOCAL_NODE, Grant, Registry
from kvfs.cluster.relocations import Relocations
from kvfs.cluster.inttable import IntTable
from kvfs.cluster.tempfiles import TempFiles
from kvfs.cluster.totals import CountedObjects
from kvfs.cluster.usage import DirectoryUsage, DirTotals
from kvfs.cluster.validate import check_request, file_size, new_name, time_ns
from kvfs.errors import MetadataError
from kvfs.policy import EvictionPolicy

# The user attributes of one inode, names and values together (the kernel bounds each, not
# their number): what a GetRecord answer and a node's SSD index record carry.
XATTRS_MAX_BYTES = 256 << 10
RECLAIM_MAX_FILES = 16  # files evicted per reclaim request
# Candidates of the node and tier a reclaim looks at, at most, before it answers with what
# it found: bounds the request when most are open (the node asks again as files close).
RECLAIM_WALK_MAX = 8192
# Files being published passed over per reclaim before the scan stops and they are taken
# after all, in the policy's order: bounds the scan when nearly every file is fresh
# (writers that never rename, at a rate that fills the tier within the grace).
PUBLISHING_SKIP_MAX = 4096
# Temp files a CollectOrphans looks at, at most: the next request goes on from there (nodes
# ask every gc interval), so with more than this an orphan waits a few more intervals.
ORPHAN_WALK_MAX = 1024


def evict_group(version: FileVersion) -> tuple[int, bool]:
    """What the eviction policy files a file under: its node, and whether its copy is on SSD
    (a reclaim asks for one node's DRAM-only files, or for its files on SSD)."""
    node, _, _, _, on_disk = version.fields()
    return node, on_disk


_IDENTITY_MASK = (1 << 60) - 1


def name_identity(parent: int, name: bytes) -> int:
    """A stable hash of a file's place in the namespace (the same across re-creations). 60
    bits: an int of two 30-bit digits (32 B), not three (36 B, 48 allocated), and the reuse
    policy keeps one per file. (A mask, not a shift: a shifted int keeps the allocation of
    its operand's three digits.)"""
    return xxhash.xxh64_intdigest(parent.to_bytes(8, "little") + name) & _IDENTITY_MASK


@dataclass(frozen=True)
class MasterSettings:
    temp_suffix: bytes = b".tmp"  # names that writers publish by rename
    temp_grace_s: float = 300.0  # an untouched sealed temp file older than this is an orphan
    publish_grace_s: float = 30.0  # a new file closed this recently, not yet renamed or read, is evicted last
    root_mode: int = 0o755
    root_uid: int = 0
    root_gid: int = 0
    cluster: bool = False  # nodes register over the network (else one embedded local node)
    dead_after_s: float = 2.5  # a node silent this long is dead (heartbeats every 0.5 s)
    expire_interval_s: float = 0.25  # how often the daemon asks `expire_nodes`
    # Expiry passes further apart than this mean the master itself stalled: every node
    # gets a fresh grace instead of being judged (kvfs.cluster.liveness). Kept under half
    # of dead_after_s and over three intervals (see `stall_gap`).
    stall_gap_s: float = 1.0
    # A node dead this long is forgotten as by `kvfs remove-node` (its hidden files leave the
    # namespace, its name is free): a machine retired without that command does not hold
    # names and status rows for ever. 0: never. Counted in the master's running time.
    forget_dead_after_s: float = 7 * 86400.0
    # Entries a rename's walk looks at per step (kvfs.cluster.relocations).
    relocate_slice: int = STEP_ITEMS


def stall_gap(settings: MasterSettings) -> float:
    """The gap between expiry passes that counts as a stall of the master: short enough
    that a stall just under it leaves a node most of its deadline (at most half of
    dead_after_s), long enough that passes a little late never count (three intervals)."""
    return max(3 * settings.expire_interval_s, min(settings.stall_gap_s, settings.dead_after_s / 2))


class MetadataService:
    """Handles metadata requests; see `kvfs.wire.messages` for the protocol. Cluster
    membership (registration, heartbeats, node death, watched directories) is a
    collaborator it owns, `self.members` (kvfs.cluster.membership)."""

    def __init__(self, clock: Clock, policy: EvictionPolicy, settings: MasterSettings = MasterSettings()) -> None:
        self.clock = clock
        self.policy = policy
        policy.keep_keys_in(IntTable())  # its keys are inode numbers, its records ints (kvfs.policy.base)
        self.settings = settings
        self.ns = Namespace(clock.wall_ns(), settings.root_mode, settings.root_uid, settings.root_gid)
        self.objects = CountedObjects()  # an ObjectDirectory with per-node running totals
        self.objects.tier_changed = self._tier_changed
        self.dir_totals = DirTotals(self.objects)  # per directory, what its subtree holds (kvfs du)
        self.registry = Registry(settings.dead_after_s)
        if not settings.cluster:
            self.registry.add_local()
        self._temp_files = TempFiles()
        # Files being published: created here and not yet renamed or read. The value is
        # when the file was closed (sealed), None while it is still being written.
        self._unpublished: dict[int, float | None] = {}
        # When each of those was closed, and its inode, in time order: two deques of the objects
        # `_unpublished` holds anyway, not a (closed, ino) tuple per file (56 B each).
        self._closed_at: deque[float] = deque()
        self._closed_inos: deque[int] = deque()
        self._unpublished_peak = 0
        self._caller = LOCAL_NODE  # the node whose request is being handled
        self.opens = OpenHandles()
        self.liveness = Liveness(self.registry, stall_gap(settings), clock.monotonic())
        self.backlog = Backlog()  # long work, done in slices between requests (`pending_work`)
        self.members = Membership(clock, self.ns, self.objects, self.registry, self.opens, self.liveness, self,
                                  self.backlog, self.dir_totals,
                                  settings.forget_dead_after_s if settings.cluster else 0.0)
        # Index records to rewrite after renames, for each file's own node (kvfs.cluster.relocations).
        self.relocations = Relocations(self.ns, self.objects.versions, self.registry, self.backlog,
                                       settings.relocate_slice)
        self._removed_names: list[tuple[int, bytes, int]] = []  # for the other nodes' kernels to forget
        # Unlinked inode -> (its version, still readable; the node whose kernel holds it).
        self._lingering: dict[int, tuple[int, int]] = {}
        self._handlers: dict[type, Callable[[Any], Any]] = {
            m.Lookup: self._lookup,
            m.GetAttr: self._getattr,
            m.SetAttr: self._setattr,
            m.MkDir: self._mkdir,
            m.Symlink: self._symlink,
            m.ReadLink: self._readlink,
            m.Create: self._create,
            m.Unlink: self._unlink,
            m.RmDir: self._rmdir,
            m.Rename: self._rename,
            m.ReadDir: self._readdir,
            m.Forget: self._forget,
            m.OpenRead: self._open_read,
            m.OpenWrite: self._open_write,
            m.Release: self._release,
            m.Seal: self._seal,
            m.GetXattr: self._getxattr,
            m.SetXattr: self._setxattr,
            m.ListXattr: self._listxattr,
            m.RemoveXattr: self._removexattr,
            m.GetVersion: self._get_version,
            m.Reclaim: self._reclaim,
            m.Offloaded: self._offloaded,
            m.GetRecord: self._get_record,
            m.Lost: self._lost,
            m.Restore: self.restore,
            m.CollectOrphans: self._collect_orphans,
            m.Stats: self._stats,
            m.Register: self._register,
            m.Report: self._report,
            m.FinishRegistration: lambda req: self.members.finish_registration(req, self._caller),
            m.Heartbeat: self._heartbeat,
            m.ClusterStatus: self.members.cluster_status,
            m.WatchNames: lambda req: self.members.watch_names(req, self._caller),
            m.Unwatch: lambda req: self.members.unwatch(req, self._caller),
            m.RemoveNode: self.members.remove_node,
            m.DirUsage: self._dir_usage,
            m.GrantNumbers: self._grant_numbers,
            m.Publish: self._publish,
        }
        self.usage = DirectoryUsage()
        self.notify: set[int] = set()  # nodes with name changes to push
        self.evicted_files = 0  # decided by `_reclaim`, since this process started
        self.evicted_bytes = 0

    def handle(self, request: m.Request, caller: int = LOCAL_NODE, decoded: bool = False) -> Any:
        """Answers one request from node `caller`; raises MetadataError with the errno it should see.

        Versions dropped on behalf of other nodes, and names other nodes' kernels may
        cache, are queued for those nodes and delivered with their next heartbeat.

        The request is checked first (kvfs.cluster.validate): one that fails changes nothing.
        DECODED: it came from a frame, whose decoder checked the structs' bounds already."""
        check_request(request, decoded)
        self._caller = caller
        try:
            response = self._handlers[type(request)](request)
            if self.objects.dropped_log:  # (most requests drop nothing: no set built for them)
                others = {v.version for v in self.objects.dropped_log if v.node != caller}
                if others and isinstance(getattr(response, "dropped", None), list):
                    response.dropped = [v for v in response.dropped if v not in others]  # theirs, not the caller's
        finally:
            self.route_outcomes(caller)
        return response

    def pending_work(self, budget_s: float) -> bool:
        """Runs slices of long work (a dead node's files, a forgotten node's names) for about
        `budget_s`; the daemon calls it between requests while it returns True (work left)."""
        self.relocations.forget(self.registry.nodes)
        return self.backlog.run(budget_s)

    def expire_nodes(self) -> list[int]:
        """Declares nodes that stopped heartbeating dead; returns their ids (called periodically)."""
        return self.members.expire_nodes()

    def take_notifications(self, node_id: int) -> list[m.NameChange]:
        """The name changes queued for a node's copies of watched directories."""
        return self.members.take_notifications(node_id)

    def load(self, inodes: list[Inode], versions: list[FileVersion], next_ino: int, next_entry_id: int,
             next_version: int, nodes: list[tuple[int, str, str]],
             grants: dict[int, list[Grant]] | None = None) -> None:
        """Saved state after a master restart (see kvfs.cluster.persist); nodes are not alive
        until they register again, so their files stay hidden until then. `grants`: the
        number blocks granted to each node, which it may still publish with."""
        for inode in inodes:
            if inode.ino == ROOT_INO:
                inode.refs = -1
        self.ns.inodes.clear()
        self.ns.files = 0
        self.ns.restore(inodes)
        self.ns.next_ino = max(self.ns.next_ino, next_ino)
        self.ns.next_entry_id = max(self.ns.next_entry_id, next_entry_id)
        self.objects.load(versions, next_version)
        self.registry.load(nodes, self.clock.monotonic(), grants)
        now = self.clock.monotonic()
        for inode in sorted((i for i in inodes if i.is_file), key=lambda i: i.mtime_ns):
            version = self.objects.versions.get(inode.version)
            if version is not None and version.version == inode.ino:  # one int object for the two numbers
                version.version = version.ino = inode.version = inode.ino
            if self._is_temp(inode.name):
                self._temp_files.add(inode.ino)
            if version is not None and version.sealed:
                self._identify(inode)
                self.policy.insert(inode.ino, version.size, now, evict_group(version))
        self.dir_totals.recount(self.ns)

    def apply(self, inodes: list[Inode], versions: list[FileVersion], gone_inodes: list[int],
              gone_versions: list[int], counters: tuple[int, int, int], nodes: list[tuple[int, str, str]],
              gone_nodes: list[int], grants: dict[int, list[Grant]] | None = None) -> None:
        """Records a leader committed after those `load` took (a standby following etcd,
        kvfs.net.follow), the last value of each, all of one or more complete commits:
        leaves the state as a `load` of every record would. Changes nothing saved dirty."""
        ns, objects, now = self.ns, self.objects, self.clock.monotonic()
        given = {inode.ino: inode for inode in inodes}
        touched = {*gone_inodes, *given, *(version.ino for version in versions)}
        touched.update(objects.versions[v].ino for v in gone_versions if v in objects.versions)
        self._totals_leave(touched)
        moved: dict[int, Inode] = {}
        for ino in [*gone_inodes, *given]:  # every entry that moves or goes first: a new one may take its name
            old, new = ns.inodes.get(ino), given.get(ino)
            if new is not None and (old is None or (old.parent, old.key, old.entry_id) != (new.parent, new.key,
                                                                                           new.entry_id)):
                moved[ino] = new
            if old is not None and old.parent and (new is None or ino in moved):
                entries = ns.inodes[old.parent].children
                entries.remove(old.key, old.entry_id)  # type: ignore[union-attr]
                entries.subdirs -= old.is_dir  # type: ignore[union-attr]
        for ino in gone_inodes:
            old = ns.inodes.pop(ino, None)
            ns.files -= old is not None and old.is_file
            self._temp_files.discard(ino)
            self.policy.remove(ino)
        for inode in inodes:
            old = ns.inodes.get(inode.ino)
            if old is None:
                ns.files += inode.is_file
            elif old.children is not None:
                inode.children = old.children  # a directory keeps its entries
            if inode.ino == ROOT_INO:
                inode.refs = -1
            ns.inodes[inode.ino] = inode
            ns.next_ino, ns.next_entry_id = max(ns.next_ino, inode.ino + 1), max(ns.next_entry_id, inode.entry_id + 1)
        for inode in sorted(moved.values(), key=lambda i: i.entry_id):
            if inode.parent:
                entries = ns.inodes[inode.parent].children
                entries.add(inode.key, inode.ino, inode.entry_id)  # type: ignore[union-attr]
                entries.subdirs += inode.is_dir  # type: ignore[union-attr]
        ns.next_ino, ns.next_entry_id = max(ns.next_ino, counters[0]), max(ns.next_entry_id, counters[1])
        for version_id in [*gone_versions, *(version.version for version in versions)]:
            if version_id in objects.versions:
                objects.forget(objects.versions[version_id])
        objects.load_more(versions, max(objects.next_version, counters[2]))
        objects.dropped_log.clear()
        for node_id in gone_nodes:
            node = self.registry.nodes.pop(node_id, None)
            if node is not None:
                self.registry.by_name.pop(node.name, None)
        self.registry.load(nodes, now, grants)
        for ino in sorted({*given, *(version.ino for version in versions)}):  # the policy, as `load` sets it
            inode = ns.inodes.get(ino)
            if inode is None or not inode.is_file:
                continue
            self.policy.remove(ino)
            (self._temp_files.add if self._is_temp(inode.name) else self._temp_files.discard)(ino)
            version = objects.versions.get(inode.version)
            if version is not None and version.sealed:
                self._identify(inode)
                self.policy.insert(ino, version.size, now, evict_group(version))
        ns.dirty.clear()
        for ino in gone_inodes:
            self.dir_totals.removed_dir(ino)  # (a file's number is no directory's: nothing then)
        self._totals_enter(touched)

    def _totals_leave(self, touched: set[int]) -> None:
        """`apply`'s first half of the per-directory totals' upkeep: each touched inode stops
        counting where it is linked, as it was; files first, then directories deepest first, so
        that no subtree is taken from an ancestor twice. O(touched x depth)."""
        ns = self.ns
        present = [ns.inodes[ino] for ino in touched if ino in ns.inodes]
        present.sort(key=lambda inode: (inode.children is not None, -ns.depth(inode)))
        for inode in present:
            self.dir_totals.leave(ns, inode)

    def _totals_enter(self, touched: set[int]) -> None:
        """The second half, once the records are in: directories shallowest first, then files."""
        ns = self.ns
        present = [ns.inodes[ino] for ino in touched if ino in ns.inodes]
        present.sort(key=lambda inode: (inode.children is None, ns.depth(inode)))
        for inode in present:
            self.dir_totals.enter(ns, inode)

    def route_outcomes(self, caller: int) -> None:
        log = self.objects.dropped_log
        if log:
            for version in log:
                node = self.registry.nodes.get(version.node)
                if node is not None and version.node != caller and (node.live or node.registering):
                    node.outbox_dropped.append(version.version)
            log.clear()
        if self.ns.changes:
            for watchers, parent, name, added in self.ns.changes:
                for node in self.registry.nodes.values():
                    if watchers & (1 << node.node_id) and (node.live or node.registering):
                        entry = self.copy_entry(parent, name, node.node_id) if added else None
                        node.outbox_names.append((parent, name, added, entry))
                        self.notify.add(node.node_id)
            self.ns.changes.clear()
        if self._removed_names:
            for node in self.registry.nodes.values():
                if node.live and node.node_id != caller:
                    node.outbox_forget.extend(self._removed_names)
            self._removed_names.clear()

    # Helpers ---------------------------------------------------------------------------

    def attr(self, inode: Inode) -> m.Attr:
        if inode.is_file:
            return self.file_attr(inode, self.objects.versions.get(inode.version))
        mode, uid, gid, _ = inode.meta
        atime, mtime, ctime = inode.times()
        if inode.children is not None:  # "." and each subdirectory's ".." link here
            return m.Attr(inode.ino, mode, 2 + inode.children.subdirs, uid, gid, 0, atime, mtime, ctime)
        return m.Attr(inode.ino, mode, 1 if inode.linked else 0, uid, gid, len(inode.target), atime, mtime, ctime)

    def file_attr(self, inode: Inode, version: FileVersion | None) -> m.Attr:
        """A regular file's attributes, its current version (or None) already at hand: the
        hot paths fetched it before and read its packed fields once here."""
        mode, uid, gid, _ = inode.meta
        atime, mtime, ctime = inode.times()
        if version is None:
            size, sealed = 0, True
        else:
            _, size, sealed, _, _ = version.fields()
        # (a file is never the root: linked is a parent)
        return m.Attr(inode.ino, mode, 1 if inode.parent else 0, uid, gid, size, atime, mtime, ctime, inode.version,
                      sealed)

    def copy_entry(self, parent: int, name: bytes, node: int) -> m.Entry | None:
        """What a lookup by `node` of a name in a directory it watches answers, for its copy
        of the directory to answer itself: only sealed current files on live nodes, whose
        entry changes only with a push (a new version, new attributes, removal). None: the
        node asks the master (directories, files being written, files on nodes that are down)."""
        directory = self.ns.inodes.get(parent)
        if directory is None or directory.children is None:
            return None
        child = directory.children.get(name)
        inode = self.ns.inodes.get(child) if child is not None else None
        if inode is None or inode.is_dir:
            return None
        version = self.objects.versions.get(inode.version)
        if version is None or not version.sealed or not version.current or not self.available(version):
            return None
        if version.node == node:
            return m.Entry(self.attr(inode))
        return m.Entry(self.attr(inode), version.node, self.registry.nodes[version.node].address, version.checksums)

    def changed(self, inode: Inode) -> None:
        """A file's entry changed (not its name): nodes watching its directory are told."""
        if inode.parent and inode.children is None:  # (linked, not a directory: the root is one)
            parent = self.ns.inodes.get(inode.parent)
            if parent is not None and parent.watchers:
                self.ns.changes.append((parent.watchers, parent.ino, inode.name, True))

    def _referenced(self, inode: Inode) -> m.Attr:
        """The attributes of an inode the caller's kernel now holds a reference to."""
        self.ns.reference(inode, self._caller)
        return self.attr(inode)

    def _visible(self, inode: Inode | None) -> Inode | None:
        """None for a file whose only copy is on a node that is down (it reappears when
        the node registers again); lookups, listings and opens treat it as absent."""
        return self._shown(inode)[0]

    def _shown(self, inode: Inode | None) -> tuple[Inode | None, FileVersion | None, bool]:
        """`_visible` with what it read: (the inode or None, a file's current version or None,
        whether that version's bytes can be had), each fetched and checked once."""
        if inode is None or inode.children is not None:
            return inode, None, False
        version = self.objects.versions.get(inode.version)
        if version is None:
            return inode, None, False
        if not self.available(version):
            return None, version, False
        return inode, version, True

    def available(self, version: FileVersion) -> bool:
        """Whether a version's bytes can be had: its node is live and still holds it."""
        return self.registry.holds(version.node, version.version) and version.version not in self.objects.gone

    def _entry(self, parent: int, name: bytes) -> Inode | None:
        return self._visible(self.ns.lookup(parent, name))

    def _claim(self, parent: int, name: bytes) -> None:
        """A new entry replaces a hidden file of the same name (the newer one wins anyway)."""
        inode = self.ns.lookup(parent, name)
        if inode is not None and self._visible(inode) is None:
            dropped: list[int] = []
            self.remove_file(inode, self.clock.wall_ns(), dropped)

    def _count_open(self, version: int, writer: bool, delta: int) -> None:
        self.opens.count(self._caller, version, writer, delta)

    def _file(self, ino: int) -> Inode:
        inode = self.ns.get(ino)
        if inode.is_dir:
            raise MetadataError(errno.EISDIR, f"inode {ino} is a directory")
        if inode.is_symlink:  # the kernel follows links itself: only O_NOFOLLOW gets here
            raise MetadataError(errno.ELOOP, f"inode {ino} is a symbolic link")
        return inode

    def _known_node(self, node: int) -> None:
        """A version is stored on a node the registry knows (else nothing could ever remove it)."""
        if node not in self.registry.nodes:
            raise MetadataError(errno.EINVAL, f"no node {node} is registered")

    @staticmethod
    def _check_linked(inode: Inode) -> None:
        # ESTALE, not ENOENT: the kernel resolved the name before it was removed or
        # replaced, and on ESTALE it looks the name up again and retries the open,
        # so a rename over a file is atomic for a concurrent open.
        if not inode.linked:
            raise MetadataError(errno.ESTALE, f"inode {inode.ino} was removed")

    def _is_temp(self, name: bytes) -> bool:
        return name.endswith(self.settings.temp_suffix)

    def _new_entry(self, parent: int, name: bytes, claim: bool = True) -> Inode:
        """The directory a new entry goes in. CLAIM False: the caller found no entry of that
        name, hidden or not (a create's own lookup), so there is none to claim."""
        check_name(name)
        directory = self.ns.directory(parent)
        if not directory.linked:
            raise MetadataError(errno.ENOENT, f"directory {parent} was removed")
        if name in (b".", b".."):
            raise MetadataError(errno.EEXIST, f"{name!r} exists in directory {parent}")
        if claim:
            self._claim(parent, name)  # only once nothing can fail: a hidden file's name is free
        if name in directory.children:  # type: ignore[operator]
            raise MetadataError(errno.EEXIST, f"{name!r} exists in directory {parent}")
        return directory

    def _link(self, directory: Inode, name: bytes, inode: Inode, now: int, counted: bool = True) -> None:
        self.ns.link(directory, name, inode, now)
        if counted:  # (False: a rename within its directory, whose totals stay as they are)
            self.dir_totals.enter(self.ns, inode)
        if not inode.is_file:
            return
        if self._is_temp(name):
            self._temp_files.add(inode.ino)
        else:
            self._temp_files.discard(inode.ino)
            self.policy.identify(inode.ino, name_identity(inode.parent, name))  # (`_identify`: just linked)

    def _identify(self, inode: Inode) -> None:
        """A file published under its name: the policy knows the block by it, across re-creations."""
        if inode.linked:
            name = inode.name  # (unpacked once: kvfs.cluster.names)
            if not self._is_temp(name):
                self.policy.identify(inode.ino, name_identity(inode.parent, name))

    def admit(self, inode: Inode, size: int, version: FileVersion | None = None) -> None:
        """A sealed, current file becomes evictable (VERSION: its current one, if at hand)."""
        self._identify(inode)
        if version is None:
            version = self.objects.versions.get(inode.version)
        group = evict_group(version) if version is not None else None
        self.policy.insert(inode.ino, size, self.clock.monotonic(), group)

    def _tier_changed(self, version: FileVersion) -> None:
        """A file's copy moved to the other tier: a reclaim of that tier finds it there."""
        inode = self.ns.inodes.get(version.ino)
        if inode is not None and inode.version == version.version:
            self.policy.regroup(inode.ino, evict_group(version))

    def remove_file(self, inode: Inode, now: int, dropped: list[int], linger: bool = False) -> None:
        """Takes a file out of the namespace; its bytes go once nobody has them open.

        With `linger` (a rename over the file; not unlink or eviction, whose space must be
        free when they return) the bytes also stay until
        the calling node's kernel forgets the inode: an open that resolved the name just
        before then reads the old file, as on a local file system, instead of failing.
        (Only that node's kernel: it saw the unlink, so it forgets the inode at once.)"""
        self._temp_files.discard(inode.ino)
        self._unpublished.pop(inode.ino, None)
        self.policy.remove(inode.ino)
        self._removed_names.append((inode.parent, inode.name, inode.ino))
        self.dir_totals.leave(self.ns, inode)
        self.ns.unlink(inode, now)
        version = self.objects.versions.get(inode.version)
        if version is None:
            return
        if linger and inode.refs & (1 << self._caller) and version.sealed:
            version.held = True
            self._lingering[inode.ino] = (version.version, self._caller)
        self.objects.retire(version, dropped)

    def unhold(self, ino: int, node: int, dropped: list[int]) -> None:
        """The node's kernel forgot an unlinked inode: the bytes that lingered for it go."""
        held = self._lingering.get(ino)
        if held is None or held[1] != node:
            return
        del self._lingering[ino]
        version = self.objects.versions.get(held[0])
        if version is not None:
            version.held = False
            self.objects.retire(version, dropped)

    # Namespace -------------------------------------------------------------------------

    def _lookup(self, req: m.Lookup) -> m.Entry:
        # (the name was checked with the request: kvfs.cluster.validate)
        named = self.ns.lookup(req.parent, req.name)
        inode, version, available = self._shown(named)
        if not self._is_temp(req.name):  # a writer's check for its temp file is no miss
            self.usage.looked_up(self.ns, req.parent, req.name, inode)
        if inode is None:  # (a hidden file is no miss to remember: it shows again when its node is back)
            return m.Entry(None, no_temps=named is None and self._no_temps(req.parent, req.temp_suffix))
        self.ns.reference(inode, self._caller)
        if not inode.is_file:
            return m.Entry(self.attr(inode))
        if version is None:
            if inode.version:  # (a current version that is gone: as `ObjectDirectory.get` says)
                self.objects.get(inode.version)
            return m.Entry(self.file_attr(inode, None))
        entry = m.Entry(self.file_attr(inode, version))
        if available and version.sealed:
            entry.node, entry.address, entry.checksums = self._remote_location(version)
        return entry

    def _no_temps(self, parent: int, suffix: bytes) -> bool:
        """True when a small directory holds no name ending in a node's temp suffix: the
        node then answers the writer's temp-name lookup that follows without asking
        (kvfs/node/misses.py). Hidden names count: they may show again."""
        if not suffix:
            return False
        children = self.ns.directory(parent).children
        if len(children) > m.TEMP_SCAN_NAMES:  # type: ignore[arg-type]
            return False
        return not any(name.endswith(suffix) for name in children)  # type: ignore[union-attr]

    def _remote_location(self, version: FileVersion) -> tuple[int, str, list[int]]:
        """Where another node's reader fetches a version: (node, peer address, checksums),
        or (0, "", []) for the calling node's own versions."""
        if version.node == self._caller:
            return 0, "", []
        return version.node, self.registry.nodes[version.node].address, version.checksums

    def _getattr(self, req: m.GetAttr) -> m.Attr:
        return self.attr(self.ns.get(req.ino))

    def _setattr(self, req: m.SetAttr) -> m.Attr:
        inode = self.ns.get(req.ino)
        if req.mode is not None:
            inode.mode = stat.S_IFMT(inode.mode) | stat.S_IMODE(req.mode)
        if req.uid is not None:
            inode.uid = req.uid
        if req.gid is not None:
            inode.gid = req.gid
        if req.atime_ns is not None:
            inode.atime_ns = req.atime_ns
        if req.mtime_ns is not None:
            inode.mtime_ns = req.mtime_ns
        inode.ctime_ns = self.clock.wall_ns()
        self.ns.dirty.add(inode.ino)
        self.changed(inode)
        return self.attr(inode)

    def _mkdir(self, req: m.MkDir) -> m.Made:
        directory = self._new_entry(req.parent, req.name)
        now = self.clock.wall_ns()
        inode = self.ns.new_inode(stat.S_IFDIR | stat.S_IMODE(req.mode), req.uid, req.gid, now, directory=True)
        self._link(directory, req.name, inode, now)
        return m.made(self._referenced(inode), self.attr(directory))

    def _symlink(self, req: m.Symlink) -> m.Attr:
        check_target(req.target)
        directory = self._new_entry(req.parent, req.name)
        now = self.clock.wall_ns()
        inode = self.ns.new_symlink(req.target, req.uid, req.gid, now)
        self._link(directory, req.name, inode, now)
        return self._referenced(inode)

    def _readlink(self, req: m.ReadLink) -> m.LinkTarget:
        inode = self.ns.get(req.ino)
        if not inode.is_symlink:
            raise MetadataError(errno.EINVAL, f"inode {req.ino} is not a symbolic link")
        return m.LinkTarget(inode.target)

    def _create(self, req: m.Create) -> m.Opened:
        self._known_node(req.node)
        named = self.ns.lookup(req.parent, req.name)  # (the name was checked with the request)
        existing = self._visible(named)
        if existing is not None:
            if req.exclusive:
                raise MetadataError(errno.EEXIST, f"{req.name!r} exists in directory {req.parent}")
            opened = self._open_write(m.OpenWrite(existing.ino, req.node, truncate=False))
            self._referenced(existing)  # only once the open succeeded: the kernel holds it now
            return opened
        directory = self._new_entry(req.parent, req.name, claim=named is not None)
        now = self.clock.wall_ns()
        inode = self.ns.new_inode(stat.S_IFREG | stat.S_IMODE(req.mode), req.uid, req.gid, now, directory=False,
                                  at_least=self.objects.next_version)  # (its first version shares the number)
        version = self.objects.create(inode.ino, req.node, writers=1)
        self._count_open(version.version, True, 1)
        inode.version = version.version
        self._link(directory, req.name, inode, now)
        self._unpublished[inode.ino] = None
        self._unpublished_peak = max(self._unpublished_peak, len(self._unpublished))
        self.ns.reference(inode, self._caller)
        return m.Opened(self.file_attr(inode, version), version.version, parent=self.attr(directory))

    def _existing(self, parent: int, name: bytes) -> Inode:
        inode = self._entry(parent, name)
        if inode is None:
            raise MetadataError(errno.ENOENT, f"no entry {name!r} in directory {parent}")
        return inode

    def _unlink(self, req: m.Unlink) -> m.Done:
        inode = self._existing(req.parent, req.name)
        if inode.is_dir:
            raise MetadataError(errno.EISDIR, f"{req.name!r} in directory {req.parent} is a directory")
        dropped: list[int] = []
        self.remove_file(inode, self.clock.wall_ns(), dropped)
        return m.Done(dropped)

    def _rmdir(self, req: m.RmDir) -> m.Done:
        if req.name == b".":
            raise MetadataError(errno.EINVAL, "cannot remove '.'")
        inode = self._existing(req.parent, req.name)
        if not inode.is_dir:
            raise MetadataError(errno.ENOTDIR, f"{req.name!r} in directory {req.parent} is not a directory")
        if inode.children:
            raise MetadataError(errno.ENOTEMPTY, f"directory {req.name!r} is not empty")
        self._removed_names.append((inode.parent, inode.name, inode.ino))
        self.dir_totals.leave(self.ns, inode)
        self.ns.unlink(inode, self.clock.wall_ns())
        self.dir_totals.removed_dir(inode.ino)
        return m.Done()

    def _rename(self, req: m.Rename) -> m.Done:
        check_name(req.name_new)
        source = self._existing(req.parent_old, req.name_old)
        new_parent = self.ns.directory(req.parent_new)
        if not new_parent.linked:
            raise MetadataError(errno.ENOENT, f"directory {req.parent_new} was removed")
        target = self._entry(req.parent_new, req.name_new)
        if target is source:
            return m.Done()
        if source.is_dir and self.ns.is_ancestor(source.ino, new_parent.ino):
            raise MetadataError(errno.EINVAL, f"cannot move directory {source.ino} into itself")
        now = self.clock.wall_ns()
        dropped: list[int] = []
        if target is not None:
            if req.noreplace:
                raise MetadataError(errno.EEXIST, f"{req.name_new!r} exists in directory {req.parent_new}")
            if source.is_dir and not target.is_dir:
                raise MetadataError(errno.ENOTDIR, f"{req.name_new!r} is not a directory")
            if target.is_dir and not source.is_dir:
                raise MetadataError(errno.EISDIR, f"{req.name_new!r} is a directory")
            if target.is_dir:
                if target.children:
                    raise MetadataError(errno.ENOTEMPTY, f"directory {req.name_new!r} is not empty")
                self._removed_names.append((target.parent, target.name, target.ino))
                self.dir_totals.leave(self.ns, target)
                self.ns.unlink(target, now)
                self.dir_totals.removed_dir(target.ino)
            else:
                self.remove_file(target, now, dropped, linger=True)
        self._claim(req.parent_new, req.name_new)  # a hidden file's name, once nothing can fail
        self._removed_names.append((source.parent, source.name, source.ino))
        self._unpublished.pop(source.ino, None)  # renamed: published
        moved = source.parent != new_parent.ino
        if moved:  # (entered again where it is linked)
            self.dir_totals.leave(self.ns, source)
        self.ns.detach(source, now)
        self._link(new_parent, req.name_new, source, now, counted=moved)
        directories = [self.attr(self.ns.inodes[ino]) for ino in dict.fromkeys((req.parent_old, req.parent_new))]
        return m.Done(dropped, self._relocate(source), directories)

    # Node-private temp files (kvfs.node.private) ------------------------------------

    def _grant_numbers(self, req: m.GrantNumbers) -> m.Numbers:
        """A block of inode and version numbers, taken from the counters: saved before the
        answer like any change (the root's record is marked to carry them), so no number
        of it is handed out again after a restart or a failover. The block is the caller's
        alone: recorded with its node (and saved with it), a Publish by another node of
        one of its numbers is refused."""
        self._known_node(self._caller)
        # One first number for both (past the entry ids too): a published file's inode, version
        # and entry then share one int object, as a created one's do (`Namespace.new_inode`).
        first_ino = first_version = max(self.ns.next_ino, self.objects.next_version, self.ns.next_entry_id)
        self.ns.next_ino = self.objects.next_version = first_ino + req.count
        self.ns.dirty.add(ROOT_INO)  # (the counters are saved with any change)
        self.registry.nodes[self._caller].grant(first_ino, first_version, req.count)
        self.registry.dirty = True  # (one node record rewritten per block, not per publish)
        return m.Numbers(first_ino, first_version, req.count)

    def _publish(self, req: m.Publish) -> m.Published:
        """Create, seal and rename in one: the file enters under its final name, with
        rename's rules for a name that exists. Refusals change nothing."""
        new_name(req.name)
        file_size(req.size, "published size")
        time_ns(req.mtime_ns, "mtime")
        time_ns(req.ctime_ns, "ctime")
        self._known_node(req.node)
        # Only a pair of numbers granted to the caller, for a file stored on it: another node's
        # would make that node's own publish of them fail. Unused: no inode or version has them
        # (numbers whose file has since gone are unused again to their owner alone: a node
        # never takes a number twice, and what a faulty one would break is its own).
        if req.node != self._caller or not self.registry.nodes[req.node].granted(req.ino, req.version) \
                or req.ino in self.ns.inodes or req.version in self.objects.versions:
            raise MetadataError(errno.EINVAL, f"publish of {req.name!r}: inode {req.ino} and version {req.version} "
                                              f"are not a pair of numbers granted to node {self._caller}, unused")
        directory = self.ns.directory(req.parent)
        if not directory.linked:
            raise MetadataError(errno.ENOENT, f"directory {req.parent} was removed")
        target = self._entry(req.parent, req.name)
        now = self.clock.wall_ns()
        dropped: list[int] = []
        if target is not None:
            if req.noreplace:
                raise MetadataError(errno.EEXIST, f"{req.name!r} exists in directory {req.parent}")
            if target.is_dir:
                raise MetadataError(errno.EISDIR, f"{req.name!r} in directory {req.parent} is a directory")
            self.remove_file(target, now, dropped, linger=True)
        self._claim(req.parent, req.name)  # a hidden file's name, once nothing can fail
        inode = Inode(req.ino, stat.S_IFREG | stat.S_IMODE(req.mode), req.uid, req.gid, now, req.mtime_ns,
                      max(req.ctime_ns, req.mtime_ns))
        self.ns.inodes[inode.ino] = inode
        self.ns.files += 1
        self.ns.dirty.add(inode.ino)
        version = FileVersion(inode.ino if req.version == req.ino else req.version, inode.ino, req.node,
                              writers=0 if req.sealed else req.writers)  # (one int for both numbers)
        self.objects._add(version)  # (its number was granted: next_version is past it)
        self.objects.dirty.add(version.version)
        if req.sealed:
            self.objects.seal(version, req.size, req.checksums)
        elif req.writers:
            self._count_open(version.version, True, req.writers)
        inode.version = version.version
        self._link(directory, req.name, inode, now)  # (the inode's times stay as made above)
        self.ns.reference(inode, self._caller)  # the caller's kernel holds it (it created it)
        if req.sealed:
            self.admit(inode, req.size, version)
        else:  # being written: published by the rename that follows, or evicted last meanwhile
            self._unpublished[inode.ino] = None
            self._unpublished_peak = max(self._unpublished_peak, len(self._unpublished))
        return m.Published(self.file_attr(inode, version), dropped, directories=[self.attr(directory)])

    def _relocate(self, inode: Inode) -> list[int]:
        """A renamed inode's files on SSD, whose recorded paths change with it: the caller's
        own file is rewritten before the reply (the answer lists it); a directory's files,
        and another node's file, by their nodes in the background (kvfs.cluster.relocations).
        The embedded node (no heartbeats, no frames) still gets the whole list."""
        if not self.settings.cluster:
            return self._files_on_disk(inode)
        if inode.children is None:
            version = self.objects.versions.get(inode.version)
            if version is None or not version.on_disk:
                return []
            if version.node == self._caller:
                return [version.version]
        self.relocations.start(inode.ino)
        return []

    def _register(self, req: m.Register) -> m.Registered:
        registered = self.members.register(req)
        self.relocations.registered(registered.node)  # (its report tells again what is stale)
        return registered

    def _report(self, req: m.Report) -> m.Reported:
        reported = self.members.report(req, self._caller)
        self.relocations.check(self._caller, req.held)
        return reported

    def _heartbeat(self, req: m.Heartbeat) -> m.Beat:
        beat = self.members.heartbeat(req, self._caller)
        beat.relocated = self.relocations.beat(self._caller)
        return beat

    def _files_on_disk(self, inode: Inode) -> list[int]:
        """Current versions on SSD at or below an inode (their recorded paths change with it)."""
        found: list[int] = []
        stack = [inode]
        while stack:
            node = stack.pop()
            if node.children is not None:
                stack.extend(self.ns.inodes[ino] for ino in node.children.inos())
                continue
            version = self.objects.versions.get(node.version)
            if version is not None and version.on_disk:
                found.append(version.version)
        return found

    def _readdir(self, req: m.ReadDir) -> m.Listing:
        directory = self.ns.directory(req.ino)
        entries = [m.DirEntry(name, self.attr(inode), entry_id)
                   for name, inode, entry_id in self.ns.listing(directory, req.start_id,
                                                                 min(req.limit, m.READDIR_MAX))
                   if self._visible(inode) is not None]
        return m.Listing(entries)

    def _forget(self, req: m.Forget) -> m.Done:
        dropped: list[int] = []
        for ino in req.inos:
            inode = self.ns.inodes.get(ino)
            if inode is not None and ino != ROOT_INO:
                self.ns.unreference(inode, self._caller)
                self.unhold(ino, self._caller, dropped)
                self.ns.collect(inode)
        return m.Done(dropped)

    # Files and versions ----------------------------------------------------------------

    def _open_read(self, req: m.OpenRead) -> m.Opened:
        dropped: list[int] = []
        for version in req.released:  # reader handles closed earlier: released first, whatever the open does
            dropped.extend(self._release(m.Release(version, writer=False)).dropped)
        try:
            opened = self._open_version_read(req)
        except MetadataError:  # (what the releases dropped goes with a heartbeat then)
            node = self.registry.nodes.get(self._caller)
            if node is not None:
                node.outbox_dropped.extend(dropped)
            raise
        opened.dropped = dropped
        return opened

    def _open_version_read(self, req: m.OpenRead) -> m.Opened:
        inode = self._file(req.ino)
        if inode.ino not in self._lingering:
            self._check_linked(inode)
        version = self.objects.get(inode.version)
        if not self.available(version):
            raise MetadataError(errno.ENOENT, f"inode {inode.ino}: its only copy is on node {version.node}, "
                                              "which is down")
        version.readers += 1
        self._count_open(version.version, False, 1)
        version.hits += 1
        self.dir_totals.hit(self.ns, inode)
        self._unpublished.pop(inode.ino, None)  # read: published
        self.usage.opened(self.ns, inode.parent, inode.name, version.size)
        now = self.clock.wall_ns()
        version.last_access = inode.access(now)  # (the inode's times object, shared)
        self.policy.touch(inode.ino, self.clock.monotonic())
        opened = m.Opened(self.attr(inode), version.version)
        opened.node, opened.address, opened.checksums = self._remote_location(version)
        return opened

    def _open_write(self, req: m.OpenWrite) -> m.Opened:
        self._known_node(req.node)
        inode = self._file(req.ino)
        self._check_linked(inode)
        current = self.objects.get(inode.version)
        if not self.available(current):
            raise MetadataError(errno.ENOENT, f"inode {inode.ino}: its only copy is on node {current.node}, "
                                              "which is down")
        if not current.sealed:  # another writer is still at it: share its version
            if current.node != req.node:
                raise MetadataError(errno.EBUSY, f"inode {inode.ino} is being written on node {current.node}")
            current.writers += 1
            self._count_open(current.version, True, 1)
            return m.Opened(self.attr(inode), current.version)
        version = self.objects.create(inode.ino, req.node, writers=1)
        self._count_open(version.version, True, 1)
        self.dir_totals.leave(self.ns, inode)
        inode.version = version.version
        self.dir_totals.enter(self.ns, inode)
        self.ns.dirty.add(inode.ino)
        self.changed(inode)  # being written: watchers ask the master until it is sealed
        self.policy.remove(inode.ino)
        copy_from, copy_size = (0, 0) if req.truncate or current.size == 0 else (current.version, current.size)
        if copy_from:  # the node reads the old bytes, then releases them like a reader
            current.readers += 1
            self._count_open(current.version, False, 1)
            self.objects.set_size(version, copy_size)
        dropped: list[int] = []
        self.objects.retire(current, dropped)
        opened = m.Opened(self.attr(inode), version.version, copy_from, copy_size, dropped)
        if copy_from and current.node != self._caller:
            opened.node, opened.address = current.node, self.registry.nodes[current.node].address
            opened.checksums = current.checksums
        return opened

    def _release(self, req: m.Release) -> m.Done:
        version = self.objects.versions.get(req.version)
        dropped: list[int] = []
        if version is not None and self.opens.holds(self._caller, req.version, req.writer):
            self._count_open(req.version, req.writer, -1)
            self.objects.release(version, req.writer, dropped)
        return m.Done(dropped)

    def _seal(self, req: m.Seal) -> m.Attr:
        if not req.release:
            return self._seal_version(req)
        release = m.Release(req.version, writer=True)  # the last writer's: one request per close, not two
        try:
            attr = self._seal_version(req)
        except MetadataError:  # refused: released all the same, what it drops goes with a heartbeat
            node = self.registry.nodes.get(self._caller)
            dropped = self._release(release).dropped
            if node is not None:
                node.outbox_dropped.extend(dropped)
            raise
        return m.sealed(attr, self._release(release).dropped)

    def _seal_version(self, req: m.Seal) -> m.Attr:
        version = self.objects.get(req.version)
        _, size, sealed, current, _ = version.fields()  # (one read; only the seal below changes them)
        newly = not sealed
        inode = self.ns.inodes.get(version.ino)
        if newly:
            self.objects.seal(version, req.size, req.checksums)
            self.dir_totals.sealed(self.ns, inode, version)
        elif (size, version.checksums) != (req.size, req.checksums):
            raise MetadataError(errno.EINVAL, f"version {req.version} is already sealed")
        # (else: the same seal again, a node's retry after its re-registration reported it)
        if inode is None:
            return m.Attr(version.ino, stat.S_IFREG, 0, 0, 0, req.size, 0, 0, 0, version.version, True)
        # ctime never goes back: a chmod or utimensat while the file was written already moved
        # it (`Inode.modified`). A node sends ctime 0 or equal to mtime unless a utimensat came
        # between.
        inode.modified(req.mtime_ns, req.ctime_ns or req.mtime_ns)
        self.ns.dirty.add(inode.ino)
        if newly and current:
            self.changed(inode)
        if newly and current and inode.linked:
            self.admit(inode, req.size, version)
            if inode.ino in self._unpublished:
                closed = self._unpublished[inode.ino] = self.clock.monotonic()  # the grace runs from close
                self._closed_at.append(closed)
                self._closed_inos.append(inode.ino)
                self._forget_published(closed)
        return self.file_attr(inode, version) if inode.version == version.version else self.attr(inode)

    def _get_version(self, req: m.GetVersion) -> m.VersionInfo:
        v = self.objects.get(req.version)
        node = self.registry.nodes.get(v.node)
        return m.VersionInfo(v.version, v.ino, v.size, v.sealed, v.node, v.checksums, v.hits, v.last_access_ns,
                             v.readers, v.writers, v.on_disk, node.name if node else "", node.address if node else "",
                             node is not None and node.live)

    # Extended attributes ---------------------------------------------------------------

    def _getxattr(self, req: m.GetXattr) -> m.XattrValue:
        value = self.ns.get(req.ino).xattrs.get(req.name)
        if value is None:
            raise MetadataError(errno.ENODATA, f"no xattr {req.name!r} on inode {req.ino}")
        return m.XattrValue(value)

    def _setxattr(self, req: m.SetXattr) -> m.Done:
        inode = self.ns.get(req.ino)  # (the name and value were checked with the request)
        old = inode.xattrs.get(req.name)
        total = sum(len(name) + len(value) for name, value in inode.xattrs.items())
        total += len(req.value) - (len(old) if old is not None else -len(req.name))
        if total > XATTRS_MAX_BYTES:
            raise MetadataError(errno.ENOSPC, f"inode {req.ino}: its attributes would take {total} bytes "
                                              f"(limit {XATTRS_MAX_BYTES})")
        inode.set_xattr(req.name, req.value)
        inode.ctime_ns = self.clock.wall_ns()
        self.ns.dirty.add(inode.ino)
        return m.Done()

    def _listxattr(self, req: m.ListXattr) -> m.XattrNames:
        return m.XattrNames(list(self.ns.get(req.ino).xattrs))

    def _removexattr(self, req: m.RemoveXattr) -> m.Done:
        inode = self.ns.get(req.ino)
        if inode.remove_xattr(req.name) is None:
            raise MetadataError(errno.ENODATA, f"no xattr {req.name!r} on inode {req.ino}")
        inode.ctime_ns = self.clock.wall_ns()
        self.ns.dirty.add(inode.ino)
        return m.Done()

    # Capacity --------------------------------------------------------------------------

    def _evictable(self, inode: Inode | None, node: int, tier: str) -> FileVersion | None:
        if inode is None or not inode.linked:
            return None
        version = self.objects.versions.get(inode.version)
        if version is None or not version.sealed or version.in_use or version.node != node:
            return None
        if version.on_disk != (tier == "disk"):
            return None
        return version

    def _publishing(self, ino: int, now: float) -> bool:
        """Whether a file is still within its publish grace: closed at most `publish_grace_s`
        ago and neither renamed nor read since it was created. Writers publish by rename
        (vLLM, llm-d and LMCache write every temp file of a batch before renaming them), so
        such a file is about to become a name someone asked for."""
        if ino not in self._unpublished:
            return False
        closed = self._unpublished[ino]
        if closed is not None and now - closed >= self.settings.publish_grace_s:
            del self._unpublished[ino]  # ranked by the policy from now on
            return False
        return True

    def _forget_published(self, now: float) -> None:
        """Files closed longer than the grace ago are published anyway (as `_publishing` says):
        they are forgotten here, oldest first, so that the set holds only recent files."""
        grace = self.settings.publish_grace_s
        closed_at, inos = self._closed_at, self._closed_inos
        while closed_at and now - closed_at[0] >= grace:
            closed, ino = closed_at.popleft(), inos.popleft()
            if self._unpublished.get(ino, -1.0) == closed:
                del self._unpublished[ino]
        if len(self._unpublished) * 4 < self._unpublished_peak:  # a dict keeps its size: rebuilt smaller
            self._unpublished = dict(self._unpublished)
            self._unpublished_peak = len(self._unpublished)

    def _reclaim(self, req: m.Reclaim) -> m.Removed:
        victims: list[Inode] = []
        freed = 0
        now = self.clock.monotonic()
        publishing: list[tuple[Inode, FileVersion]] = []  # ranked after every published file
        # The policy's order of this node's files on this tier only (never walking past
        # other nodes' files, or, for DRAM, files already on SSD): O(what it skips here).
        for walked, ino in enumerate(self.policy.candidates((req.node, req.tier == "disk"))):
            # Bytes of small files free less than their sum (blocks are powers of two, and
            # a writer needs a whole chunk): a few at a time; the node asks again if needed.
            if freed >= req.nbytes or len(victims) >= RECLAIM_MAX_FILES or walked >= RECLAIM_WALK_MAX:
                break
            inode = self.ns.inodes.get(ino)
            version = self._evictable(inode, req.node, req.tier)
            if version is None:
                continue
            if self._publishing(ino, now):
                publishing.append((inode, version))  # type: ignore[arg-type]
                if len(publishing) >= PUBLISHING_SKIP_MAX:
                    break
                continue
            victims.append(inode)  # type: ignore[arg-type]
            freed += max(version.size, 1)
        for inode, version in publishing:
            if freed >= req.nbytes or len(victims) >= RECLAIM_MAX_FILES:
                break
            victims.append(inode)
            freed += max(version.size, 1)
        self.evicted_files += len(victims)
        self.evicted_bytes += freed
        removed = self._remove_files(victims, freed)
        node = self.registry.nodes.get(req.node)
        if node is not None and node.outbox_dropped:  # garbage it holds: no need to evict for that room
            removed.released = take_ids(node.outbox_dropped)  # (as much as a heartbeat's answer holds)
        return removed

    def _collect_orphans(self, req: m.CollectOrphans) -> m.Removed:
        deadline = self.clock.wall_ns() - int(self.settings.temp_grace_s * 1e9)
        orphans = []
        for ino in self._temp_files.take_round(ORPHAN_WALK_MAX):
            inode = self.ns.inodes[ino]
            version = self.objects.versions.get(inode.version)
            if version is not None and version.sealed and not version.in_use and inode.mtime_ns < deadline:
                orphans.append(inode)
        return self._remove_files(orphans, sum(self.objects.versions[i.version].size for i in orphans))

    def _remove_files(self, inodes: list[Inode], freed: int) -> m.Removed:
        now = self.clock.wall_ns()
        dropped: list[int] = []
        entries = []
        for inode in inodes:
            entries.append((inode.parent, inode.name, inode.ino))
            self.remove_file(inode, now, dropped)
        return m.Removed(dropped, entries, freed)

    def _offloaded(self, req: m.Offloaded) -> m.Done:
        for version_id in req.versions:
            version = self.objects.versions.get(version_id)
            if version is not None and version.node == self._caller:
                inode = self.ns.inodes.get(version.ino)
                self.dir_totals.leave(self.ns, inode)
                self.objects.set_on_disk(version, True)
                self.dir_totals.enter(self.ns, inode)
                self.objects.dirty.add(version_id)
        return m.Done()

    def _get_record(self, req: m.GetRecord) -> m.FileRecord:
        version = self.objects.get(req.version)
        inode = self.ns.inodes.get(version.ino)
        if inode is None or not inode.linked or not version.current:
            raise MetadataError(errno.ENOENT, f"version {req.version} is no longer a file's content")
        path: list[bytes] = []
        node = inode
        while node.ino != ROOT_INO:
            path.append(node.name)
            node = self.ns.inodes[node.parent]
        path.reverse()
        return m.FileRecord(path, version.size, inode.mode, inode.uid, inode.gid, inode.mtime_ns, dict(inode.xattrs))

    def _lost(self, req: m.Lost) -> m.Removed:
        version = self.objects.versions.get(req.version)
        inode = self.ns.inodes.get(version.ino) if version is not None else None
        if version is None or inode is None or not inode.linked or inode.version != version.version:
            dropped: list[int] = []
            if version is not None:
                self.objects.retire(version, dropped)
            return m.Removed(dropped, [], 0)
        return self._remove_files([inode], version.size)

    def restore(self, req: m.Restore) -> m.Restored:
        record = req.record
        self._known_node(req.node)
        if req.version in self.objects.versions:  # known already: the master's entry stands
            return m.Restored(False, [])
        now = self.clock.wall_ns()
        directory = self.ns.inodes[ROOT_INO]
        walked: Inode | None = directory
        for name in record.path[:-1]:  # nothing is created for a path that cannot be restored
            walked = self.ns.lookup(walked.ino, name) if walked is not None else None
            if walked is not None and not walked.is_dir:
                return m.Restored(False, [req.version])
        for name in record.path[:-1]:
            child = self._restored_directory(directory, name, now)
            if child is None:
                return m.Restored(False, [req.version])
            directory = child
        name = record.path[-1]
        dropped: list[int] = []
        existing = self.ns.lookup(directory.ino, name)
        if existing is not None:
            if not existing.is_file or existing.version > req.version:
                return m.Restored(False, [req.version])
            self.remove_file(existing, now, dropped)  # an older version of the same name
        inode = self.ns.new_inode(record.mode, record.uid, record.gid, record.mtime_ns, directory=False)
        inode.xattrs = dict(record.xattrs)
        version = self.objects.restore(req.version, inode.ino, req.node, record.size, req.checksums)
        self.registry.adopt(req.node, version.version)  # (kept while its node's other files are reconciled)
        inode.version = version.version
        self._link(directory, name, inode, now)
        inode.mtime_ns = inode.ctime_ns = record.mtime_ns
        self.ns.dirty.add(inode.ino)
        self.admit(inode, record.size)
        return m.Restored(True, dropped)

    def _restored_directory(self, parent: Inode, name: bytes, now: int) -> Inode | None:
        """Recovery: the directory `name` under `parent`, made (root's, 0755) if absent; None
        where a file or link holds the name."""
        child = self.ns.lookup(parent.ino, name)
        if child is None:
            child = self.ns.new_inode(stat.S_IFDIR | 0o755, self.settings.root_uid, self.settings.root_gid, now,
                                      directory=True)
            self._link(parent, name, child, now)
        elif not child.is_dir:
            return None
        return child

    def restore_directory(self, parent: Inode, name: bytes, mode: int, uid: int, gid: int,
                          mtime_ns: int) -> Inode | None:
        """Recovery: a saved directory under `parent`, made if absent, given its saved
        attributes; None where a file or link holds the name."""
        inode = self._restored_directory(parent, name, self.clock.wall_ns())
        if inode is not None:
            self.set_directory(inode, mode, uid, gid, mtime_ns)
        return inode

    def set_directory(self, inode: Inode, mode: int, uid: int, gid: int, mtime_ns: int) -> None:
        inode.mode = stat.S_IFDIR | stat.S_IMODE(mode)
        inode.uid, inode.gid = uid, gid
        inode.mtime_ns = mtime_ns
        self.ns.dirty.add(inode.ino)

    def _dir_usage(self, req: m.DirUsage) -> m.DirUsageInfo:
        return m.DirUsageInfo(self.usage.rows(self.ns, self.dir_totals if req.files else None))

    def _stats(self, req: m.Stats) -> m.MasterStats:
        stats = m.MasterStats(len(self.ns.inodes), self.ns.files, self.objects.sealed_bytes)
        if self.settings.cluster:  # statfs on any node shows the whole cluster's SSD (or DRAM) tier
            for node in self.registry.live_nodes():
                usage = node.usage
                stats.capacity += usage.ssd_capacity or usage.dram_capacity
                stats.used += usage.ssd_used if usage.ssd_capacity else usage.dram_used
        return stats
