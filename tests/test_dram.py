"""The DRAM tier: chunked writes, holes, truncation, sealing, checksums, exhaustion."""

import os

import pytest
import xxhash

from kvfs.errors import NoSpace
from kvfs.store.dram import DramTier

MiB = 1 << 20
CHUNK = 1 * MiB


def tier(capacity: int = 8 * MiB) -> DramTier:
    return DramTier(capacity, chunk_size=CHUNK)


def test_write_read_across_chunks_is_exact() -> None:
    dram = tier()
    dram.create(1)
    data = os.urandom(3 * CHUNK + 123)
    dram.write(1, 0, data[: CHUNK + 7])
    dram.write(1, CHUNK + 7, data[CHUNK + 7 :])
    assert bytes(dram.read(1, 0, len(data))) == data
    assert bytes(dram.read(1, CHUNK - 10, 20)) == data[CHUNK - 10 : CHUNK + 10]


def test_read_within_a_chunk_is_zero_copy() -> None:
    dram = tier()
    dram.create(1)
    dram.write(1, 0, b"x" * CHUNK)
    assert isinstance(dram.read(1, 4096, 65536), memoryview)


def test_holes_read_as_zeros_even_over_reused_memory() -> None:
    dram = tier(CHUNK)
    dram.create(1)
    dram.write(1, 0, b"\xff" * CHUNK)
    dram.drop(1)
    dram.create(2)
    dram.write(2, 100, b"ab")  # reuses the block that held 0xff
    assert bytes(dram.read(2, 0, 102)) == bytes(100) + b"ab"
    dram.write(2, 500, b"cd")
    assert bytes(dram.read(2, 0, 502)) == bytes(100) + b"ab" + bytes(398) + b"cd"


def test_truncate_then_extend_exposes_zeros() -> None:
    dram = tier()
    dram.create(1)
    dram.write(1, 0, b"y" * 5000)
    dram.truncate(1, 1000)
    assert bytes(dram.read(1, 0, 5000)) == b"y" * 1000 + bytes(4000)


def test_seal_trims_tail_and_checksums_each_chunk() -> None:
    dram = tier()
    dram.create(1)
    data = os.urandom(CHUNK + 5000)
    dram.write(1, 0, data)
    used_before = dram.used
    checksums = dram.seal(1, len(data))
    assert checksums == [xxhash.xxh3_64_intdigest(data[:CHUNK]), xxhash.xxh3_64_intdigest(data[CHUNK:])]
    assert dram.used == used_before - CHUNK + 8192
    assert bytes(dram.read(1, 0, len(data))) == data
    dram.arena.allocator.check()


def test_seal_of_sparse_file_fills_zeros() -> None:
    dram = tier()
    dram.create(1)
    dram.write(1, CHUNK + 10, b"z")
    checksums = dram.seal(1, CHUNK + 11)
    assert checksums[0] == xxhash.xxh3_64_intdigest(bytes(CHUNK))
    assert bytes(dram.read(1, 0, CHUNK + 11)) == bytes(CHUNK + 10) + b"z"


def test_full_tier_raises_no_space_and_keeps_content() -> None:
    dram = tier(2 * CHUNK)
    dram.create(1)
    dram.write(1, 0, b"a" * CHUNK)
    dram.create(2)
    dram.write(2, 0, b"b" * CHUNK)
    with pytest.raises(NoSpace):
        dram.write(2, CHUNK, b"c")
    assert bytes(dram.read(2, 0, CHUNK)) == b"b" * CHUNK
    dram.drop(1)
    dram.write(2, CHUNK, b"c")
    assert bytes(dram.read(2, CHUNK - 1, 2)) == b"bc"


def test_copy_makes_an_independent_version() -> None:
    dram = tier()
    dram.create(1)
    dram.write(1, 0, b"old bytes")
    dram.seal(1, 9)
    dram.copy(1, 2, 9)
    dram.write(2, 0, b"new")
    assert bytes(dram.read(1, 0, 9)) == b"old bytes"
    assert bytes(dram.read(2, 0, 9)) == b"new bytes"
    dram.drop(1)
    dram.drop(2)
    assert dram.used == 0


def test_extending_an_empty_version_then_sealing_gives_zeros() -> None:
    dram = tier()
    dram.create(1)
    dram.truncate(1, CHUNK + 5)  # growing needs no storage
    assert dram.seal(1, CHUNK + 5) == [xxhash.xxh3_64_intdigest(bytes(CHUNK)), xxhash.xxh3_64_intdigest(bytes(5))]
    assert bytes(dram.read(1, 0, CHUNK + 5)) == bytes(CHUNK + 5)


def test_small_files_pack_together_and_leave_whole_chunks_for_writers() -> None:
    dram = tier(8 * MiB)  # 8 chunks
    for version in range(1, 201):  # far more small files than chunks
        dram.create(version)
        dram.write(version, 0, bytes([version % 256]) * (version * 37))
        dram.seal(version, version * 37)
    assert dram.used <= 8 * MiB - 2 * CHUNK  # they fit in a few chunks
    for version in range(1, 201):
        assert bytes(dram.read(version, 0, version * 37)) == bytes([version % 256]) * (version * 37)
    dram.create(999)
    dram.write(999, 0, b"x" * CHUNK)  # a writer still gets a whole chunk


def test_a_full_tier_of_small_files_takes_a_small_block_and_grows_it() -> None:
    """No whole chunk is free, yet one evicted small file makes room for the next one:
    a writer takes the block it needs and moves to a bigger one as the file grows."""
    dram = tier(2 * CHUNK)
    small = 64 << 10
    for version in range(1, 33):  # 32 files of 64 KiB fill both chunks exactly
        dram.create(version)
        dram.write(version, 0, bytes([version]) * small)
        dram.seal(version, small)
    assert dram.used == dram.capacity
    dram.create(100)
    with pytest.raises(NoSpace) as full:
        dram.write(100, 0, b"n" * small)
    assert full.value.needed == small  # what the caller must free: one small file, not a chunk
    dram.drop(7)
    dram.drop(20)  # two blocks free, not next to each other
    dram.write(100, 0, b"n" * 1000)  # a 64 KiB hole is enough
    dram.write(100, 1000, b"m" * (small - 1000))
    with pytest.raises(NoSpace):  # growing past 64 KiB needs a 128 KiB block: none is free
        dram.write(100, small, b"g")
    assert bytes(dram.read(100, 0, small)) == b"n" * 1000 + b"m" * (small - 1000)  # unchanged
    kept = {3, 12, 30}
    for version in set(range(1, 33)) - kept - {7, 20}:
        dram.drop(version)
    dram.write(100, small, b"g" * 100)  # now it moves to a bigger block, its bytes with it
    assert bytes(dram.read(100, 0, small + 100)) == b"n" * 1000 + b"m" * (small - 1000) + b"g" * 100
    dram.seal(100, small + 100)
    for version in kept:
        assert bytes(dram.read(version, 0, small)) == bytes([version]) * small
    dram.arena.allocator.check()


def test_faulting_in_behind_writers_changes_no_byte() -> None:
    """The mount serves while the arena faults in from a thread: bytes written meanwhile stay,
    and the progress reaches the whole tier."""
    import threading

    dram = DramTier(512 * MiB, chunk_size=CHUNK)
    stop, seen = threading.Event(), []
    seconds: list[float | None] = []
    thread = threading.Thread(target=lambda: seconds.append(
        dram.arena.populate(stop, lambda done, total: seen.append((done, total)))))
    thread.start()
    written = {}
    for version in range(1, 200):  # written while pages fault in, all over the arena
        data = os.urandom(CHUNK + version * 4096)
        dram.create(version)
        dram.write(version, 0, data)
        written[version] = data
    thread.join(timeout=120)
    assert not thread.is_alive() and seconds[0] is not None and seconds[0] >= 0
    assert seen[-1] == (dram.capacity, dram.capacity) and [done for done, _ in seen] == sorted(done for done, _ in seen)
    for version, data in written.items():
        assert bytes(dram.read(version, 0, len(data))) == data


def test_faulting_in_stops_when_asked() -> None:
    import threading

    dram = DramTier(256 * MiB, chunk_size=CHUNK)
    stop = threading.Event()
    stop.set()
    assert dram.arena.populate(stop) is None
