"""The buddy allocator: alignment, coalescing, shrinking, exhaustion."""

import random

import pytest

from kvfs.buddy import BuddyAllocator

MiB = 1 << 20


def test_full_blocks_fill_capacity_exactly() -> None:
    allocator = BuddyAllocator(16 * MiB, 4096, 4 * MiB)
    offsets = [allocator.allocate(4 * MiB) for _ in range(4)]
    assert sorted(offsets) == [0, 4 * MiB, 8 * MiB, 12 * MiB]
    assert allocator.allocate(4096) is None
    assert allocator.used == 16 * MiB
    allocator.check()


def test_free_coalesces_back_to_a_full_block() -> None:
    allocator = BuddyAllocator(4 * MiB, 4096, 4 * MiB)
    small = [allocator.allocate(4096) for _ in range(1024)]
    assert None not in small and allocator.allocate(4096) is None
    for offset in small:
        allocator.free(offset)
    allocator.check()
    assert allocator.used == 0
    assert allocator.allocate(4 * MiB) == 0


def test_shrink_returns_upper_halves() -> None:
    allocator = BuddyAllocator(4 * MiB, 4096, 4 * MiB)
    offset = allocator.allocate(4 * MiB)
    allocator.shrink(offset, 2 * MiB + 1)  # needs 4 MiB still: no change
    assert allocator.size_of(offset) == 4 * MiB
    allocator.shrink(offset, 5000)
    assert allocator.size_of(offset) == 8192
    assert allocator.used == 8192
    allocator.check()
    assert allocator.allocate(2 * MiB) is not None


def test_blocks_are_aligned_to_their_size() -> None:
    allocator = BuddyAllocator(8 * MiB, 4096, 4 * MiB)
    for size in (4096, 12288, MiB, 3 * MiB, 100):
        offset = allocator.allocate(size)
        assert offset is not None and offset % allocator.size_of(offset) == 0
    allocator.check()


def test_capacity_rounds_down_to_whole_chunks() -> None:
    assert BuddyAllocator(10 * MiB, 4096, 4 * MiB).capacity == 8 * MiB


@pytest.mark.parametrize("seed", range(5))
def test_random_workload_keeps_invariants(seed: int) -> None:
    rng = random.Random(seed)
    allocator = BuddyAllocator(32 * MiB, 4096, 4 * MiB)
    live: dict[int, int] = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            offset = rng.choice(list(live))
            if rng.random() < 0.3:
                allocator.shrink(offset, rng.randint(1, live[offset]))
                live[offset] = allocator.size_of(offset)
            else:
                allocator.free(offset)
                del live[offset]
        else:
            size = rng.choice([4096, 8192, 65536, MiB, 4 * MiB, rng.randint(1, 4 * MiB)])
            offset = allocator.allocate(size)
            if offset is not None:
                assert offset not in live
                live[offset] = allocator.size_of(offset)
                assert live[offset] >= size
    allocator.check()
    for offset in list(live):
        allocator.free(offset)
    allocator.check()
    assert allocator.used == 0


def test_rejects_bad_sizes() -> None:
    allocator = BuddyAllocator(4 * MiB, 4096, 4 * MiB)
    with pytest.raises(ValueError):
        allocator.allocate(0)
    with pytest.raises(ValueError):
        allocator.allocate(4 * MiB + 1)


def test_reserve_rebuilds_allocations_after_restart() -> None:
    before = BuddyAllocator(16 * MiB, 4096, 4 * MiB)
    blocks = [(before.allocate(size), size) for size in (4 * MiB, 8192, 1 * MiB, 4096, 3 * MiB)]
    after = BuddyAllocator(16 * MiB, 4096, 4 * MiB)
    for offset, size in reversed(blocks):
        assert after.reserve(offset, size)
    after.check()
    assert after.used == before.used
    assert not after.reserve(blocks[0][0], 4096)  # already taken
    assert not after.reserve(4096 + 1, 4096)  # misaligned
    assert not after.reserve(16 * MiB, 4096)  # out of range
    for offset, _ in blocks:
        after.free(offset)
    after.check()
    assert after.used == 0
