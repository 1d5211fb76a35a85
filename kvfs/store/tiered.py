"""A node's storage: the DRAM tier, the optional SSD tier, and the movement between them.

New versions land in DRAM and are served from there at once. A background
offloader copies sealed versions to SSD (eagerly, or when DRAM use passes a high
watermark); when DRAM needs room it drops the DRAM copies of versions already
safe on SSD (demotion), least valuable first. Writers wait, bounded, for the
offloader rather than fail; only when nothing can be demoted, offloaded or
evicted does a write get ENOSPC. A storage failure (lmdb, ENOSPC, EIO, a short write)
never loses a file: its DRAM copy stays, the failure is counted and logged once per
run (`kvfs.store.faults`), the files wait and are retried with a growing delay, and
while they cannot be copied no DRAM-only file is evicted: writers wait, then get
ENOSPC. A chunk that fails its checksum quarantines its file (it leaves the
namespace and the index for good). A version read from SSD is verified chunk by
chunk and served from a read buffer; on its second touch it is promoted back
into DRAM. Whole-file eviction (the file leaves the namespace) is decided by the
master and requested through the owner's `reclaim`.

`TieredStore` composes the parts, each one concern: `Residency` (the books and every
decision, pure), `Offloader` (DRAM to SSD in the background), `LocalReads` (serving this
node's readers from DRAM or SSD), `PeerChunks` (chunks for and from other nodes). It keeps
writing and making room in DRAM, and the public methods the node calls.
"""

from __future__ import annotations

import errno
import logging
import time
from typing import Awaitable, Callable

import trio

from kvfs.disk.index import DiskRecord
from kvfs.disk.tier import SsdTier
from kvfs.errors import NoSpace, StorageError
from kvfs.policy import make_policy
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.contract import StoreOwner, StoreStats, TierSettings  # re-exported: callers import them from here
from kvfs.store.dram import DramTier
from kvfs.store.faults import StorageFaults
from kvfs.store.offloader import Offloader
from kvfs.store.reads import LocalReads
from kvfs.store.remote import Fetch, HeldChunks, PeerChunks
from kvfs.store.residency import Residency
from kvfs.store.source import ReadSource  # re-exported: callers import it from here

log = logging.getLogger(__name__)


class TieredStore:
    """The trio shell around `Residency`: it does the I/O, the waiting and the background
    tasks; every decision about where a version resides is the residency's."""

    def __init__(self, dram: DramTier, ssd: SsdTier | None, settings: TierSettings = TierSettings(),
                 read_buffers: ReadBufferPool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.dram = dram
        self.ssd = ssd
        self.read_buffers = read_buffers or ReadBufferPool(0, dram.chunk_size)
        self.settings = settings
        self.chunk_size = dram.chunk_size
        self.clock = clock  # trio.current_time under a MockClock
        self.owner: StoreOwner | None = None
        self.stats = StoreStats()
        self.residency = Residency(make_policy(settings.eviction_policy), clock)
        self._nursery: trio.Nursery | None = None
        self.faults = StorageFaults(str(ssd.directory) if ssd is not None else "", log, clock)
        self.offloader = Offloader(self.residency, dram, ssd, self.faults, self.stats, settings, clock, self._owner)
        self.reads = LocalReads(self.residency, dram, ssd, self.faults, self.stats, self.read_buffers, self._owner,
                                self._spawn, self._demote_one, self.offloader.nudge)
        self.peers = PeerChunks(self.residency, dram, self.reads, self.read_buffers, self._spawn)

    # Queries --------------------------------------------------------------------------

    def disk_records(self) -> dict[int, DiskRecord]:
        """The SSD index's records (for re-registration: how to restore files the master lost)."""
        if self.ssd is None:
            return {}
        return {record.version: record for record in self.ssd.index.records() if isinstance(record, DiskRecord)}

    def holdings(self) -> list[tuple[int, int, list[int], bool]]:
        """(version, size, checksums, on SSD) of every sealed version stored here."""
        return self.residency.holdings()

    def __contains__(self, version: int) -> bool:
        return version in self.dram or (self.ssd is not None and version in self.ssd)

    def on_disk(self, version: int) -> bool:
        return self.ssd is not None and version in self.ssd

    def is_saved(self, version: int) -> bool:
        """Whether a version's SSD copy would survive a crash under its current name."""
        return self.offloader.is_saved(version)

    def unsaved(self) -> tuple[int, int]:
        """Files (and bytes) stored here with no copy on SSD under their current name:
        what stopping now would lose."""
        return self.residency.unsaved()

    def offload_failed(self) -> tuple[int, int]:
        """Files (and bytes) waiting for a retry after a storage failure."""
        return self.residency.parked_totals()

    def tier_of(self, version: int) -> str:
        """Where a version is; "ssd" only once its copy there would survive a crash as named."""
        tiers = [name for name, present in (("dram", version in self.dram), ("ssd", self.is_saved(version)))
                 if present]
        return "+".join(tiers) or "none"

    # Writing --------------------------------------------------------------------------

    def create(self, version: int) -> None:
        self.dram.create(version)

    async def write(self, version: int, offset: int, data: bytes | memoryview) -> None:
        self.residency.wrote()
        await self._with_room(lambda: self.dram.write(version, offset, data))

    def truncate(self, version: int, size: int) -> None:
        self.dram.truncate(version, size)

    async def copy(self, source: int, target: int, size: int, reader: ReadSource | None = None) -> None:
        """Copies a version's bytes into a new one (copy-on-write), from whichever tier has
        them, or from `reader` (a version stored on another node)."""
        self.dram.create(target)
        if reader is None:
            reader = await self.open_read(source)
        try:
            for start in range(0, size, self.chunk_size):
                length = min(self.chunk_size, size - start)
                chunk = bytes(await self.read(reader, start, length))  # a copy: a demotion may free the source
                await self.write(target, start, chunk)
        finally:
            self.close_read(reader)

    def seal(self, version: int, size: int) -> list[int]:
        checksums = self.dram.seal(version, size)
        self.residency.seal(version, size, checksums)
        if self.ssd is not None:
            if self.settings.offload == "eager":
                self.offloader.queue(version)
            else:
                self.offloader.check_watermark()
        return checksums

    # Room in DRAM ---------------------------------------------------------------------

    async def _with_room(self, operation: Callable[[], None]) -> None:
        while True:
            try:
                return operation()
            except NoSpace as error:
                if not await self._make_room(error.needed or self.chunk_size):
                    if self.offloader.failing():
                        raise StorageError(errno.ENOSPC, f"{error}; DRAM holds files that cannot be copied to "
                                                         f"SSD ({self.faults.last_error()})") from error
                    raise StorageError(errno.ENOSPC, f"{error}; nothing can be demoted or evicted") from error

    async def _make_room(self, needed: int) -> bool:
        if self._demote_one():
            return True
        if self.ssd is None:
            return await self._owner().reclaim("dram", needed)
        if not self.residency.offload_pending():
            self.offloader.queue_all_dram_only()
        if self.offloader.failing():  # evicting would lose files: wait (bounded) for the SSD to work again
            return await self.offloader.wait_for_room()
        if self.residency.offload_pending() and not self.offloader.stuck:
            if await self.offloader.wait_for_room():
                return True
        if self.offloader.failing():  # it failed while we waited
            return False
        # SSD cannot take more: evict whole files still only in DRAM.
        return await self._owner().reclaim("dram", needed)

    def _demote_one(self) -> bool:
        """Drops the DRAM copy of the least valuable version that is safe on SSD."""
        if self.ssd is None:  # nothing is (and the scan would visit every version)
            return False
        version = self.residency.demote_one()
        if version is None:
            return False
        self.dram.drop(version)
        self.stats.demoted_files += 1
        return True

    def demote_all(self) -> int:
        """Drops every DRAM copy that is safe on SSD (an operator's or a benchmark's request)."""
        demoted = 0
        while self._demote_one():
            demoted += 1
        return demoted

    def describe_extents(self, version: int) -> str:
        """'offset+length' of each chunk on SSD (tier offsets; segment = offset // 256 MiB)."""
        if self.ssd is None or version not in self.ssd:
            return ""
        return ",".join(f"{e.offset}+{e.length}" for e in self.ssd.extents[version])

    def _owner(self) -> StoreOwner:
        assert self.owner is not None, "the store has no owner"
        return self.owner

    def spawn(self, function: Callable[..., Awaitable[None]], *args: object) -> None:
        """Starts a background task beside the store's streams (the node's deferred releases)."""
        self._spawn(function, *args)

    def _spawn(self, function: Callable[..., Awaitable[None]], *args: object) -> None:
        """Starts a stream in the background (`run`'s nursery)."""
        assert self._nursery is not None, "the store is not running"
        self._nursery.start_soon(function, *args)

    # Reading (`LocalReads`) --------------------------------------------------------------

    async def open_read(self, version: int) -> ReadSource:
        """Makes a version readable: pinned in DRAM, promoted on a second touch, or read from SSD."""
        return await self.reads.open_read(version)

    async def read(self, source: ReadSource, offset: int, length: int) -> memoryview | bytes:
        return await self.reads.read(source, offset, length)

    def close_read(self, source: ReadSource) -> None:
        self.reads.close_read(source)

    # Chunks for and from other nodes (`PeerChunks`) ----------------------------------------

    async def serve_chunks(self, version: int, first: int, count: int,
                           send: Callable[[int, memoryview | bytes], Awaitable[None]]) -> None:
        """Hands chunks of a sealed version to `send` in order (the peer server's source)."""
        await self.peers.serve_chunks(version, first, count, send)

    def hold_chunks(self, version: int, first: int, count: int) -> HeldChunks | None:
        """A run of a version's chunks as pinned DRAM views (None: not in DRAM now)."""
        return self.peers.hold_chunks(version, first, count)

    def piece_checksums(self, version: int, index: int) -> list[int] | None:
        """The writer's checksums of one chunk's pieces, if kept (sent with the chunk)."""
        return self.peers.piece_checksums(version, index)

    def lease_dram(self, version: int, first: int, count: int) -> tuple[list[int | None], list[int]] | None:
        """Pins a sealed version's DRAM copy for a peer's RDMA READs (None: not in DRAM)."""
        return self.peers.lease_dram(version, first, count)

    def end_lease(self, version: int) -> None:
        self.peers.end_lease(version)

    async def open_remote(self, version: int, size: int, fetch: Fetch, streams: int) -> ReadSource:
        """A reader of a version stored on another node: `start_remote`, then `remote_answered`."""
        return await self.peers.open_remote(version, size, fetch, streams)

    def start_remote(self, version: int, size: int, fetch: Fetch, streams: int) -> ReadSource:
        """Starts streaming a version stored on another node into read buffers."""
        return self.peers.start_remote(version, size, fetch, streams)

    async def remote_answered(self, source: ReadSource) -> ReadSource:
        """Waits until the owner answered; an owner without the version fails the open."""
        return await self.peers.remote_answered(source)

    # Dropping -------------------------------------------------------------------------

    def drop(self, version: int) -> None:
        """Frees a version everywhere (its file is gone); SSD space is freed by the reaper."""
        free_now, remove = self.residency.drop(version)
        if free_now:
            self.dram.drop(version)  # else once the I/O using it is done
        if remove:
            self.offloader.nudge()

    # Background work ------------------------------------------------------------------

    async def run(self) -> None:
        """Background work while mounted: streaming reads, and the offloader and disk reaper."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.ssd is None:
                await trio.sleep_forever()
            await self.offloader.run()

    # The offloader's, for the node --------------------------------------------------------

    def queue_all_dram_only(self) -> int:
        """Queues every sealed version whose only copy is in DRAM; returns how many."""
        return self.offloader.queue_all_dram_only()

    def offload_backlog(self) -> tuple[int, int]:
        """Files, and their bytes, queued for or being copied to SSD (or waiting for a retry)."""
        return self.offloader.offload_backlog()

    async def wait_offloaded(self) -> None:
        """Returns once every version queued so far is on SSD (or could not be)."""
        await self.offloader.wait_offloaded()

    async def wait_saved(self, version: int) -> None:
        """fsync of a sealed version: returns once it is on SSD under its current name."""
        await self.offloader.wait_saved(version)

    def retry_now(self) -> None:
        """Retries failed offloads and record rewrites at once (a stop, fsync, sync or flush)."""
        self.offloader.retry_now()

    def remove_later(self, versions: list[int], error: BaseException) -> None:
        """Records the index failed to delete (at start): the offloader retries them."""
        self.offloader.remove_later(versions, error)

    async def flush_removals(self) -> None:
        """Removes the SSD records of dropped files now (a failure raises)."""
        await self.offloader.flush_removals()

    async def flush_removals_now(self) -> None:
        """At a stop: removes the records of dropped files (a failure is counted and logged)."""
        await self.offloader.flush_removals_now()

    async def refresh_record(self, version: int) -> None:
        """Rewrites a version's index record after its path or attributes changed."""
        await self.offloader.refresh_record(version)

    async def refresh_records(self, versions: list[int]) -> None:
        """Rewrites several versions' index records together (kvfs.node.relocations)."""
        await self.offloader.refresh_records(versions)

    # Recovery ---------------------------------------------------------------------------

    def adopt_recovered(self, version: int, size: int, checksums: list[int]) -> None:
        self.residency.adopt_recovered(version, size, checksums)

    def drop_recovered(self, version: int) -> None:
        self.residency.drop_recovered(version)
