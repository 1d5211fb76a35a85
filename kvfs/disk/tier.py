"""The SSD tier: chunk extents in segment files, indexed in lmdb, checked on every read.

Each file on the tier also has an extent header (kvfs/disk/header.py) holding its
record: at start the index is checked in a child process (kvfs/disk/index_check.py),
and an index that is missing, truncated, zeroed or garbled is set aside and
rebuilt from the headers in the segments (kvfs/disk/rebuild.py).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import trio

from kvfs.checksum import chunk_checksum
from kvfs.concurrency import run_all
from kvfs.config import format_size
from kvfs.disk.engine import ALIGN, AlignedIo
from kvfs.disk.header import encode_header
from kvfs.disk.index import DiskIndex
from kvfs.disk.index_check import CUT_SHORT, IndexState, check_index
from kvfs.disk.rebuild import scan_tier
from kvfs.disk.records import LAYOUT_VERSION, DiskRecord, IndexEntry, LayoutMeta
from kvfs.disk.segments import SEGMENT_SIZE, SegmentFiles, segment_path
from kvfs.errors import StorageError
from kvfs.buddy import BuddyAllocator

log = logging.getLogger(__name__)

SPARE_HEADER_PAGES = 64


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


def lock_directory(directory: Path) -> int:
    """An exclusive lock on a tier's directory, held while it is in use (mount or fsck)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StorageError(errno.EBUSY, f"{directory} is in use by another kvfs process") from None
    return fd


def index_map_size(capacity: int) -> int:
    return max(1 << 30, capacity // 256)


def has_segments(directory: Path) -> bool:
    return segment_path(directory / "segments", 0).exists()


def old_layout_message(directory: Path, state: IndexState) -> str:
    if state.layout and state.layout < LAYOUT_VERSION:
        return (f"{directory} holds an SSD tier of layout {state.layout} (written by an earlier kvfs, without "
                f"extent headers); this kvfs uses layout {LAYOUT_VERSION} and does not convert it. Its contents "
                f"are a cache: remove {directory / 'index'} and {directory / 'segments'} (or use another "
                "directory) and mount again")
    return (f"{directory} holds an SSD tier of another layout ({state.detail}); use an empty directory "
            "or remove it")


def set_aside(index_path: Path, state: IndexState) -> Path:
    """Moves a damaged index out of the way (the last one is kept, for a post-mortem). The
    remains of a rebuild cut short (no index, or one without its layout record) are
    discarded instead where a damaged copy is already aside: that copy is the index the
    rebuild came from."""
    aside = index_path.with_name(index_path.name + ".damaged")
    if (state.kind == "absent" or state.detail == CUT_SHORT) and aside.exists():
        shutil.rmtree(index_path, ignore_errors=True)
        return aside
    shutil.rmtree(aside, ignore_errors=True)
    if index_path.exists():
        index_path.rename(aside)
    return aside


class SsdTier:
    def __init__(self, directory: Path, capacity: int, engine: AlignedIo, chunk_size: int, direct_io: bool) -> None:
        self.directory = directory
        self.engine = engine
        self.chunk_size = chunk_size
        self.allocator = BuddyAllocator(capacity, ALIGN, chunk_size)
        self.capacity = self.allocator.capacity
        if self.capacity < chunk_size:
            raise StorageError(errno.EINVAL, f"disk size {format_size(capacity)} is below one chunk")
        self.extents: dict[int, list[DiskExtent]] = {}
        self.headers: dict[int, tuple[int, int]] = {}  # version -> its header block (offset, length)
        self._header_pages: list[int] = []  # set aside by allocate() for the next commits
        # A rewrite and a removal of one version must not interleave (the index would keep
        # a record of freed space): they take turns.
        self._rewriting = trio.Lock()
        self._zero_page = mmap.mmap(-1, ALIGN)  # page-aligned: erasures go straight to O_DIRECT
        self._lock = lock_directory(directory)
        try:
            self.index, damaged = self._open_index()
            self.segments = SegmentFiles(directory / "segments", self.capacity, direct_io)
            if damaged:
                self._rebuild()
        except BaseException:
            os.close(self._lock)
            raise

    def _open_index(self) -> tuple[DiskIndex, bool]:
        """The index, checked first; True if it was damaged or missing (a new, empty one
        replaces it, to be rebuilt from the segments)."""
        path = self.directory / "index"
        map_size = index_map_size(self.capacity)
        state = check_index(path, self.capacity, self.chunk_size, map_size)
        if state.kind == "layout":
            raise StorageError(errno.EINVAL, old_layout_message(self.directory, state))
        damaged = state.kind == "damaged" or (state.kind == "absent" and has_segments(self.directory))
        if damaged:
            aside = set_aside(path, state)
            log.warning("the SSD index %s is %s; rebuilding it from the segments%s", path,
                        f"damaged ({state.detail})" if state.kind == "damaged" else "missing",
                        f" (the damaged copy is kept as {aside})" if aside.exists() else "")
        elif state.kind == "absent":
            shutil.rmtree(path, ignore_errors=True)  # an empty index: start afresh
        elif state.detail:  # readable, and whole: the store copes with failing writes
            log.warning("the SSD index %s: %s", path, state.detail)
        index = DiskIndex(path, map_size=map_size)
        if not damaged and state.kind != "ok":
            index.set_layout(self._layout())
        return index, damaged

    def _layout(self) -> LayoutMeta:
        return LayoutMeta(LAYOUT_VERSION, self.chunk_size, SEGMENT_SIZE)

    def _rebuild(self) -> None:
        """Fills the new index from the segments; its layout record goes last, so that an
        interrupted rebuild reads as damage (and runs again) at the next start."""
        segments = self.directory / "segments"
        result = scan_tier(segments, self.capacity, self.chunk_size, "rebuilding the SSD index from")
        for start in range(0, len(result.entries), 1000):
            self.index.put(result.entries[start : start + 1000])
        self.index.set_layout(self._layout())
        log.warning("rebuilt the SSD index from %s: %d files (%s) in %.1f s; %d damaged or superseded skipped",
                    segments, len(result.entries), format_size(result.file_bytes), result.seconds,
                    len(result.skipped))

    @property
    def used(self) -> int:
        return self.allocator.used

    def __contains__(self, version: int) -> bool:
        return version in self.extents

    # Writing ------------------------------------------------------------------------

    def allocate(self, lengths: list[int]) -> list[int] | None:
        """Offsets for chunks of these lengths, or None (nothing allocated) if the tier is full.
        A page for the file's extent header is set aside with them: a commit never fails
        for want of a page on a tier that had room for the chunks."""
        offsets: list[int] = []
        for length in [*lengths, ALIGN]:
            offset = self.allocator.allocate(rounded(length))
            if offset is None:
                for taken in offsets:
                    self.allocator.free(taken)
                return None
            offsets.append(offset)
        self._header_pages.append(offsets.pop())
        return offsets

    def release(self, offsets: list[int]) -> None:
        for offset in offsets:
            self.allocator.free(offset)
        # Offloads that failed or were dropped leave their header pages behind: keep a few.
        while len(self._header_pages) > SPARE_HEADER_PAGES:
            self.allocator.free(self._header_pages.pop())

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
        """Writes the records' extent headers, syncs them with their chunks (written by
        write_chunks), then makes the records durable; only then do they count as on disk."""
        headers = [self._header_block(record) for record in records]
        try:
            await self._write_headers(headers)
            await self.sync([o for record in records for o, _, _ in record.chunks] + [o for o, _ in headers])
            entries = [IndexEntry(record, offset, len(block)) for record, (offset, block) in zip(records, headers)]
            await trio.to_thread.run_sync(self.index.put, entries)
        except BaseException:
            self.release([offset for offset, _ in headers])
            raise
        for record, (offset, block) in zip(records, headers):
            self.extents[record.version] = [DiskExtent(*chunk) for chunk in record.chunks]
            self.headers[record.version] = (offset, len(block))

    async def update(self, records: list[DiskRecord]) -> None:
        """Rewrites records of versions already on disk (a rename, new attributes): each header
        in place when the new one fits its block, else in a new block, then the index."""
        async with self._rewriting:
            await self._update([record for record in records if record.version in self.headers])

    async def _update(self, records: list[DiskRecord]) -> None:
        blocks: list[tuple[int, bytes]] = []
        fresh: list[int] = []  # blocks allocated here
        moved: list[int] = []  # the blocks they replace
        try:
            for record in records:
                offset, _ = self.headers[record.version]
                block = encode_header(record, self.chunk_size, time.time_ns())
                if len(block) <= self.allocator.allocated_size(offset):
                    blocks.append((offset, block))
                else:
                    blocks.append(self._header_block(record))
                    fresh.append(blocks[-1][0])
                    moved.append(offset)
            await self._write_headers(blocks)
            await self.sync([offset for offset, _ in blocks])
            entries = [IndexEntry(record, offset, len(block)) for record, (offset, block) in zip(records, blocks)]
            await trio.to_thread.run_sync(self.index.put, entries)
        except BaseException:
            self.release(fresh)
            raise
        for record, (offset, block) in zip(records, blocks):
            self.headers[record.version] = (offset, len(block))
        await self._erase(moved)
        self.release(moved)

    def _header_block(self, record: DiskRecord) -> tuple[int, bytes]:
        """A newly allocated block, and the header to write there."""
        block = encode_header(record, self.chunk_size, time.time_ns())
        if len(block) == ALIGN and self._header_pages:
            return self._header_pages.pop(), block
        offset = self.allocator.allocate(len(block)) if len(block) <= self.chunk_size else None
        if offset is None:
            raise OSError(errno.ENOSPC, f"no room on {self.directory} for the extent header of version "
                                        f"{record.version} ({len(block)} bytes)")
        return offset, block

    async def _write_headers(self, blocks: list[tuple[int, bytes]]) -> None:
        def write(offset: int, block: bytes):
            fd, within = self.segments.locate(offset)
            return lambda: self.engine.write_from(fd, within, block)

        await run_all(write(offset, block) for offset, block in blocks)

    async def _erase(self, offsets: list[int]) -> None:
        """Zeroes header pages, so that a rebuild never brings back the files they described."""
        def erase(offset: int):
            fd, within = self.segments.locate(offset)
            return lambda: self.engine.write_from(fd, within, memoryview(self._zero_page))

        try:
            await run_all(erase(offset) for offset in offsets)
        except OSError as error:  # the records are gone already: only a rebuild could revive them
            log.warning("cannot erase %d extent headers in %s: %s", len(offsets), self.directory, error)

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
        async with self._rewriting:
            versions = [v for v in versions if v in self.extents]
            if not versions:
                return
            await trio.to_thread.run_sync(self.index.delete, versions)
            await self._erase([self.headers[version][0] for version in versions])
            for version in versions:
                self._free(version)

    def _free(self, version: int) -> None:
        for extent in self.extents.pop(version, ()):
            self.allocator.free(extent.offset)
        header = self.headers.pop(version, None)
        if header is not None:
            self.allocator.free(header[0])

    # Recovery -----------------------------------------------------------------------

    def recovered_records(self) -> Iterator[DiskRecord]:
        """Index records whose extents are valid, reserving their space; bad ones are deleted
        (the index was checked at start, so there are none unless it changed since)."""
        bad_keys: list[bytes] = []
        for item in self.index.entries():
            if isinstance(item, bytes):
                bad_keys.append(item)
                continue
            record = item.record
            blocks = [(item.header, item.header_length)] + [(o, rounded(n)) for o, n, _ in record.chunks]
            reserved: list[int] = []
            for offset, length in blocks:
                if not self.allocator.reserve(offset, length):
                    break
                reserved.append(offset)
            if len(reserved) != len(blocks):
                log.warning("index record of version %d points at invalid or overlapping space; dropped",
                            record.version)
                self.release(reserved)
                bad_keys.append(record.version.to_bytes(8, "big"))
                continue
            self.extents[record.version] = [DiskExtent(*chunk) for chunk in record.chunks]
            self.headers[record.version] = (item.header, item.header_length)
            yield record
        if bad_keys:
            self.index.delete_keys(bad_keys)

    def forget_recovered(self, versions: list[int]) -> None:
        """Drops records recovery decided not to keep (temp files, superseded versions)."""
        self.index.delete(versions)
        for version in versions:
            if version in self.headers:
                self._erase_now(self.headers[version][0])
            self._free(version)

    def _erase_now(self, offset: int) -> None:
        """`_erase` before the event loop serves anything (recovery)."""
        fd, within = self.segments.locate(offset)
        try:
            os.pwrite(fd, self._zero_page, within)
        except OSError as error:
            log.warning("cannot erase the extent header at tier offset %d in %s: %s", offset, self.directory,
                        error.strerror)

    def close(self) -> None:
        self.segments.close()
        self.index.close()
        os.close(self._lock)
