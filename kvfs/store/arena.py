"""The DRAM arena: one anonymous memory mapping that holds every chunk of a node.

One large mapping (instead of a bytes object per chunk) lets reads return
zero-copy memoryview slices to pyfuse3, and lets the same memory be registered
once as io_uring fixed buffers or an RDMA memory region.
"""

from __future__ import annotations

import mmap

from kvfs.store.buddy import BuddyAllocator

PAGE_SIZE = 4096


class Arena:
    """A preallocated memory range with a buddy allocator over it."""

    def __init__(self, capacity: int, max_block: int) -> None:
        self.allocator = BuddyAllocator(capacity, PAGE_SIZE, max_block)
        self.capacity = self.allocator.capacity
        # Anonymous private memory: pages are committed on first touch, so a large
        # arena costs nothing until it is used.
        self._map = mmap.mmap(-1, max(self.capacity, PAGE_SIZE), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)  # fewer TLB misses on multi-MiB copies
        self.view = memoryview(self._map)

    @property
    def used(self) -> int:
        return self.allocator.used

    def allocate(self, size: int) -> int | None:
        return self.allocator.allocate(size)

    def free(self, offset: int) -> None:
        self.allocator.free(offset)

    def shrink(self, offset: int, size: int) -> None:
        self.allocator.shrink(offset, size)

    def zero(self, offset: int, length: int) -> None:
        if length > 0:
            self.view[offset : offset + length] = bytes(length)
