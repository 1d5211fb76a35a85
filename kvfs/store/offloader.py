"""The offloader: the background task that copies sealed versions from DRAM to SSD.

It takes queued versions in batches (writes them, commits their records in one index
transaction), settles each record against the file's current name (a rename may land
while its chunks are in flight), reports the versions safe on SSD to the owner, removes
the records of dropped files, and after a storage failure parks the files in DRAM and
retries them with a growing delay (`Residency.backoff`). Writers short of DRAM wait for it
(`wait_for_room`, bounded); fsync and a stop wait for its passes. Every decision about
which version goes when is the residency's; this module does the I/O and the waiting.
"""

from __future__ import annotations

import errno
import functools
import logging
from typing import Callable

import trio

from kvfs.concurrency import run_all
from kvfs.disk.index import DiskRecord
from kvfs.disk.tier import SsdTier, rounded
from kvfs.errors import NoSpace, StorageError
from kvfs.store.contract import StoreOwner, StoreStats, TierSettings
from kvfs.store.dram import DramTier
from kvfs.store.faults import STORAGE_ERRORS, StorageFaults
from kvfs.store.residency import Residency

# The store's parts log as one component, under the name its lines have always had.
log = logging.getLogger("kvfs.store.tiered")

OFFLOAD_BATCH_FILES = 16
OFFLOAD_BATCH_BYTES = 128 << 20
# Offload yields to a burst of writes (on two cores it would take CPU from the writers)
# until writes pause for OFFLOAD_QUIET_S, but never for longer than OFFLOAD_MAX_DEFER_S
# per batch, and not at all once DRAM passes the high watermark.
OFFLOAD_MAX_DEFER_S = 0.5
# Why an fsync found nothing to save: the owner found no name a restart could bring it back under.
NAMELESS = ("no name to save it under was found (unlinked or replaced while open, a temp file private to "
            "this node, or the master did not answer)")


class Offloader:
    """Copies a store's sealed versions to SSD in the background; owned by `TieredStore`,
    which shares its books, tiers, fault counters and counters with it."""

    def __init__(self, residency: Residency, dram: DramTier, ssd: SsdTier | None, faults: StorageFaults,
                 stats: StoreStats, settings: TierSettings, clock: Callable[[], float],
                 owner: Callable[[], StoreOwner]) -> None:
        self.residency = residency
        self.dram = dram
        self.ssd = ssd
        self.faults = faults
        self.stats = stats
        self.settings = settings
        self.clock = clock
        self._owner = owner  # a getter: the node becomes the owner after the store is built
        self.chunk_size = dram.chunk_size
        self._wanted = trio.Event()  # something is queued or removed, or a retry is asked for
        self._space_freed = trio.Event()  # set (and replaced) after each batch: DRAM copies became demotable
        self._idle = trio.Event()
        self._idle.set()
        self.stuck = False  # the SSD is full and nothing on it can be evicted
        # Versions an fsync waits for, and those of them the owner found no name for: their
        # fsync's EIO says so rather than blame a full tier.
        self._awaited: set[int] = set()
        self._nameless: set[int] = set()

    def nudge(self) -> None:
        """Something for the next pass that does not make callers wait (a removal, a rewrite)."""
        self._wanted.set()

    def is_saved(self, version: int) -> bool:
        """Whether a version's SSD copy would survive a crash under its current name."""
        return self.ssd is not None and version in self.ssd and not self.residency.is_unsettled(version)


    # Work coming in ----------------------------------------------------------------------

    def wake(self) -> None:
        """Work for the next pass that `wait_offloaded` waits for (it is not idle until then)."""
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._wanted.set()

    def queue(self, version: int) -> None:
        """A sealed version to copy (eager offload, or fsync)."""
        if self.residency.queue(version):
            self.wake()

    def check_watermark(self) -> None:
        """Watermark offload: past the high mark, queues DRAM-only bytes down to the low one."""
        settings = self.settings
        if self.residency.queue_for_watermark(self.dram.used, self.dram.capacity, settings.high_watermark,
                                              settings.low_watermark):
            self.wake()

    def queue_all_dram_only(self) -> int:
        """Queues every sealed version whose only copy is in DRAM; returns how many."""
        queued = self.residency.queue_all_dram_only()
        if queued:
            self.wake()
        return queued

    def retry_now(self) -> None:
        """Retries failed offloads and record rewrites at once (a stop, fsync, sync or flush)."""
        parked = self.residency.parked()
        self.residency.retry_now()
        if parked or self.residency.resettles() or self.residency.removals():
            self.wake()

    def remove_later(self, versions: list[int], error: BaseException) -> None:
        """Records the index failed to delete (at start): the offloader retries them."""
        self.residency.remove_later(versions)
        self.faults.failed("index", error, f"removing {len(versions)} records")
        self.residency.failed()

    # Writers and waiters -----------------------------------------------------------------

    def failing(self) -> bool:
        """The SSD tier fails (until an offload or index write succeeds again)."""
        return self.faults.failing("offload") or self.faults.failing("index")

    async def wait_for_room(self) -> bool:
        """Backpressure: a writer waits (bounded) for the offloader to make DRAM copies demotable."""
        self.stats.backpressure_waits += 1
        started = self.clock()
        event = self._space_freed
        with trio.move_on_after(self.settings.backpressure_timeout_s):
            await event.wait()
        self.stats.backpressure_seconds += self.clock() - started
        return event.is_set()

    def offload_backlog(self) -> tuple[int, int]:
        """Files, and their bytes, queued for or being copied to SSD (or waiting for a retry)."""
        if self.ssd is None:
            return 0, 0
        return self.residency.backlog()

    async def wait_offloaded(self) -> None:
        """Returns once every version queued so far is on SSD (or could not be): the end of
        the offloader's pass that takes them (later seals do not prolong the wait)."""
        if self.ssd is not None and (self.residency.offload_pending() or not self._idle.is_set()):
            await self._idle.wait()

    async def wait_saved(self, version: int) -> None:
        """fsync of a sealed version: returns once it is on SSD under its current name (a
        failed copy is retried at once); EIO if it cannot be copied now."""
        if self.ssd is None or version not in self.residency or self.is_saved(version):
            return
        self._awaited.add(version)
        try:
            self.queue(version)  # (unless it is being copied now)
            self.retry_now()
            await self.wait_offloaded()
        finally:
            self._awaited.discard(version)
            nameless = version in self._nameless
            self._nameless.discard(version)
        if version in self.residency and not self.is_saved(version):
            cause = (NAMELESS if nameless else self.faults.last_error()) or "the SSD tier is full"
            raise StorageError(errno.EIO, f"version {version} could not be copied to {self.ssd.directory}: {cause}")

    # The loop ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Passes until cancelled; each pass ends with the offloader idle."""
        while True:
            await self._wait_for_work()
            self._wanted = trio.Event()
            if not self.residency.retry_due():  # the SSD failed a moment ago: wait for the retry
                self.residency.park_queue()
            else:
                try:
                    await self._offload_pass()
                except Exception:  # a bug: the files stay in DRAM, and are retried later
                    log.exception("offload pass failed")
                    busy = self.residency.busy_versions()
                    self.residency.park(self.residency.queued() + [v for v, u in busy.items() if u.offloading])
                    self.residency.failed()
            self._idle.set()

    async def _wait_for_work(self) -> None:
        """Until something is queued or removed, or (after a failure) the retry is due."""
        if self.residency.retry_pending(self.faults.failing("index")):
            with trio.move_on_after(self.residency.retry_wait_s()):
                await self._wanted.wait()
        else:
            await self._wanted.wait()

    async def _offload_pass(self) -> None:
        self.residency.requeue_parked()  # their retry is due: first in line, in their order
        if not await self._settle_pending() or not await self._flush_removals_counted():
            self.residency.park_queue()  # the index cannot be written: neither can records
            return
        while self.residency.queued():
            await self._yield_to_writers()
            if not await self._offload_batch(self.residency.take_batch(OFFLOAD_BATCH_FILES, OFFLOAD_BATCH_BYTES)):
                self.residency.park_queue()  # until the retry: one attempt per delay
                return
            await self._flush_removals_counted()
        self.residency.backoff.succeeded()
        self.faults.succeeded("offload")  # (also when the files that failed went meanwhile)

    async def _yield_to_writers(self) -> None:
        deadline = self.clock() + OFFLOAD_MAX_DEFER_S
        while self.clock() < deadline and not self._space_wanted():
            quiet_from = self.residency.quiet_from()
            if self.clock() >= quiet_from:
                return
            await trio.sleep_until(min(quiet_from, deadline))

    def _space_wanted(self) -> bool:
        """DRAM pressure or a waiting writer: offload at full speed."""
        return (self.dram.used > self.settings.high_watermark * self.dram.capacity
                or self._space_freed.statistics().tasks_waiting > 0)

    # Batches and their records -----------------------------------------------------------

    async def _offload_batch(self, batch: list[int]) -> bool:
        """Copies a batch to SSD; False after a storage failure (the batch is parked, in DRAM)."""
        assert self.ssd is not None
        planned: list[tuple[int, list[int], DiskRecord]] = []
        try:
            for version in batch:
                entry = self.residency.stored(version)
                lengths = entry.lengths(self.chunk_size)
                try:
                    self.dram.materialize(version, entry.size)
                except NoSpace:
                    continue
                offsets = await self._allocate_disk(lengths)
                if offsets is None:
                    continue
                record = await self._owner().describe(version)
                if record is None or version not in self.residency:
                    self.ssd.release(offsets)
                    if record is None and version in self._awaited:
                        self._nameless.add(version)
                    continue
                record.chunks = [(o, n, c) for o, n, c in zip(offsets, lengths, entry.checksums)]
                planned.append((version, offsets, record))
                self.residency.start_offload(version)
            if not planned:
                return True
            await run_all(functools.partial(self.ssd.write_chunks, offsets,
                                            [self.dram.block_view(version, i) for i in range(len(offsets))])
                          for version, offsets, _ in planned)
            await self.ssd.commit([record for _, _, record in planned])  # headers, one sync, the index
        except BaseException as error:  # nothing of the batch is on SSD: it stays in DRAM
            for version, offsets, _ in planned:
                self.ssd.release(offsets)
                self.residency.finish_offload(version)
                self._release_if_dropped(version)
            self.residency.park(batch)
            if not isinstance(error, STORAGE_ERRORS):
                raise
            self.faults.failed("offload", error, f"{len(batch)} files")
            self.residency.failed()
            return False
        self.faults.succeeded("offload")
        self.faults.succeeded("index")  # the commit was an index write
        for version, _, _ in planned:
            self.residency.committed(version)
        for version, _, record in planned:
            if self.residency.finish_offload(version):  # the file went meanwhile
                self._unsettle_dropped(version)
                continue
            try:
                settled = await self._settle(record)
            except STORAGE_ERRORS as error:  # committed under an older name: rewritten later
                self.faults.failed("index", error, f"version {version}")
                self.residency.failed()
                if version in self.residency:
                    self.residency.needs_resettle(version, True)
                continue
            if not settled:
                self._unsettle_dropped(version)
                continue
            await self._saved(version, first=True)
        self._space_freed.set()
        self._space_freed = trio.Event()
        return True

    async def _allocate_disk(self, lengths: list[int]) -> list[int] | None:
        assert self.ssd is not None
        while True:
            offsets = self.ssd.allocate(lengths)
            if offsets is not None:
                self.stuck = False
                return offsets
            if not await self._owner().reclaim("disk", sum(rounded(n) for n in lengths)):
                if not self.stuck:
                    log.warning("SSD tier full and nothing on it can be evicted; files stay in DRAM only")
                self.stuck = True
                return None
            await self.flush_removals()

    def _release_if_dropped(self, version: int) -> None:
        if self.residency.release_if_dropped(version):
            self.dram.drop(version)

    def _unsettle_dropped(self, version: int) -> None:
        if self.residency.unsettle_dropped(version):
            self.dram.drop(version)

    async def _saved(self, version: int, first: bool) -> None:
        """A record now names the file as it is: from here on the master knows it is on SSD,
        so a later rename rewrites the record itself."""
        self.residency.saved(version)
        entry = self.residency.entry(version)
        if not first or entry is None:
            return
        await self._owner().offloaded([version])
        size = entry.size
        self.residency.reported(version)
        self.stats.offloaded_files += 1
        self.stats.offloaded_bytes += size

    async def _settle(self, record: DiskRecord) -> bool:
        """Rewrites a just-committed record until it matches the file's current path and
        attributes (a rename may have landed while its chunks were in flight); False if
        the file is gone. Until then the version does not count as on SSD."""
        while True:
            current = await self._owner().describe(record.version)
            if current is None:
                return False
            current.chunks = record.chunks
            if current == record:
                return True
            await self.ssd.update([current])  # type: ignore[union-attr]
            record = current

    async def _settle_pending(self) -> bool:
        """Rewrites the records that an index failure left naming an older path; False if
        the index still fails."""
        assert self.ssd is not None
        rewritten = False
        for version, first in self.residency.resettles().items():
            if version not in self.residency or not version in self.ssd:
                self.residency.resettled(version)
                continue
            record = await self._owner().describe(version)
            if record is None:  # the file is going: its drop removes the record
                self.residency.abandon_resettle(version)
                continue
            record.chunks = [(e.offset, e.length, e.checksum) for e in self.ssd.extents[version]]
            try:
                await self.ssd.update([record])
                settled = await self._settle(record)
            except STORAGE_ERRORS as error:
                self.faults.failed("index", error, f"rewriting {len(self.residency.resettles())} records")
                self.residency.failed()
                return False
            rewritten = True
            self.residency.resettled(version)
            if settled:
                await self._saved(version, first)
            else:  # the file went meanwhile: its drop removes the record
                self.residency.abandon_resettle(version)
        if rewritten:
            self.faults.succeeded("index")
        return True

    async def refresh_record(self, version: int) -> None:
        """Rewrites a version's index record after its path or attributes changed; if the
        index fails, the version counts as not on SSD until the offloader rewrites it."""
        await self.refresh_records([version])

    async def refresh_records(self, versions: list[int]) -> None:
        """`refresh_record` of several versions (a directory's files after its rename): the
        owner asked for each at once, their headers and records written and synced together."""
        ssd = self.ssd
        if ssd is None:
            return
        wanted = [version for version in versions if version in ssd and self._settled(version)]
        described: list[DiskRecord] = []

        async def describe(version: int) -> None:
            record = await self._owner().describe(version)
            if record is not None:
                described.append(record)

        await run_all(functools.partial(describe, version) for version in wanted)
        records = [record for record in described if record.version in ssd and self._settled(record.version)]
        for record in records:  # (the extents as they are now: the descriptions took a while)
            record.chunks = [(e.offset, e.length, e.checksum) for e in ssd.extents[record.version]]
        if not records:
            return
        try:
            await ssd.update(records)
        except STORAGE_ERRORS as error:
            self.faults.failed("index", error, f"version {records[0].version}" if len(records) == 1
                               else f"rewriting {len(records)} records")
            self.residency.failed()
            for record in records:
                if record.version in self.residency:
                    self.residency.needs_resettle(record.version, False)
            self._wanted.set()

    def _settled(self, version: int) -> bool:
        """Not waiting for the offloader to write its record anew (which gives the new path)."""
        entry = self.residency.entry(version)
        return entry is None or entry.resettle is None

    # Removals ----------------------------------------------------------------------------

    async def flush_removals_now(self) -> None:
        """At a stop: removes the records of dropped files (a failure is counted and logged)."""
        if self.ssd is not None:
            await self._flush_removals_counted()

    async def _flush_removals_counted(self) -> bool:
        """Removes records of dropped files; False (counted, retried later) if the index fails."""
        assert self.ssd is not None
        writes = any(v in self.ssd for v in self.residency.removable())
        try:
            await self.flush_removals()
        except STORAGE_ERRORS as error:
            self.faults.failed("index", error, f"removing {len(self.residency.removals())} records")
            self.residency.failed()
            return False
        if writes:
            self.faults.succeeded("index")
        return True

    async def flush_removals(self) -> None:
        """Removes the SSD records and extents of dropped files now (a failure raises)."""
        if self.ssd is not None and self.residency.removals():
            # Versions still being read from SSD keep their extents until the reads are done.
            versions = self.residency.take_removals()
            try:
                await self.ssd.remove(versions)
            except BaseException:  # nothing was removed: the next pass tries again
                self.residency.restore_removals(versions)
                raise
            self.residency.removed_from_ssd(versions)
