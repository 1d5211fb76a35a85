"""A buddy allocator over a byte range (pure: no memory is touched here).

The DRAM arena hands out power-of-two blocks between `min_block` (4 KiB, the page
size, so blocks stay page-aligned for O_DIRECT, io_uring fixed buffers and RDMA
registration) and `max_block` (one chunk). Full chunks take one max-order block
with no waste; a file's shorter last chunk is shrunk in place at seal time by
returning its upper halves. Coalescing on free keeps fragmentation bounded.
"""

from __future__ import annotations


def _order_for(size: int, min_block: int) -> int:
    """The smallest order whose block (min_block << order) holds `size` bytes."""
    blocks = -(-size // min_block)
    return max(0, (blocks - 1).bit_length())


class BuddyAllocator:
    """Allocates aligned power-of-two blocks inside `[0, capacity)`."""

    def __init__(self, capacity: int, min_block: int = 4096, max_block: int = 4 << 20) -> None:
        if min_block <= 0 or min_block & (min_block - 1):
            raise ValueError(f"min_block must be a power of two, got {min_block}")
        if max_block < min_block or max_block & (max_block - 1):
            raise ValueError(f"max_block must be a power of two >= min_block, got {max_block}")
        self.min_block = min_block
        self.max_block = max_block
        self.max_order = _order_for(max_block, min_block)
        self.capacity = capacity - capacity % max_block
        # free[order] holds the offsets of free blocks of that order.
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._free[self.max_order] = set(range(0, self.capacity, max_block))
        self._allocated: dict[int, int] = {}  # offset -> order
        self.used = 0

    def block_size(self, order: int) -> int:
        return self.min_block << order

    def size_of(self, offset: int) -> int:
        """The size of the allocated block at `offset`."""
        return self.block_size(self._allocated[offset])

    def allocate(self, size: int) -> int | None:
        """Returns the offset of a block of at least `size` bytes, or None if none is free."""
        if size <= 0 or size > self.max_block:
            raise ValueError(f"cannot allocate {size} bytes (1..{self.max_block})")
        order = _order_for(size, self.min_block)
        found = order
        while found <= self.max_order and not self._free[found]:
            found += 1
        if found > self.max_order:
            return None
        offset = self._free[found].pop()
        while found > order:  # split, keeping the lower half
            found -= 1
            self._free[found].add(offset + self.block_size(found))
        self._allocated[offset] = order
        self.used += self.block_size(order)
        return offset

    def reserve(self, offset: int, size: int) -> bool:
        """Marks the block of `size` bytes at `offset` allocated (rebuilding state on
        restart). False if it is misaligned, out of range or overlaps an allocation."""
        order = _order_for(size, self.min_block)
        block = self.block_size(order)
        if size <= 0 or size > self.max_block or offset % block or offset + block > self.capacity:
            return False
        containing = order
        while containing <= self.max_order:
            start = offset - offset % self.block_size(containing)
            if start in self._free[containing]:
                break
            containing += 1
        else:
            return False
        self._free[containing].remove(start)
        while containing > order:  # split, keeping the half that holds offset
            containing -= 1
            half = self.block_size(containing)
            if offset >= start + half:
                self._free[containing].add(start)
                start += half
            else:
                self._free[containing].add(start + half)
        self._allocated[offset] = order
        self.used += block
        return True

    def allocated_size(self, offset: int) -> int:
        return self.block_size(self._allocated[offset])

    def free(self, offset: int) -> None:
        order = self._allocated.pop(offset)
        self.used -= self.block_size(order)
        self._release(offset, order)

    def shrink(self, offset: int, size: int) -> None:
        """Shrinks the block at `offset` to the smallest block that holds `size` bytes."""
        order = self._allocated[offset]
        new_order = _order_for(max(size, 1), self.min_block)
        while order > new_order:
            order -= 1
            self._release(offset + self.block_size(order), order)
            self.used -= self.block_size(order)
        self._allocated[offset] = order

    def _release(self, offset: int, order: int) -> None:
        while order < self.max_order:
            buddy = offset ^ self.block_size(order)
            if buddy not in self._free[order]:
                break
            self._free[order].remove(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)

    def check(self) -> None:
        """Asserts the allocator's invariants (for tests)."""
        spans = [(o, self.block_size(k)) for o, k in self._allocated.items()]
        for order, offsets in enumerate(self._free):
            spans += [(o, self.block_size(order)) for o in offsets]
        spans.sort()
        position = 0
        for offset, size in spans:
            assert offset == position, f"gap or overlap at {offset} (expected {position})"
            assert offset % size == 0, f"block at {offset} of {size} bytes is misaligned"
            position += size
        assert position == self.capacity, f"blocks cover {position} of {self.capacity} bytes"
        assert self.used == sum(self.block_size(k) for k in self._allocated.values())
