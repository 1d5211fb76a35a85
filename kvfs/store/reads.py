"""Reading a version stored on this node: from DRAM, or from SSD while it streams in.

A version in DRAM is pinned for its reader. One on SSD is promoted into DRAM on its second
touch (if room can be made without waiting); otherwise its chunks stream into read
buffers, each verified before it is served, the first before the open returns. A chunk
that fails its checksum quarantines its file; a device error fails the read with EIO and
is counted (`kvfs.store.faults`).
"""

from __future__ import annotations

import errno
import functools
import logging
from typing import Any, Callable

import trio

from kvfs.concurrency import run_all
from kvfs.disk.tier import CorruptChunk, SsdTier
from kvfs.errors import NoSpace, StorageError
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.contract import StoreOwner, StoreStats
from kvfs.store.dram import DramTier
from kvfs.store.faults import StorageFaults
from kvfs.store.residency import Residency, chunk_lengths
from kvfs.store.source import ReadSource

# The store's parts log as one component, under the name its lines have always had.
log = logging.getLogger("kvfs.store.tiered")


class LocalReads:
    """The store's read path for versions it holds; owned by `TieredStore`, which shares its
    books, tiers and counters with it and hands it the callbacks below."""

    def __init__(self, residency: Residency, dram: DramTier, ssd: SsdTier | None, faults: StorageFaults,
                 stats: StoreStats, read_buffers: ReadBufferPool, owner: Callable[[], StoreOwner],
                 spawn: Callable[..., Any], demote_one: Callable[[], bool], disk_freed: Callable[[], None]) -> None:
        self.residency = residency
        self.dram = dram
        self.ssd = ssd
        self.faults = faults
        self.stats = stats
        self.read_buffers = read_buffers
        self.chunk_size = dram.chunk_size
        self._owner = owner  # a getter: the node becomes the owner after the store is built
        self._spawn = spawn  # starts a stream in the store's nursery
        self._demote_one = demote_one  # room for a promotion, the store's way
        self._disk_freed = disk_freed  # a removal that waited for these reads can go now
        self._promotions: dict[int, trio.Event] = {}  # set when a promotion in flight ends

    def promoting(self, version: int) -> bool:
        """Whether a promotion is bringing the version into DRAM (readers wait for it)."""
        return version in self._promotions

    def unpin(self, version: int) -> None:
        """A DRAM reader (or a peer's lease) is done."""
        if self.residency.unpin(version):  # the file went while it was read
            self.dram.drop(version)

    async def open_read(self, version: int) -> ReadSource:
        """Makes a version readable: pinned in DRAM, promoted on a second touch, or read from SSD."""
        while version in self._promotions:  # another reader is bringing it into DRAM: use that
            await self._promotions[version].wait()
        if version in self.dram:
            self.residency.pin(version)
            self.residency.touch(version)
            return ReadSource(version, from_dram=True)
        if self.ssd is None or version not in self.ssd:
            raise StorageError(errno.ENOENT, f"version {version} is stored on no tier of this node")
        touches = self.residency.touch_on_ssd(version)
        size = self.residency.stored(version).size
        if touches >= 2 and await self._promote(version):
            return ReadSource(version, from_dram=True)  # promotion pinned it for this reader
        lengths = chunk_lengths(size, self.chunk_size)
        source = ReadSource.buffered(version, lengths, self.read_buffers)
        if not lengths:  # an empty file: nothing to read
            return source
        if len(lengths) > 1:  # the rest streams in, from now on, while the reader is served
            source.streaming = True
            self._hold_disk_copy(version)  # until the stream ends, even if the file goes meanwhile
            self._spawn(self._stream_chunks, source)
        try:  # the first chunk before the open returns: a corrupt file fails to open
            await self.read_from_disk(version, source.chunks[:1])
        except BaseException:
            self.close_read(source)
            raise
        source.ready[0].set()
        self.stats.ssd_reads += 1
        self.stats.ssd_read_bytes += size
        return source

    async def read(self, source: ReadSource, offset: int, length: int) -> memoryview | bytes:
        if source.from_dram:
            return self.dram.read(source.version, offset, length)
        return await source.read_chunks(offset, length, self.chunk_size)

    def close_read(self, source: ReadSource) -> None:
        if source.from_dram:
            self.unpin(source.version)
            return
        source.close(self.read_buffers)

    async def _promote(self, version: int) -> bool:
        """Second-touch admission: reads the version into DRAM if room can be made without
        waiting, and returns it pinned for the caller. While its blocks fill, other readers
        wait for it and it can be neither demoted nor freed."""
        size = self.residency.stored(version).size
        lengths = chunk_lengths(size, self.chunk_size)
        while True:
            try:
                targets = self.dram.adopt(version, lengths)
                break
            except NoSpace:
                if not self._demote_one():
                    return False
        self._promotions[version] = done = trio.Event()
        self.residency.begin_promote(version)
        promoted = False
        try:
            await self.read_from_disk(version, targets)
            promoted = self.residency.end_promote(version)  # False: the file went while we read it
            if promoted:  # its chunks were just verified: their pieces' checksums, for peers
                self.dram.keep_pieces(version, lengths)
        finally:
            del self._promotions[version]
            done.set()
            if not promoted:  # give the blocks back; readers that waited go to the SSD
                if self.residency.promoting(version):
                    self.residency.promote_failed(version)
                self.dram.drop(version)
        if not promoted:
            return False
        self.stats.promoted_files += 1
        self.stats.ssd_reads += 1
        self.stats.ssd_read_bytes += size
        return True

    async def _stream_chunks(self, source: ReadSource) -> None:
        async def one(index: int) -> None:
            try:
                await self.read_from_disk(source.version, source.chunks[index : index + 1], first_index=index)
            except StorageError as error:
                source.failures[index] = error if error.errno == errno.EIO else StorageError(errno.EIO, str(error))
            except OSError as error:
                source.failures[index] = StorageError(errno.EIO, f"version {source.version}: {error}")
            except Exception as error:  # a bug must fail this read, not the daemon
                log.exception("reading chunk %d of version %d failed", index, source.version)
                source.failures[index] = StorageError(errno.EIO, f"version {source.version}: {error!r}")
            source.ready[index].set()

        try:
            async with trio.open_nursery() as nursery:
                for index in range(1, len(source.chunks)):
                    nursery.start_soon(one, index)
        finally:
            self._release_disk_copy(source.version)
            source.end_stream(self.read_buffers)

    async def read_from_disk(self, version: int, targets: list[memoryview], first_index: int = 0) -> None:
        """Reads and verifies chunks; a corrupt one quarantines the file and fails with EIO."""
        assert self.ssd is not None
        self._hold_disk_copy(version)
        try:
            await run_all(functools.partial(self.ssd.read_chunk, version, index, target)
                          for index, target in enumerate(targets, first_index))
        except CorruptChunk as error:
            self.stats.checksum_failures += 1
            await self._quarantine(version, error)
            raise StorageError(errno.EIO, str(error)) from None
        except OSError as error:  # the device failed the read: counted, logged once per run
            self.faults.failed("read", error, f"version {version}")
            raise StorageError(errno.EIO, f"version {version}: reading {self.ssd.directory} failed: {error}") from None
        finally:
            self._release_disk_copy(version)
        self.faults.succeeded("read")

    async def _quarantine(self, version: int, error: CorruptChunk) -> None:
        """A corrupt chunk: its file leaves the namespace, and its record and extents the
        SSD, for good (once its reads are done). Logged once per file, with its path."""
        if not self.residency.quarantine(version):
            return
        self.stats.quarantined_files += 1
        record = await self._owner().describe(version)
        name = "/" + "/".join(part.decode(errors="replace") for part in record.file.path) if record else "(unlinked)"
        log.error("%s: %s; the file is quarantined (removed from the namespace and the SSD)", name, error)
        await self._owner().lost(version)


    def _hold_disk_copy(self, version: int) -> None:
        """While held, a version's extents on SSD are not freed (its reads are in flight)."""
        self.residency.hold_disk(version)

    def _release_disk_copy(self, version: int) -> None:
        if self.residency.release_disk(version):  # removed while it was read: free it now
            self._disk_freed()
