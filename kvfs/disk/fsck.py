"""`kvfs fsck --disk DIR [--repair]`: checks an SSD tier offline, and repairs it.

The check reads the index (in a child process, as a mount does) and every extent
header and chunk in the segments, and compares the two. A repair makes them
agree again, keeping every file whose data is intact:

- a damaged or missing index is set aside and rebuilt from the headers;
- an index entry whose data fails its checksum is deleted (and its header erased);
- an entry whose header is missing or stale gets its header rewritten;
- a header no entry points at (a file removed, or a copy cut short, just before a crash) is erased.

A mount repairs a damaged index by itself; fsck is for checking a tier without
mounting it, and for the finer repairs above.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvfs.config import format_size
from kvfs.disk.header import PAGE, HeaderBody, encode_header
from kvfs.disk.index import DiskIndex
from kvfs.disk.index_check import IndexState, check_index
from kvfs.disk.rebuild import Found, SegmentReader, describe, scan_tier, verify
from kvfs.disk.records import LAYOUT_VERSION, IndexEntry, LayoutMeta
from kvfs.disk.segments import SEGMENT_SIZE, segment_path
from kvfs.disk.tier import index_map_size, lock_directory, old_layout_message, set_aside
from kvfs.errors import StorageError
from kvfs.chunks import CHUNK_SIZE

log = logging.getLogger(__name__)


@dataclass
class FsckReport:
    index: str = ""  # the index's state, in words
    files: int = 0  # files the tier holds (after a repair: that it now holds)
    file_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # headers the index does not use, damaged or superseded
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not self.problems


def tier_capacity(segments: Path, chunk_size: int) -> int:
    """The tier's size, from its segment files (whole chunks, as the allocator counts it)."""
    total = index = 0
    while segment_path(segments, index).exists():
        size = segment_path(segments, index).stat().st_size
        total += size
        index += 1
        if size < SEGMENT_SIZE:
            break
    return total - total % chunk_size


def fsck(directory: Path, repair: bool, chunk_size: int = CHUNK_SIZE) -> FsckReport:
    segments = directory / "segments"
    index_path = directory / "index"
    if not segments.is_dir() and not index_path.is_dir():
        raise StorageError(errno.ENOENT, f"{directory} holds no SSD tier (no segments/, no index/)")
    lock = lock_directory(directory)
    try:
        capacity = tier_capacity(segments, chunk_size)
        state = check_index(index_path, capacity, chunk_size, index_map_size(capacity))
        if state.kind == "layout":
            raise StorageError(errno.EINVAL, old_layout_message(directory, state))
        scanned = scan_tier(segments, capacity, chunk_size, "checking")
        report = FsckReport()
        if state.kind == "ok":
            report.index = f"healthy, {state.records} entries"
            report.notes = scanned.skipped
            _compare(directory, capacity, chunk_size, scanned.entries, report, repair)
        else:
            report.index = f"damaged ({state.detail or 'missing'})"
            report.problems.append(f"the index {index_path} is {report.index}")
            report.problems += scanned.skipped
            report.files, report.file_bytes = len(scanned.entries), scanned.file_bytes
            if repair:
                _replace_index(index_path, state, capacity, chunk_size, scanned.entries)
                report.repaired = True
        return report
    finally:
        os.close(lock)


def _replace_index(path: Path, state: IndexState, capacity: int, chunk_size: int, entries: list[IndexEntry]) -> None:
    aside = set_aside(path, state)
    index = DiskIndex(path, index_map_size(capacity))
    try:
        for start in range(0, len(entries), 1000):
            index.put(entries[start : start + 1000])
        index.set_layout(LayoutMeta(LAYOUT_VERSION, chunk_size, SEGMENT_SIZE))
    finally:
        index.close()
    log.warning("rebuilt the index %s from the segments: %d files (the damaged one is kept as %s)",
                path, len(entries), aside)


def _compare(directory: Path, capacity: int, chunk_size: int, intact: list[IndexEntry], report: FsckReport,
             repair: bool) -> None:
    """A healthy index against the headers in the segments."""
    by_header = {entry.header: entry for entry in intact}
    index = DiskIndex(directory / "index", index_map_size(capacity))
    reader = SegmentReader(directory / "segments", capacity)
    fd_cache: dict[int, int] = {}
    doomed: list[int] = []  # versions whose entries go
    try:
        used_headers = set()
        for entry in index.entries():
            if isinstance(entry, bytes):  # the probe decoded every entry: not reached
                continue
            record = entry.record
            used_headers.add(entry.header)
            found = Found(entry.header, entry.header_length, HeaderBody(chunk_size, 0, record))
            name = describe(found.body)
            on_disk = by_header.get(entry.header)
            if on_disk is not None and on_disk.record == record:
                report.files += 1
                report.file_bytes += record.file.size
                continue
            damage = verify(reader, found)
            if damage is not None:
                report.problems.append(f"{name}: {damage}")
                doomed.append(record.version)
                if repair:
                    _write_at(directory, fd_cache, entry.header, bytes(PAGE))
                continue
            report.problems.append(f"{name}: its extent header is missing or stale")
            report.files += 1
            report.file_bytes += record.file.size
            if repair:
                block = encode_header(record, chunk_size, time.time_ns())
                if len(block) > entry.header_length:  # cannot happen: the header was written from this record
                    raise StorageError(errno.EFBIG, f"{name}: its header no longer fits its block")
                _write_at(directory, fd_cache, entry.header, block)
        for entry in intact:
            if entry.header not in used_headers:
                name = describe(HeaderBody(chunk_size, 0, entry.record))
                report.problems.append(f"{name} at tier offset {entry.header}: a header the index does not "
                                       "know (a file removed, or a copy cut short, just before a crash)")
                if repair:
                    _write_at(directory, fd_cache, entry.header, bytes(PAGE))
        if repair:
            for fd in fd_cache.values():
                os.fsync(fd)
            index.delete(doomed)
            report.repaired = bool(report.problems)
    finally:
        for fd in fd_cache.values():
            os.close(fd)
        reader.close()
        index.close()


def _write_at(directory: Path, fds: dict[int, int], offset: int, data: bytes) -> None:
    index, within = divmod(offset, SEGMENT_SIZE)
    if index not in fds:
        fds[index] = os.open(segment_path(directory / "segments", index), os.O_WRONLY | os.O_CLOEXEC)
    os.pwrite(fds[index], data, within)


def render(directory: Path, report: FsckReport) -> str:
    lines = [f"{directory}: index {report.index}; {report.files} intact files ({format_size(report.file_bytes)})"]
    lines += [f"  problem: {line}" for line in report.problems]
    if report.notes:
        lines.append(f"  {len(report.notes)} headers not used by the index, damaged or superseded (logged above)")
    if report.repaired:
        lines.append("repaired")
    elif report.problems:
        lines.append(f"{len(report.problems)} problems; run kvfs fsck --disk {directory} --repair to repair them")
    else:
        lines.append("clean")
    return "\n".join(lines)
