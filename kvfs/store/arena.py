"""The DRAM arena: one anonymous memory mapping that holds every chunk of a node.

One large mapping (instead of a bytes object per chunk) lets reads return
zero-copy memoryview slices to pyfuse3, lets SSD I/O move chunks straight in
and out of it, and lets the same memory be registered once as an RDMA memory region.
"""

from __future__ import annotations

import errno
import logging
import mmap
import time

from kvfs.config import format_size
from kvfs.errors import StorageError
from kvfs.store.buddy import BuddyAllocator

log = logging.getLogger(__name__)

PAGE_SIZE = 4096
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
POPULATE_STEP = 256 << 20


class Arena:
    """A preallocated memory range with a buddy allocator over it."""

    def __init__(self, capacity: int, max_block: int) -> None:
        self.allocator = BuddyAllocator(capacity, PAGE_SIZE, max_block)
        self.capacity = self.allocator.capacity
        self._map = mmap.mmap(-1, max(self.capacity, PAGE_SIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)  # fewer TLB misses on multi-MiB copies
        self.view = memoryview(self._map)

    def populate(self) -> None:
        """Faults every page in now: a first touch costs more than the copy itself
        (writes into fresh memory ran at 0.4 GB/s, into populated memory at 18 GB/s)."""
        started = time.monotonic()
        for offset in range(0, self.capacity, POPULATE_STEP):
            length = min(POPULATE_STEP, self.capacity - offset)
            try:
                self._map.madvise(MADV_POPULATE_WRITE, offset, length)
            except OSError as error:
                if error.errno != errno.EINVAL:  # ENOMEM: the memory is not there
                    raise StorageError(error.errno or errno.ENOMEM,
                                       f"cannot preallocate the {format_size(self.capacity)} DRAM tier") from None
                for page in range(offset, offset + length, PAGE_SIZE):  # kernels before 5.14
                    self._map[page] = 0
            if self.capacity > 4 * POPULATE_STEP and (offset // POPULATE_STEP) % 8 == 7:
                log.info("preallocating DRAM tier: %s of %s", format_size(offset + length), format_size(self.capacity))
        log.info("preallocated %s DRAM tier in %.1f s", format_size(self.capacity), time.monotonic() - started)

    @property
    def used(self) -> int:
        return self.allocator.used

    def allocate(self, size: int) -> int | None:
        return self.allocator.allocate(size)

    def block_size(self, offset: int) -> int:
        """The size of the allocated block at `offset`."""
        return self.allocator.allocated_size(offset)

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def shrink(self, offset: int, size: int) -> None:
        self.allocator.shrink(offset, size)

    def zero(self, offset: int, length: int) -> None:
        if length > 0:
            self.view[offset : offset + length] = bytes(length)
