"""Rebuilding the SSD tier's index from its segments (at mount, and by `kvfs fsck --repair`).

The scan reads the tier's address range in large sequential windows and picks
out every page that starts a valid extent header. Which headers to keep is a
pure decision (`choose`): newest version first, and a header whose blocks
overlap ones already kept is an older file whose space was reused. Each kept
file's chunks are then read and verified against their checksums; a file with
a damaged header or damaged data is skipped with one line naming it, the others
are recovered.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from kvfs import progress, systemd
from kvfs.checksum import chunk_checksum
from kvfs.disk.header import PAGE, HeaderBody, HeaderError, decode_header, header_span, magic_pages
from kvfs.disk.records import IndexEntry
from kvfs.disk.segments import SEGMENT_SIZE, segment_path
from kvfs.buddy import BuddyAllocator

log = logging.getLogger(__name__)

WINDOW = 4 << 20


def rounded(length: int) -> int:
    return -(-length // PAGE) * PAGE


@dataclass(frozen=True)
class Found:
    """A valid header at a tier offset, its block's length."""

    offset: int
    length: int
    body: HeaderBody


@dataclass
class Rebuilt:
    entries: list[IndexEntry] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # one line per file or header left out
    scanned_bytes: int = 0
    file_bytes: int = 0
    seconds: float = 0.0


def describe(body: HeaderBody) -> str:
    path = b"/".join(body.record.file.path).decode(errors="replace")
    return f"/{path} (version {body.record.version})"


class SegmentReader:
    """Buffered reads of the tier's address range (the scan must not need O_DIRECT alignment)."""

    def __init__(self, directory: Path, capacity: int) -> None:
        self.directory = directory
        self.capacity = capacity
        self.fds: list[int] = []
        for index in range(-(-capacity // SEGMENT_SIZE)):
            path = segment_path(directory, index)
            self.fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC) if path.exists() else -1)

    def read(self, offset: int, length: int) -> bytes:
        """Up to `length` bytes at `offset` inside one segment (fewer at its end or a missing file)."""
        index, within = divmod(offset, SEGMENT_SIZE)
        if index >= len(self.fds) or self.fds[index] < 0:
            return b""
        fd = self.fds[index]
        data = os.pread(fd, min(length, SEGMENT_SIZE - within), within)
        os.posix_fadvise(fd, within, len(data), os.POSIX_FADV_DONTNEED)  # a scan, not a working set
        return data

    def close(self) -> None:
        for fd in self.fds:
            if fd >= 0:
                os.close(fd)
        self.fds.clear()


def scan(reader: SegmentReader, tell: Callable[[int, int], None]) -> tuple[list[Found], list[str]]:
    """Every valid header in the address range, and a line for each damaged one."""
    found: list[Found] = []
    damaged: list[str] = []
    for start in range(0, reader.capacity, WINDOW):
        try:
            window = reader.read(start, WINDOW)
        except OSError as error:  # a bad stretch of the disk: the rest may still be read
            damaged.append(f"tier offsets {start}-{start + WINDOW - 1}: unreadable ({error.strerror}); skipped")
            continue
        for within in magic_pages(window):
            offset = start + within
            try:
                length = header_span(window[within : within + PAGE])
                block = window[within : within + length]
                if len(block) < length:  # a large header running past the window
                    block = reader.read(offset, length)
                found.append(Found(offset, length, decode_header(block)))
            except (HeaderError, OSError) as error:
                segment = segment_path(reader.directory, offset // SEGMENT_SIZE).name
                damaged.append(f"header at tier offset {offset} ({segment} byte {offset % SEGMENT_SIZE}): "
                               f"{error}; skipped")
        tell(min(start + WINDOW, reader.capacity), len(found))
    return found, damaged


def _consistent(body: HeaderBody, chunk_size: int) -> str | None:
    """Why a header's chunk list cannot describe its file, or None."""
    if body.chunk_size != chunk_size:
        return f"chunk size {body.chunk_size}, not {chunk_size}"
    size, chunks = body.record.file.size, body.record.chunks
    expected = [min(chunk_size, size - i * chunk_size) for i in range(-(-size // chunk_size))]
    if [length for _, length, _ in chunks] != expected:
        return f"its chunks do not add up to its size ({size} bytes)"
    return None


def choose(found: Iterable[Found], capacity: int, chunk_size: int) -> tuple[list[Found], list[str]]:
    """The headers to keep (pure): newest first, none overlapping another's blocks."""
    allocator = BuddyAllocator(capacity, PAGE, chunk_size)
    kept: list[Found] = []
    skipped: list[str] = []
    for item in sorted(found, key=lambda f: (f.body.record.version, f.body.written_ns), reverse=True):
        reason = _consistent(item.body, chunk_size)
        if reason is None:
            blocks = [(item.offset, item.length)] + [(o, rounded(n)) for o, n, _ in item.body.record.chunks]
            reserved = []
            for offset, length in blocks:
                if not allocator.reserve(offset, length):
                    break
                reserved.append(offset)
            if len(reserved) == len(blocks):
                kept.append(item)
                continue
            for offset in reserved:
                allocator.free(offset)
            reason = "its blocks overlap a newer file's or lie outside the tier"
        skipped.append(f"{describe(item.body)} at tier offset {item.offset}: {reason}; skipped")
    return kept, skipped


def verify(reader: SegmentReader, item: Found) -> str | None:
    """Why a kept file's data is not intact, or None."""
    for index, (offset, length, checksum) in enumerate(item.body.record.chunks):
        try:
            data = reader.read(offset, length)
        except OSError as error:
            return f"chunk {index} at tier offset {offset} is unreadable ({error.strerror})"
        if len(data) != length:
            return f"chunk {index} at tier offset {offset} is cut short"
        if chunk_checksum(data) != checksum:
            return f"chunk {index} at tier offset {offset} fails its checksum"
    return None


def scan_tier(directory: Path, capacity: int, chunk_size: int, activity: str) -> Rebuilt:
    """Index entries for every intact file in the segments under `directory`, with a progress
    line every second (`activity` says what for); each damaged header or file is
    logged once and left out."""
    started = time.monotonic()
    pace = progress.Every(1.0)
    reader = SegmentReader(directory, capacity)

    def tell(scanned: int, files: int) -> None:
        if pace.due():
            progress.report(f"{activity} {directory}: scanned {scanned >> 20} of {capacity >> 20} MiB, "
                            f"{files} files found", log, logging.WARNING)
            systemd.notify("EXTEND_TIMEOUT_USEC=30000000")  # a long scan is not a hung start

    result = Rebuilt(scanned_bytes=capacity)
    try:
        found, result.skipped = scan(reader, tell)
        kept, skipped = choose(found, capacity, chunk_size)
        result.skipped += skipped
        for item in kept:
            reason = verify(reader, item)
            if reason is not None:
                result.skipped.append(f"{describe(item.body)}: {reason}; skipped")
                continue
            result.entries.append(IndexEntry(item.body.record, item.offset, item.length))
            result.file_bytes += item.body.record.file.size
    finally:
        reader.close()
    for line in result.skipped:
        log.warning("%s %s: %s", activity, directory, line)
    result.seconds = time.monotonic() - started
    return result
