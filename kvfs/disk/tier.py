"""The SSD tier: chunk extents in segment files, indexed in lmdb, checked on every read."""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import trio

from kvfs.checksum import chunk_checksum
from kvfs.concurrency import run_all
from kvfs.config import format_size
from kvfs.disk.engine import ALIGN, AlignedIo
from kvfs.disk.index import LAYOUT_VERSION, DiskIndex, DiskRecord, LayoutMeta
from kvfs.disk.segments import SEGMENT_SIZE, SegmentFiles
from kvfs.errors import StorageError
from kvfs.store.buddy import BuddyAllocator

log = logging.getLogger(__name__)


def rounded(length: int) -> int:
    """Lengths on disk are whole pages (O_DIRECT)."""
    return -(-length // ALIGN) * ALIGN


class CorruptChunk(StorageError):
    def __init__(self, version: int, index: int) -> None:
        super().__init__(errno.EIO, f"version {version}: chunk {index} failed its checksum on disk")
        self.version = version


@dataclass(frozen=True)
class DiskExtent:
    offset: int  # in the tier's address range
    length: int
    checksum: int


class SsdTier:
    def __init__(self, directory: Path, capacity: int, engine: AlignedIo, chunk_size: int, direct_io: bool) -> None:
        self.directory = directory
        self.engine = engine
        self.chunk_size = chunk_size
        self.allocator = BuddyAllocator(capacity, ALIGN, chunk_size)
        self.capacity = self.allocator.capacity
        if self.capacity < chunk_size:
            raise StorageError(errno.EINVAL, f"disk size {format_size(capacity)} is below one chunk")
        directory.mkdir(parents=True, exist_ok=True)
        self.index = DiskIndex(directory / "index", map_size=max(1 << 30, self.capacity // 256))
        self._check_layout()
        self.segments = SegmentFiles(directory / "segments", self.capacity, direct_io)
        self.extents: dict[int, list[DiskExtent]] = {}

    def _check_layout(self) -> None:
        wanted = LayoutMeta(LAYOUT_VERSION, self.chunk_size, SEGMENT_SIZE)
        found = self.index.layout()
        if found is None:
            self.index.set_layout(wanted)
        elif found != wanted:
            raise StorageError(errno.EINVAL, f"{self.directory} holds a different on-disk layout ({found}); "
                                             "use an empty directory or remove it")

    @property
    def used(self) -> int:
        return self.allocator.used

    def __contains__(self, version: int) -> bool:
        return version in self.extents

    # Writing ------------------------------------------------------------------------

    def allocate(self, lengths: list[int]) -> list[int] | None:
        """Offsets for chunks of these lengths, or None (nothing allocated) if the tier is full."""
        offsets: list[int] = []
        for length in lengths:
            offset = self.allocator.allocate(rounded(length))
            if offset is None:
                for taken in offsets:
                    self.allocator.free(taken)
                return None
            offsets.append(offset)
        return offsets

    def release(self, offsets: list[int]) -> None:
        for offset in offsets:
            self.allocator.free(offset)

    async def write_chunks(self, offsets: list[int], sources: list[memoryview]) -> None:
        def write(offset: int, source: memoryview):
            fd, within = self.segments.locate(offset)

            async def one() -> None:
                done = await self.engine.write_from(fd, within, source)
                if done < len(source):  # a short write is a failed write
                    raise OSError(errno.EIO, f"short write at offset {offset} of {self.directory}: "
                                             f"{done} of {len(source)} bytes")
            return one

        await run_all(write(offset, source) for offset, source in zip(offsets, sources))

    async def sync(self, offsets: list[int]) -> None:
        for fd in {self.segments.locate(offset)[0] for offset in offsets}:
            await self.engine.fsync(fd)

    async def commit(self, records: list[DiskRecord]) -> None:
        """Makes records durable; only then do they count as on disk."""
        await trio.to_thread.run_sync(self.index.put, records)
        for record in records:
            self.extents[record.version] = [DiskExtent(*chunk) for chunk in record.chunks]

    async def update(self, records: list[DiskRecord]) -> None:
        """Rewrites records of versions already on disk (a rename, new attributes)."""
        await trio.to_thread.run_sync(self.index.put, records)

    # Reading ------------------------------------------------------------------------

    async def read_chunk(self, version: int, index: int, target: memoryview) -> None:
        """Reads one chunk into target (its page-rounded length) and verifies its checksum."""
        extents = self.extents.get(version)
        if extents is None:
            raise StorageError(errno.ENOENT, f"version {version} is no longer on {self.directory}")
        extent = extents[index]
        fd, within = self.segments.locate(extent.offset)
        await self.engine.read_into(fd, within, target[: rounded(extent.length)])
        if chunk_checksum(target[: extent.length]) != extent.checksum:
            raise CorruptChunk(version, index)

    # Removing -----------------------------------------------------------------------

    async def remove(self, versions: list[int]) -> None:
        """Deletes index records, then frees their extents (never the other way round)."""
        versions = [v for v in versions if v in self.extents]
        if not versions:
            return
        await trio.to_thread.run_sync(self.index.delete, versions)
        for version in versions:
            for extent in self.extents.pop(version, ()):
                self.allocator.free(extent.offset)

    # Recovery -----------------------------------------------------------------------

    def recovered_records(self) -> Iterator[DiskRecord]:
        """Index records whose extents are valid, reserving their space; bad ones are deleted."""
        bad_keys: list[bytes] = []
        for item in self.index.records():
            if isinstance(item, bytes):
                bad_keys.append(item)
                continue
            reserved: list[int] = []
            for offset, length, _ in item.chunks:
                if not self.allocator.reserve(offset, rounded(length)):
                    break
                reserved.append(offset)
            if len(reserved) != len(item.chunks):
                log.warning("index record of version %d points at invalid or overlapping space; dropped", item.version)
                self.release(reserved)
                bad_keys.append(item.version.to_bytes(8, "big"))
                continue
            self.extents[item.version] = [DiskExtent(*chunk) for chunk in item.chunks]
            yield item
        if bad_keys:
            self.index.delete_keys(bad_keys)

    def forget_recovered(self, versions: list[int]) -> None:
        """Drops records recovery decided not to keep (temp files, superseded versions)."""
        self.index.delete(versions)
        for version in versions:
            for extent in self.extents.pop(version, ()):
                self.allocator.free(extent.offset)

    def close(self) -> None:
        self.segments.close()
        self.index.close()
