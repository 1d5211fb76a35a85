"""Preallocated segment files that hold the SSD tier's chunks.

The tier's space is one address range split into segment files of 256 MiB,
preallocated with fallocate at start so that the host filesystem can never fill
up under kvfs, and so that no per-block file metadata sits on the hot path.
Chunk extents come from a buddy allocator over the whole range; blocks never
straddle two segments because the largest block (one chunk) divides a segment.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from pathlib import Path

from kvfs import progress
from kvfs.config import format_size
from kvfs.errors import StorageError

log = logging.getLogger(__name__)

SEGMENT_SIZE = 256 << 20
PROGRESS_EVERY_S = 2.0  # a start that takes longer says how far it got this often


def segment_path(directory: Path, index: int) -> Path:
    return directory / f"segment-{index:05d}.dat"


class SegmentFiles:
    def __init__(self, directory: Path, capacity: int, direct_io: bool) -> None:
        self.directory = directory
        self.capacity = capacity
        self.fds: list[int] = []
        self.direct = direct_io
        directory.mkdir(parents=True, exist_ok=True)
        count = -(-capacity // SEGMENT_SIZE)
        started = time.monotonic()
        pace = progress.Every(PROGRESS_EVERY_S)
        created: list[Path] = []  # segments this start made, removed again if it fails
        for index in range(count):
            size = min(SEGMENT_SIZE, capacity - index * SEGMENT_SIZE)
            path = segment_path(directory, index)
            if not path.exists():
                created.append(path)
            try:
                self.fds.append(self._open(path, size))
            except BaseException:  # never leave the disk full of a tier that did not start
                self.close()
                for made in created:
                    made.unlink(missing_ok=True)
                raise
            if index + 1 < count and pace.due():
                progress.report(f"preallocating the SSD tier in {directory}: {format_size((index + 1) * SEGMENT_SIZE)}"
                                f" of {format_size(capacity)}", log)
        if time.monotonic() - started >= PROGRESS_EVERY_S:
            log.info("preallocated the %s SSD tier in %.1f s", format_size(capacity), time.monotonic() - started)
        # Segments left by a larger earlier configuration hold nothing we index any more.
        for stale in sorted(directory.glob("segment-*.dat"))[count:]:
            log.info("removing %s (beyond the configured disk size)", stale)
            stale.unlink()

    def _open(self, path: Path, size: int) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        fd = -1
        if self.direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                log.warning("%s: O_DIRECT is not supported here; using buffered I/O", self.directory)
                self.direct = False
        if fd < 0:
            fd = os.open(path, flags, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.posix_fallocate(fd, 0, size)
        except OSError as error:
            os.close(fd)
            raise StorageError(error.errno or errno.EIO,
                               f"cannot preallocate {format_size(size)} in {path}: {error.strerror}") from None
        return fd

    def locate(self, offset: int) -> tuple[int, int]:
        """The segment fd and the offset inside it of a tier offset."""
        index, within = divmod(offset, SEGMENT_SIZE)
        return self.fds[index], within

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
