"""Cluster membership in the metadata service (pure): registration, heartbeats, node death,
watched directories, the cluster's status.

An object the service (`kvfs.cluster.master.MetadataService`) owns, kept apart because it
is one concern: how nodes come, report what they hold, stay alive, and go. Its
dependencies are explicit: the namespace, the object directory, the registry, the open
handles, the clock, and the few file operations of the service it needs (`FileService`).
The caller of each request is a parameter, never state.

A node that goes down (declared dead, or registering again) loses its open handles
and kernel references; its files stay in the namespace, hidden, until it registers
again. Then it keeps every file of its own that nobody superseded meanwhile: only
names a newer file took are dropped. (A node that really restarted without its
memory reports less, and the rest goes when its registration finishes.)
"""

from __future__ import annotations

import errno
from array import array
from typing import Iterator, Protocol

from kvfs.clock import Clock
from kvfs.wire import messages as m
from kvfs.cluster.backlog import STEP_ITEMS, Backlog
from kvfs.cluster.liveness import Liveness
from kvfs.cluster.namespace import ROOT_INO, Inode, Namespace
from kvfs.cluster.objects import FileVersion
from kvfs.cluster.opens import OpenHandles
from kvfs.cluster.registry import NodeRecord, Registry
from kvfs.cluster.totals import CountedObjects
from kvfs.cluster.usage import DirTotals
from kvfs.errors import MetadataError

PAGE_BYTES = 640 << 10  # names and entries per WatchNames answer (a frame header holds 1 MiB)
# What one heartbeat answer carries of a node's outboxes (together under a frame header's 1 MiB):
# after a node holding 100K files is forgotten, every other node has 100K names to forget,
# given over a few heartbeats instead of one answer too large to send.
BEAT_IDS_BYTES = 256 << 10
BEAT_NAMES_BYTES = 512 << 10
ID_BYTES = 9  # a version id in msgpack, at most
NAME_OVERHEAD = 24  # a forget's two ints and the tuple around its name, at most


def take_ids(outbox: list[int], budget: int = BEAT_IDS_BYTES) -> list[int]:
    """The first ids of an outbox that fit in `budget` bytes, taken out of it."""
    count = budget // ID_BYTES
    taken = outbox[:count]
    del outbox[:count]
    return taken


def take_names(outbox: list[tuple[int, bytes, int]], budget: int = BEAT_NAMES_BYTES) -> list[tuple[int, bytes, int]]:
    """The first names of an outbox that fit in `budget` bytes (at least one), taken out of it."""
    count = 0
    for _, name, _ in outbox:
        budget -= len(name) + NAME_OVERHEAD
        if budget < 0 and count:
            break
        count += 1
    taken = outbox[:count]
    del outbox[:count]
    return taken


class FileService(Protocol):
    """The file operations of the metadata service that membership uses."""

    def restore(self, req: m.Restore) -> m.Restored:
        """Puts a version the master lost back in the namespace from its SSD record."""

    def admit(self, inode: Inode, size: int) -> None:
        """A sealed, current file becomes evictable."""

    def remove_file(self, inode: Inode, now: int, dropped: list[int]) -> None:
        """Takes a file out of the namespace."""

    def changed(self, inode: Inode) -> None:
        """A file's entry changed: watchers of its directory are told."""

    def unhold(self, ino: int, node: int, dropped: list[int]) -> None:
        """The node's kernel forgot an unlinked inode."""

    def copy_entry(self, parent: int, name: bytes, node: int) -> m.Entry | None:
        """The entry a node's copy of a directory may answer a lookup of `name` with."""

    def route_outcomes(self, caller: int) -> None:
        """Queues drops and name changes for the nodes they concern."""


class Membership:
    def __init__(self, clock: Clock, ns: Namespace, objects: CountedObjects, registry: Registry,
                 opens: OpenHandles, liveness: Liveness, files: FileService, backlog: Backlog,
                 dir_totals: DirTotals, forget_dead_after_s: float = 0.0) -> None:
        self.clock = clock
        self.backlog = backlog  # work in proportion to a node's files, done in slices
        self.forget_dead_after_s = forget_dead_after_s  # 0: dead nodes are kept until removed
        self.forgotten = 0  # dead nodes forgotten since start
        self.forgetting: set[int] = set()  # nodes no longer registered whose versions are being forgotten
        self.liveness = liveness
        self.ns = ns
        self.objects = objects
        self.registry = registry
        self.opens = opens
        self.files = files
        self.dir_totals = dir_totals  # kept up to date as reports seal and offload files

    def register(self, req: m.Register) -> m.Registered:
        """A node joins or rejoins. Whatever a previous incarnation held open or cached is
        released now; its files stay hidden until it has reported what it still holds."""
        node = self.registry.nodes.get(self.registry.by_name.get(req.name, 0))
        if node is not None and (node.live or node.registering):
            self._node_down(node)
        node = self.registry.register(req.name, req.address, self.clock.monotonic())
        node.forgotten_at = self.objects.forgotten.get(node.node_id, 0)
        return m.Registered(node.node_id)

    def _registering(self, caller: int) -> NodeRecord:
        node = self.registry.nodes.get(caller)
        if node is None or not node.registering:
            raise MetadataError(errno.EPROTO, f"node {caller} is not registering")
        return node

    def report(self, req: m.Report, caller: int) -> m.Reported:
        """Reconciles the versions a registering node holds with the directory."""
        node = self._registering(caller)
        node.last_seen = self.clock.monotonic()
        dropped: list[int] = []
        for held in req.held:
            version = self.objects.versions.get(held.version)
            if version is None:
                if held.record is not None and held.sealed and held.on_disk:  # a file the master lost
                    restored = self.files.restore(m.Restore(held.version, node.node_id, held.record, held.checksums))
                    dropped.extend(restored.dropped)
                    if restored.kept:
                        node.reported.add(held.version)
                        continue
                dropped.append(held.version)
                continue
            if version.node != node.node_id:
                dropped.append(held.version)
                continue
            node.reported.add(held.version)
            self.objects.gone.discard(version.version)
            inode = self.ns.inodes.get(version.ino)
            if held.sealed and not version.sealed:  # sealed on the node while the master was away
                self.objects.seal(version, held.size, held.checksums)
                self.dir_totals.sealed(self.ns, inode, version)
                if inode is not None:
                    inode.mtime_ns = inode.ctime_ns = held.mtime_ns
                    self.ns.dirty.add(inode.ino)
                    if version.current and inode.linked:
                        self.files.admit(inode, held.size)
            if held.on_disk != version.on_disk:
                self.dir_totals.leave(self.ns, inode)
                self.objects.set_on_disk(version, held.on_disk)
                self.dir_totals.enter(self.ns, inode)
                self.objects.dirty.add(version.version)
        for version_id, writer, count in req.opens:
            version = self.objects.versions.get(version_id)
            if version is None or count <= 0:
                continue
            self.opens.count(node.node_id, version_id, writer, count)
            if writer:
                version.writers += count
            else:
                version.readers += count
        return m.Reported(sorted(set(dropped)))

    def finish_registration(self, req: m.FinishRegistration, caller: int) -> m.Done:
        """Versions of this node it did not report are gone: their files leave the namespace.

        O(reported), never O(the node's versions): those it lacks are hidden at once by a mark
        (`NodeRecord.kept`: only what it reported, or what is newer, is available) and found
        and removed in slices (`_reconcile_job`)."""
        node = self._registering(caller)
        reported = node.reported
        # Reported versions are the node's: if as many of them are still known as it stores, none
        # is gone (the usual case). Each was known when reported: unless one of the node's
        # versions was forgotten since it registered, all still are (else they are counted).
        if self.objects.forgotten.get(node.node_id, 0) == node.forgotten_at:
            still = len(reported)
        else:
            still = sum(map(self.objects.versions.__contains__, reported))
        if still != self.objects.count(node.node_id):
            node.kept, node.kept_below = reported, self.objects.next_version
        # Retired versions that were open before a restart and are open no more.
        unused = [version for version in (self.objects.versions[v] for v in list(self.objects.retired))
                  if version.node == node.node_id and version.version in reported and not version.in_use]
        for version in unused:
            self.objects.forget(version)
        node.registering, node.live, node.reported = False, True, set()
        node.last_seen = self.clock.monotonic()
        if node.kept is not None:
            self.backlog.add(self._reconcile_job(node, node.kept))
        return m.Done([version.version for version in unused])

    def _reconcile_job(self, node: NodeRecord, kept: set[int]) -> Iterator[None]:
        """The node's versions it did not report leave the namespace, a slice at a time. A
        new registration meanwhile (a new `kept`) or the node's end stops the job: the next
        registration's finish starts another over what is left."""
        node_id, below = node.node_id, node.kept_below
        ids = self.objects.by_node.get(node_id, array("Q"))[:]  # (a copy in C: versions come and go)
        versions = self.objects.versions
        for start in range(0, len(ids), STEP_ITEMS):
            if node.kept is not kept or self.registry.nodes.get(node_id) is not node:
                return
            lacking = {}
            for version_id in ids[start:start + STEP_ITEMS]:
                if version_id < below and version_id not in kept:
                    version = versions.get(version_id)
                    if version is not None and version.node == node_id:
                        lacking[version_id] = version  # (an id restored after it was forgotten is there twice)
            self._forget_versions(list(lacking.values()))
            self.files.route_outcomes(node_id)  # (their node does not hold them: nothing to free)
            yield
        if node.kept is kept:
            node.kept = None

    def _forget_versions(self, versions: list[FileVersion]) -> None:
        now = self.clock.wall_ns()
        dropped: list[int] = []
        for version in versions:
            inode = self.ns.inodes.get(version.ino)
            if version.current and inode is not None and inode.linked and inode.version == version.version:
                self.files.remove_file(inode, now, dropped)
            if version.version in self.objects.versions:  # retired but held open before
                self.objects.uncurrent(version)
                version.readers = version.writers = 0
                self.objects.forget(version)

    def heartbeat(self, req: m.Heartbeat, caller: int) -> m.Beat:
        node = self.registry.nodes.get(caller)
        if node is None or not node.live:
            raise MetadataError(errno.ESTALE, f"node {caller} is not registered (declared dead?)")
        node.last_seen = self.clock.monotonic()
        node.usage.dram_capacity, node.usage.dram_used = req.dram_capacity, req.dram_used
        node.usage.ssd_capacity, node.usage.ssd_used = req.ssd_capacity, req.ssd_used
        if req.activity is not None:
            node.activity = req.activity
        return m.Beat(take_ids(node.outbox_dropped), take_names(node.outbox_forget))  # (the rest: next beats)

    def expire_nodes(self) -> list[int]:
        """Declares nodes that stopped heartbeating dead; returns their ids (called periodically)."""
        now = self.clock.monotonic()
        dead = self.liveness.expired(now)
        for node in dead:
            self._node_down(node)
            self.files.route_outcomes(0)
        if self.forget_dead_after_s:
            for node in [n for n in self.registry.nodes.values() if not (n.live or n.registering)
                         and n.address and now - n.last_seen > self.forget_dead_after_s]:
                self._unregister(node)  # its name is free now: its files are hidden, and go in slices
                self._forget(node.node_id)
                self.forgotten += 1
        # Versions of a node no longer registered with no job forgetting them: a removal that a
        # restart or failover cut short (the job lived in the old process). O(nodes) a pass, and
        # one such node a pass, as a job's first slice runs at once (the loop stays responsive).
        orphaned = self.objects.by_node.keys() - self.registry.nodes.keys() - self.forgetting
        if orphaned:
            self._forget(min(orphaned))
        return [node.node_id for node in dead]

    def _forget(self, node_id: int, entries: list[tuple[int, bytes, int]] | None = None) -> None:
        self.forgetting.add(node_id)
        self.backlog.add(self._forget_job(node_id, entries))

    def _forget_job(self, node_id: int, entries: list[tuple[int, bytes, int]] | None = None) -> Iterator[None]:
        """The versions of a forgotten node (no longer registered: hidden, as no live node holds
        them, and its id is never reused) leave the namespace a slice at a time; the files
        of the first slice are listed in `entries`."""
        ids = self.objects.by_node.get(node_id, array("Q"))[:]  # (a copy in C)
        versions = self.objects.versions
        for start in range(0, len(ids), STEP_ITEMS):
            found = [version for version in map(versions.get, dict.fromkeys(ids[start:start + STEP_ITEMS]))
                     if version is not None and version.node == node_id]
            if entries is not None:
                inodes = (self.ns.inodes.get(version.ino) for version in found if version.current)
                entries += [(inode.parent, inode.name, inode.ino) for inode in inodes if inode is not None]
                entries = None
            self._forget_versions(found)
            self.files.route_outcomes(node_id)  # (their node does not hold them: nothing to free)
            yield
        self.forgetting.discard(node_id)

    def _unregister(self, node: NodeRecord) -> None:
        del self.registry.nodes[node.node_id]
        del self.registry.by_name[node.name]
        self.registry.dirty = True

    def _node_down(self, node: NodeRecord) -> None:
        """The node is gone (dead, or restarting): its open handles and kernel references
        go. Its files stay, hidden, until it registers again, those only in its memory
        too: a node declared dead may well be alive (partitioned, or the master was the
        one that stalled), and what it still holds it reports, and keeps."""
        node.live = node.registering = False
        node.outbox_dropped, node.outbox_forget = [], []
        dropped: list[int] = []
        for (version_id, writer), count in self.opens.take(node.node_id).items():
            version = self.objects.versions.get(version_id)
            if version is not None:
                for _ in range(count):
                    self.objects.release(version, writer, dropped)
        bit = 1 << node.node_id
        node.outbox_names = []
        for ino in self.ns.watched_by.pop(node.node_id, ()):
            directory = self.ns.inodes.get(ino)
            if directory is not None:
                directory.watchers &= ~bit
        # The rest is in proportion to the node's files: in slices (kvfs.cluster.backlog).
        if self.ns.held.get(node.node_id):  # (a walk of every inode: see `_unreference_job`)
            again = self.ns.walking[node.node_id] = set()  # (a walk still running stops: this one covers it)
            self.backlog.add(self._unreference_job(node.node_id, again, self.ns.next_ino))
        if any(self.ns.watched_by.values()):
            self.backlog.add(self._hide_job(node.node_id, self.objects.by_node.get(node.node_id, array("Q"))[:]))

    def _unreference_job(self, node_id: int, again: set[int], end: int) -> Iterator[None]:
        """The kernel references of a node that went down go (those its next incarnation
        took meanwhile, listed in `again`, stay). They are known only by the inodes' bits,
        not in a set per node (42-84 B per referenced inode, docs/cluster.md): the inode table is walked, STEP_ITEMS numbers per step, up to
        the first number not handed out at the death (later inodes' bits are the next
        incarnation's), or until no bit of the dead incarnation is left: the node's count
        of set bits (`Namespace.held`) less those of its next incarnation (`again`, each
        with its bit set)."""
        bit, ns, start = 1 << node_id, self.ns, 0
        while start < end and ns.held.get(node_id, 0) > len(again):
            if ns.walking.get(node_id) is not again:
                return  # the node went down again: a new walk covers this one's
            inodes, start = ns.inodes.scan(start, end, STEP_ITEMS)
            dropped: list[int] = []
            for inode in inodes:
                if inode.refs & bit and inode.ino != ROOT_INO and inode.ino not in again:
                    ns.walked(inode, node_id)
                    self.files.unhold(inode.ino, node_id, dropped)
                    ns.collect(inode)
            self.files.route_outcomes(0)
            if start < end and ns.held.get(node_id, 0) > len(again):
                yield
        if ns.walking.get(node_id) is again:
            del ns.walking[node_id]

    def _hide_job(self, node_id: int, version_ids: array[int]) -> Iterator[None]:
        """The files of a node that went down are hidden: copies of their directories on
        other nodes are told to ask the master about them."""
        for start in range(0, len(version_ids), STEP_ITEMS):
            for version_id in version_ids[start:start + STEP_ITEMS]:
                version = self.objects.versions.get(version_id)
                inode = self.ns.inodes.get(version.ino) if version is not None and version.current else None
                if inode is not None and inode.version == version_id:
                    self.files.changed(inode)
            self.files.route_outcomes(0)
            yield

    def watch_names(self, req: m.WatchNames, caller: int) -> m.Names:
        directory = self.ns.directory(req.ino)
        if req.start_id == 0:
            if len(directory.children) > req.limit:  # type: ignore[arg-type]
                return m.Names([], False)
            self.ns.watch(directory, caller)
        # Every name, hidden files too (their entry says: ask the master); later pages may
        # also hold names added since the first, which the pushes report anyway.
        limit = max(1, min(req.page, 4096))
        page = self.ns.listing(directory, req.start_id, limit)
        names: list[bytes] = []
        entries: list[m.Entry | None] = []
        budget = PAGE_BYTES
        for name, _, _ in page:
            entry = self.files.copy_entry(directory.ino, name, caller)
            budget -= m.entry_bytes(name, entry)
            if budget < 0 and names:
                break
            names.append(name)
            entries.append(entry)
        full = len(names) < len(page) or len(page) == limit
        next_id = page[len(names) - 1][2] if full and names else 0
        return m.Names(names, True, next_id, entries)

    def unwatch(self, req: m.Unwatch, caller: int) -> m.Done:
        for ino in req.inos:
            inode = self.ns.inodes.get(ino)
            if inode is not None and inode.is_dir:
                self.ns.unwatch(inode, 1 << caller)
        return m.Done()

    def take_notifications(self, node_id: int) -> list[m.NameChange]:
        node = self.registry.nodes.get(node_id)
        if node is None:
            return []
        changes, node.outbox_names = node.outbox_names, []
        return changes

    def remove_node(self, req: m.RemoveNode) -> m.Removed:
        """Forgets a node that is down for good: its hidden files leave the namespace (their
        names are free again) and its name is unregistered. A live node cannot be removed."""
        node_id = self.registry.by_name.get(req.name)
        node = self.registry.nodes.get(node_id) if node_id is not None else None
        if node is None:
            raise MetadataError(errno.ENOENT, f"no node named {req.name!r}")
        if node.live or node.registering:
            raise MetadataError(errno.EBUSY, f"node {req.name!r} is up; stop it first")
        # As a node forgotten for its silence: unregistered, its files (hidden) go in slices, the
        # first now; the answer counts them all and lists the first slice's (all, up to STEP_ITEMS).
        files, _, _, freed = self.objects.totals(node.node_id)
        self._unregister(node)
        entries: list[tuple[int, bytes, int]] = []
        self._forget(node.node_id, entries)
        return m.Removed([], entries, freed, files=files)

    def cluster_status(self, req: m.ClusterStatus) -> m.ClusterInfo:
        """O(nodes): each node's files and bytes are running totals (kvfs.cluster.totals)."""
        now = self.clock.monotonic()
        nodes = []
        for node in sorted(self.registry.nodes.values(), key=lambda n: n.node_id):
            files, dram_only, ssd, nbytes = self.objects.totals(node.node_id)
            u = node.usage
            nodes.append(m.NodeStatus(node.node_id, node.name, node.address, node.live,
                                      round(now - node.last_seen, 3), u.dram_capacity, u.dram_used,
                                      u.ssd_capacity, u.ssd_used, files, dram_only, ssd, nbytes, node.activity))
        return m.ClusterInfo(nodes, len(self.ns.inodes), self.ns.files, self.objects.sealed_bytes)
