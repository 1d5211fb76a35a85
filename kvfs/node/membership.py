"""A node's part in a cluster: registering with the master, heartbeats, SSD files at start,
the copies of watched directories' names, and the names it resolves without the master.

A collaborator the node's file service owns (`Node.membership`): one concern, how a node
joins and stays in the cluster. It is handed what it uses — the master client, the store,
the directory cache — and reads the file service's own state (versions being written, open
handles) through the small `MemberFiles` interface, so that it imports nothing of the service.
"""

from __future__ import annotations

import errno
import logging
import math
import time
from typing import Callable, Iterable, Protocol

import trio

from kvfs.wire import messages as m
from kvfs.cluster.embedded import MasterClient
from kvfs.net.pushes import COPY_LEASE_S
from kvfs.net.rpc import MasterUnavailable
from kvfs.disk.records import DiskFile
from kvfs.errors import KvfsError
from kvfs.node.dircache import DirectoryCache
from kvfs.node.heldnames import HeldNames
from kvfs.node.relocations import RecordMoves
from kvfs.store.tiered import TieredStore

log = logging.getLogger("kvfs.node")

REPORT_BATCH = 2000  # versions per registration report
HEARTBEAT_S = 0.5  # the master declares a node dead after 2.5 s without one


def to_disk_file(record: m.FileRecord) -> DiskFile:
    """The master's description of a file, as the SSD tier stores it (its own format)."""
    return DiskFile(record.path, record.size, record.mode, record.uid, record.gid, record.mtime_ns,
                    dict(record.xattrs))


def to_file_record(file: DiskFile) -> m.FileRecord:
    """A file from the SSD tier, as the master's messages carry it."""
    return m.FileRecord(file.path, file.size, file.mode, file.uid, file.gid, file.mtime_ns, dict(file.xattrs))


class MemberFiles(Protocol):
    """What membership needs of the node's file service: what it holds beyond the store
    (versions being written, open handles), and where the master's answers go."""

    node_id: int
    forget_entries: Callable[[list[tuple[int, bytes, int]]], None]

    def writing(self) -> list[m.Held]:
        """The versions this node is writing, as a registration reports them."""

    def open_counts(self) -> list[tuple[int, bool, int]]:
        """(version, writer, handles) of every handle open here."""

    def is_private(self, version: int) -> bool:
        """A temp file's version the master does not know yet (kvfs.node.private)."""

    def drop(self, versions: Iterable[int]) -> None:
        """Frees versions the master no longer knows."""

    def activity(self) -> m.Activity:
        """The node's counters, sent with each heartbeat."""


class Membership:
    """Registration, heartbeats and directory copies of one node."""

    def __init__(self, master: MasterClient, store: TieredStore, dircache: DirectoryCache | None,
                 files: MemberFiles) -> None:
        self.master = master
        self.store = store
        self.dircache = dircache
        self.files = files
        self._fetching: dict[int, list[m.NameChange]] = {}  # directories being copied -> changes meanwhile
        # Seals the master did not confirm (it was unreachable): version -> mtime, reported on registration.
        self.unreported_seals: dict[int, int] = {}
        self.names = HeldNames()  # what lookups resolve to while the master is unreachable
        # The copies answer misses only while current (kvfs.net.pushes): until this trio time,
        # renewed by each heartbeat whose answer finds every push numbered before it applied.
        self.applied = 0  # the number of the last push applied, on this connection
        self._copies_until = -math.inf
        self._beat_now = trio.Event()  # a push to acknowledge: the next heartbeat goes now
        self.acknowledged = 0  # heartbeats sent early to acknowledge pushes
        self.record_moves = RecordMoves()  # index records to rewrite after renames (the master's heartbeats)

    # Directory copies -------------------------------------------------------------------

    async def copy_directory(self, ino: int) -> bool:
        """Fetches a directory's names and watches it (see kvfs.node.dircache). Changes
        pushed while the answer is on its way are applied after it. True when the copy is kept."""
        assert self.dircache is not None
        if ino in self._fetching:
            return False
        self._fetching[ino] = pending = []
        try:
            collected: list[bytes] = []
            entries: list[m.Entry | None] = []
            start_id = 0
            while True:
                names = await self.master.call(m.WatchNames(ino, self.dircache.max_names, start_id), wait_s=0)
                if not names.complete:
                    self.dircache.too_large(ino)
                    return False
                collected.extend(names.names)
                entries.extend(names.entries or [None] * len(names.names))
                if not names.next_id:
                    break
                start_id = names.next_id
            unwatch = self.dircache.store(ino, collected, entries)
            for change in pending:
                self._apply_name_change(change)
            if unwatch:
                await self.master.call(m.Unwatch(unwatch), wait_s=0)
            return ino in self.dircache
        except KvfsError as error:
            log.debug("cannot copy the names of directory %d: %s", ino, error)
            return False
        finally:
            self._fetching.pop(ino, None)  # a re-registration may have cleared it

    def names_changed(self, changes: m.NameChanges) -> None:
        """Name changes the master pushes for watched directories; a numbered push is
        acknowledged with the next heartbeat, sent at once (a writer's reply waits for it)."""
        for change in changes.changes:
            self.name_changed(change)
        if changes.seq > self.applied:
            self.applied = changes.seq
            self._beat_now.set()

    def copies_current(self) -> bool:
        """Whether the directory copies may answer misses now (without the master)."""
        return trio.current_time() < self._copies_until

    def _renew(self, beat: m.Beat, sent: float) -> None:
        """A heartbeat sent at `sent` was answered: the copies are current if they hold every
        push numbered before the master answered it."""
        if self.applied >= beat.pushed:
            self._copies_until = max(self._copies_until, sent + COPY_LEASE_S)

    def name_changed(self, change: m.NameChange) -> None:
        """One change of a watched directory: pushed by the master, or made by this node
        itself (applied before its reply, so that the node never answers from a copy that
        does not know of its own change yet)."""
        if self.dircache is None:
            return
        pending = self._fetching.get(change[0])
        if pending is not None:
            pending.append(change)
        else:
            self._apply_name_change(change)

    def _apply_name_change(self, change: m.NameChange) -> None:
        assert self.dircache is not None
        parent, name, present, entry = change
        if present:
            self.dircache.added(parent, name, entry)
        else:
            self.dircache.removed(parent, name)

    # Joining ----------------------------------------------------------------------------

    def adopt_disk(self) -> int:
        """Cluster mode, at start: takes in the files on SSD (the registration reports them)."""
        ssd = self.store.ssd
        if ssd is None:
            return 0
        count = 0
        for record in ssd.recovered_records():
            self.store.adopt_recovered(record.version, record.file.size, [chunk[2] for chunk in record.chunks])
            count += 1
        log.info("found %d files in %s", count, ssd.directory)
        return count

    async def join(self, master: MasterClient, name: str, address: str) -> None:
        """Registers with the master and reports every version stored here and every open
        handle, so that the master keeps exactly the files that still exist (after a node
        or a master restart alike); what it answers to drop is freed."""
        started = time.monotonic()
        if self.dircache is not None:  # pushes may have been missed while disconnected
            self.dircache.clear()
            self._fetching.clear()
        self.applied, self._copies_until = 0, -math.inf  # a new connection numbers its pushes from 1
        self.files.node_id = (await master.call(m.Register(name, address))).node
        held = self._held()
        opens = self.files.open_counts()
        dropped: list[int] = []
        for start in range(0, max(len(held), 1), REPORT_BATCH):
            batch = held[start : start + REPORT_BATCH]
            reported = await master.call(m.Report(batch, opens if start == 0 else []))
            dropped.extend(reported.dropped)
            if time.monotonic() - started > 1:
                log.info("registering with the master: reported %d of %d files", start + len(batch), len(held))
        dropped.extend((await master.call(m.FinishRegistration())).dropped)
        self.unreported_seals.clear()
        self.files.drop(dropped)
        sent = trio.current_time()
        beat = await master.call(self._heartbeat_request())  # the master learns capacity and use now
        self._apply_beat(beat)
        self._renew(beat, sent)
        log.info("registered as node %d: %d files kept, %d dropped, in %.2f s", self.files.node_id,
                 len(held) - len(set(dropped)), len(set(dropped)), time.monotonic() - started)

    def _held(self) -> list[m.Held]:
        held = []
        records = self.store.disk_records()
        for version, size, checksums, on_disk in self.store.holdings():
            if self.files.is_private(version):  # a temp file only this node knows (kvfs.node.private)
                continue
            record = records.get(version)
            held.append(m.Held(version, size, True, on_disk, self.unreported_seals.get(version, 0), checksums,
                               to_file_record(record.file) if record is not None and on_disk else None))
        return held + self.files.writing()

    # Staying in -------------------------------------------------------------------------

    async def acknowledge_forever(self) -> None:
        """Acknowledges applied pushes at once, each with a heartbeat of its own: one waiting
        for its answer (held behind this node's replies that wait for other nodes'
        acknowledgements) must not hold back the next acknowledgement."""
        async with trio.open_nursery() as nursery:
            while True:
                await self._beat_now.wait()
                self._beat_now = trio.Event()
                self.acknowledged += 1
                nursery.start_soon(self._acknowledge)

    async def _acknowledge(self) -> None:
        sent = trio.current_time()
        try:
            beat = await self.master.call(self._heartbeat_request(activity=False), wait_s=0)
        except KvfsError as error:  # (unreachable, or still registering: counted all the same)
            log.debug("acknowledging pushed name changes: %s", error)
            return
        self._apply_beat(beat)
        self._renew(beat, sent)

    async def heartbeat(self) -> bool:
        """One heartbeat: tells the master this node lives, acknowledges the pushes applied,
        and applies what happened elsewhere. False if the master no longer knows this node
        (it must register again)."""
        sent = trio.current_time()
        try:
            beat = await self.master.call(self._heartbeat_request(), wait_s=0)
        except MasterUnavailable:
            return True  # the link reconnects and registers again by itself
        except KvfsError as error:
            if error.errno == errno.ESTALE:
                log.warning("the master declared this node dead; registering again")
                return False
            raise
        self._apply_beat(beat)
        self._renew(beat, sent)
        return True

    def _heartbeat_request(self, activity: bool = True) -> m.Heartbeat:
        """(An acknowledgement leaves the counters to the periodic heartbeat: it stays small.)"""
        ssd = self.store.ssd
        return m.Heartbeat(self.store.dram.capacity, self.store.dram.used, ssd.capacity if ssd else 0,
                           ssd.used if ssd else 0, self.files.activity() if activity else None, self.applied)

    def _apply_beat(self, beat: m.Beat) -> None:
        self.files.drop(beat.dropped)
        if beat.forget:
            self.files.forget_entries(beat.forget)
        if beat.relocated:
            self.record_moves.add(beat.relocated)
