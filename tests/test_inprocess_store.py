"""The tiered store in process: a real DRAM tier and a real SSD tier (segment files, lmdb index,
the threads or io_uring engine) in tmp_path, driven under trio's MockClock, so that what takes
seconds of real time in a mount (backpressure, retry delays, watermarks) runs at once.

The store's owner is either a small namespace of files that answers the store's questions
(what a version is called, which files to evict), or, one level up, the node's file service
with the master embedded. Each test ends with an audit of the store's books against both
tiers and the index (and, for the node, with the in-process harness's consistency check of
the namespace against the store: tests/inprocess.py).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Awaitable, Callable

import pytest
import trio

from kvfs.cluster.embedded import EmbeddedMaster
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.disk.records import DiskFile, DiskRecord
from kvfs.disk.tier import SsdTier
from kvfs.errors import StorageError
from kvfs.node.service import Node
from kvfs.policy import make_policy
from kvfs.store.audit import audit
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.dram import DramTier
from kvfs.store.residency import RETRY_MIN_S, State
from kvfs.store.tiered import TieredStore, TierSettings
from inprocess import engine_kind  # noqa: F401 (a fixture)
from inprocess import (CHUNK, DISK, DRAM, TrioClock, build_member, check_consistency, content, fail_ssd_writes,
                       make_engine, quiesce, run_virtual, until)


class Files:
    """The store's owner: file names, and whole-file eviction oldest first (what the master decides)."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.names: dict[int, bytes] = {}  # sealed versions that are files
        self.open: set[int] = set()  # versions the master would not evict
        self.offloaded_versions: list[int] = []
        self.lost_versions: list[int] = []
        self.evicted: list[int] = []

    async def reclaim(self, tier: str, nbytes: int) -> bool:
        for version in list(self.names):
            if version in self.open or (tier == "disk" and not self.store.on_disk(version)):
                continue
            self.remove(version)
            self.evicted.append(version)
            return True
        return False

    async def describe(self, version: int) -> DiskRecord | None:
        name = self.names.get(version)
        if name is None:
            return None
        size = self.store.residency.entry(version).size  # type: ignore[union-attr]
        return DiskRecord(version, DiskFile([name], size, 0o100644, 0, 0, 0, {}), [])

    async def offloaded(self, versions: list[int]) -> None:
        self.offloaded_versions += versions

    async def lost(self, version: int) -> None:
        self.lost_versions.append(version)
        self.remove(version)

    def remove(self, version: int) -> None:
        del self.names[version]
        self.store.drop(version)


async def put(store: TieredStore, files: Files, version: int, size: int) -> None:
    """Writes and seals a file the way the node does."""
    store.create(version)
    data = content(version, size)
    for start in range(0, size, CHUNK):
        await store.write(version, start, data[start:start + CHUNK])
    files.names[version] = f"f{version}".encode()
    store.seal(version, size)


async def read_all(store: TieredStore, version: int, size: int) -> tuple[bytes, str]:
    source = await store.open_read(version)
    try:
        return bytes(await store.read(source, 0, size)), source.tier
    finally:
        store.close_read(source)


Scenario = Callable[[TieredStore, Files], Awaitable[None]]


def run_store(tmp_path: Path, engine_kind: str, scenario: Scenario, settings: TierSettings = TierSettings(),
              dram: int = DRAM, disk: int = DISK) -> None:
    """Runs `scenario` against a store with both tiers under a MockClock, then audits it."""

    async def main() -> None:
        engine = make_engine(engine_kind)
        ssd = SsdTier(tmp_path / "disk", disk, engine, CHUNK, direct_io=True)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                store = TieredStore(DramTier(dram, CHUNK), ssd, settings, ReadBufferPool(8, CHUNK),
                                    clock=trio.current_time)
                files = Files(store)
                store.owner = files
                nursery.start_soon(store.run)
                await scenario(store, files)
                await store.wait_offloaded()
                await store.flush_removals_now()
                assert audit(store) == []
                nursery.cancel_scope.cancel()
        finally:
            ssd.close()
            engine.close()

    run_virtual(main)


def test_eager_offload_then_demotion_then_promotion_on_the_second_touch(tmp_path: Path, engine_kind: str) -> None:
    async def scenario(store: TieredStore, files: Files) -> None:
        sizes = {1: 3 * CHUNK + 100, 2: CHUNK, 3: 5000}
        for version, size in sizes.items():
            await put(store, files, version, size)
        await store.wait_offloaded()
        assert sorted(files.offloaded_versions) == [1, 2, 3]
        assert all(store.tier_of(v) == "dram+ssd" for v in sizes)
        assert store.residency.dram_only_bytes == 0 and store.unsaved() == (0, 0)
        assert store.demote_all() == 3
        assert store.dram.used == 0 and store.residency.state(1) is State.DEMOTED
        data, tier = await read_all(store, 1, sizes[1])  # first touch: served from SSD
        assert data == content(1, sizes[1]) and tier == "ssd"
        assert store.residency.state(1) is State.DEMOTED
        data, tier = await read_all(store, 1, sizes[1])  # second touch: promoted into DRAM
        assert data == content(1, sizes[1]) and tier == "dram"
        assert store.residency.state(1) is State.ON_SSD and store.stats.promoted_files == 1
        assert store.stats.ssd_reads == 2

    run_store(tmp_path, engine_kind, scenario)


def test_watermark_offload_waits_for_the_high_watermark_and_copies_down_to_the_low(
        tmp_path: Path, engine_kind: str) -> None:
    async def scenario(store: TieredStore, files: Files) -> None:
        for version in range(1, 8):  # 7 of 16 chunks: below the high watermark (0.5)
            await put(store, files, version, CHUNK)
        await trio.sleep(10)
        assert files.offloaded_versions == [] and store.offload_backlog() == (0, 0)
        await put(store, files, 8, CHUNK)
        await put(store, files, 9, CHUNK)  # 9 of 16: past it
        await store.wait_offloaded()
        # The oldest first, until DRAM-only bytes are down to the low watermark (0.25: 4 chunks).
        assert files.offloaded_versions == [1, 2, 3, 4, 5]
        assert store.residency.dram_only_bytes == 4 * CHUNK
        assert [store.residency.state(v) for v in (1, 9)] == [State.ON_SSD, State.DRAM_ONLY]

    settings = TierSettings(offload="watermark", high_watermark=0.5, low_watermark=0.25, eviction_policy="lru")
    run_store(tmp_path, engine_kind, scenario, settings)


def test_a_full_dram_demotes_copies_saved_on_ssd_and_writers_never_fail(tmp_path: Path, engine_kind: str) -> None:
    async def scenario(store: TieredStore, files: Files) -> None:
        for version in range(1, 41):  # 40 chunks through a 16-chunk DRAM tier
            await put(store, files, version, CHUNK)
        await store.wait_offloaded()
        assert files.evicted == [] and store.stats.demoted_files >= 40 - 16
        for version in range(1, 41):
            data, _ = await read_all(store, version, CHUNK)
            assert data == content(version, CHUNK)

    run_store(tmp_path, engine_kind, scenario)


def test_a_failing_ssd_parks_files_retries_with_a_growing_delay_and_resumes(tmp_path: Path, engine_kind: str) -> None:
    async def scenario(store: TieredStore, files: Files) -> None:
        repair = fail_ssd_writes(store)
        await put(store, files, 1, 2 * CHUNK)
        await put(store, files, 2, CHUNK)
        await until(lambda: store.offload_failed() == (2, 3 * CHUNK), within_s=1)
        failed_at = trio.current_time()
        assert store.faults.failing("offload") and store.residency.state(1) is State.PARKED
        assert store.tier_of(1) == "dram" and store.unsaved() == (2, 3 * CHUNK)
        # Retries after 0.25, 0.5, 1, 2, 4, 5, 5 s: seven attempts in the next 20 s, not one per file or tick.
        await trio.sleep(20)
        attempts = store.faults.counts[("offload", "EBADF")]
        assert 6 <= attempts <= 9, attempts
        repair()
        await until(lambda: store.offload_failed() == (0, 0), within_s=5.5)  # the longest delay
        assert trio.current_time() - failed_at >= RETRY_MIN_S
        assert not store.faults.failing("offload") and sorted(files.offloaded_versions) == [1, 2]
        assert store.tier_of(1) == "dram+ssd"

    run_store(tmp_path, engine_kind, scenario)


def test_backpressure_waits_its_timeout_then_fails_with_enospc(tmp_path: Path, engine_kind: str) -> None:
    async def scenario(store: TieredStore, files: Files) -> None:
        repair = fail_ssd_writes(store)
        for version in range(1, 17):  # DRAM full of files that cannot be copied
            await put(store, files, version, CHUNK)
        await until(lambda: store.faults.failing("offload"), within_s=1)
        started = trio.current_time()
        store.create(17)
        with pytest.raises(StorageError) as refused:
            await store.write(17, 0, b"x" * CHUNK)
        waited = trio.current_time() - started
        assert refused.value.errno == errno.ENOSPC and "cannot be copied to SSD" in str(refused.value)
        assert waited >= store.settings.backpressure_timeout_s  # (virtual seconds)
        assert files.evicted == [] and len(files.names) == 16  # no DRAM-only file was evicted
        assert store.stats.backpressure_waits >= 1
        repair()
        store.retry_now()
        await store.wait_offloaded()
        await store.write(17, 0, b"x" * CHUNK)  # room again: a copy on SSD can be demoted
        files.names[17] = b"f17"
        store.seal(17, CHUNK)

    run_store(tmp_path, engine_kind, scenario, TierSettings(backpressure_timeout_s=30.0))


def test_a_full_ssd_evicts_whole_files_it_holds(tmp_path: Path, engine_kind: str) -> None:
    async def scenario(store: TieredStore, files: Files) -> None:
        for version in range(1, 13):  # 12 chunks (and their header pages) through an 8-chunk SSD
            await put(store, files, version, CHUNK)
            await store.wait_offloaded()
        # The oldest files made room, whole; every file left is saved on SSD.
        assert files.evicted == list(range(1, len(files.evicted) + 1)) and len(files.evicted) >= 12 - 8
        assert sorted(files.names) == list(range(len(files.evicted) + 1, 13))
        assert all(store.is_saved(v) for v in files.names) and store.unsaved() == (0, 0)

    run_store(tmp_path, engine_kind, scenario, disk=8 * CHUNK)


def test_a_corrupt_chunk_quarantines_its_file(tmp_path: Path, engine_kind: str) -> None:
    async def scenario(store: TieredStore, files: Files) -> None:
        await put(store, files, 1, 2 * CHUNK)
        await store.wait_offloaded()
        store.demote_all()
        assert store.ssd is not None
        extent = store.ssd.extents[1][1]
        segment = os.open(store.ssd.directory / "segments" / "segment-00000.dat", os.O_WRONLY)
        try:  # (one segment: a tier offset is a position in it)
            os.pwrite(segment, b"\xff" * 4096, extent.offset)
            os.fsync(segment)
        finally:
            os.close(segment)
        source = await store.open_read(1)  # chunk 0 is whole: the open succeeds
        with pytest.raises(StorageError) as failed:
            await store.read(source, CHUNK, CHUNK)
        store.close_read(source)
        assert failed.value.errno == errno.EIO
        assert files.lost_versions == [1] and store.stats.quarantined_files == 1
        # Its SSD copy goes once the stream reading it has ended (the offloader's reaper).
        await until(lambda: not store.on_disk(1), within_s=1)
        assert 1 not in store.residency and store.residency.removals() == []

    run_store(tmp_path, engine_kind, scenario)


# One level up: the node's file service over the store, the master embedded -----------------------


NodeScenario = Callable[[Node, TieredStore], Awaitable[None]]


def run_node(tmp_path: Path, engine_kind: str, scenario: NodeScenario) -> None:
    """Runs `scenario` against a node service (master embedded) over a store with both tiers,
    under a MockClock; ends with the harness's consistency check (namespace, store, index, audit)."""
    async def main() -> None:
        engine = make_engine(engine_kind)
        ssd = SsdTier(tmp_path / "disk", DISK, engine, CHUNK, direct_io=True)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                store = TieredStore(DramTier(DRAM, CHUNK), ssd, TierSettings(), ReadBufferPool(8, CHUNK),
                                    clock=trio.current_time)
                service = MetadataService(TrioClock(), make_policy("reuse"), MasterSettings())
                member = build_member("local", EmbeddedMaster(service), store, tmp_path / "mnt")
                nursery.start_soon(store.run)
                await scenario(member.node, store)
                await quiesce([member])
                assert store.unsaved() == (0, 0)  # eager offload: every file is saved by now
                check_consistency(service, [member])
                nursery.cancel_scope.cancel()
        finally:
            ssd.close()
            engine.close()

    run_virtual(main)


async def node_write(node: Node, name: bytes, data: bytes) -> int:
    handle, _ = await node.create(ROOT_INO, name, stat.S_IFREG | 0o644, 0, 0, True)
    for start in range(0, len(data), CHUNK):
        await node.write(handle, start, data[start:start + CHUNK])
    await node.release(handle)
    return handle.ino


async def node_read(node: Node, ino: int, size: int) -> tuple[bytes, str]:
    handle, _ = await node.open(ino, os.O_RDONLY)
    try:
        assert handle.source is not None
        return bytes(await node.read(handle, 0, size)), handle.source.tier
    finally:
        await node.release(handle)


def test_a_published_file_is_saved_under_its_final_name_and_promoted_on_its_second_read(
        tmp_path: Path, engine_kind: str) -> None:
    async def scenario(node: Node, store: TieredStore) -> None:
        data = content(7, 3 * CHUNK + 10)
        ino = await node_write(node, b"block.tmp", data)
        await node.rename(ROOT_INO, b"block.tmp", ROOT_INO, b"block", False)  # published, maybe mid-offload
        await store.wait_offloaded()
        assert store.demote_all() == 1
        assert await node_read(node, ino, len(data)) == (data, "ssd")
        assert await node_read(node, ino, len(data)) == (data, "dram")  # the second touch promoted it
        assert store.stats.promoted_files == 1
        gone = await node_write(node, b"gone", content(8, CHUNK))
        await node.unlink(ROOT_INO, b"gone")  # its DRAM and SSD copies go
        await node.forget([gone])
        await store.wait_offloaded()

    run_node(tmp_path, engine_kind, scenario)


def test_files_written_past_dram_through_the_node_are_all_kept(tmp_path: Path, engine_kind: str) -> None:
    async def scenario(node: Node, store: TieredStore) -> None:
        inos = {}
        for index in range(40):  # 40 chunks through a 16-chunk DRAM tier
            name = f"f{index}".encode()
            inos[name] = await node_write(node, name, content(index, CHUNK))
        await store.wait_offloaded()
        assert node.evicted_files == 0 and store.stats.demoted_files >= 40 - 16
        for index, (name, ino) in enumerate(inos.items()):
            data, _ = await node_read(node, ino, CHUNK)
            assert data == content(index, CHUNK), name

    run_node(tmp_path, engine_kind, scenario)
