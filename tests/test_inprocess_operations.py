"""One node in process, from the FUSE handlers down: `KvfsOperations` called as the kernel
calls it (no mount) -> `Node` -> `TieredStore` over a real SSD tier in tmp_path, the master
embedded, under trio's MockClock. Every test ends with the harness's consistency check
(tests/inprocess.py): namespace against store, SSD index and DRAM accounting.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Awaitable

import pyfuse3
import pytest
import trio

from kvfs.cluster.master import MasterSettings
from kvfs.cluster.namespace import ROOT_INO
from kvfs.store.residency import State
from kvfs.store.tiered import TierSettings
from inprocess import engine_kind  # noqa: F401 (a fixture)
from inprocess import (CHUNK, DRAM, ROOT, Context, Fields, Member, content, fail_ssd_writes, lookup, read_file,
                       run_mount, until, version_of, write_file)


async def fails(errno_: int, request: Awaitable[object]) -> None:
    """Awaits a handler call that must fail with `errno_` (and not take the node down)."""
    with pytest.raises(pyfuse3.FUSEError) as failed:
        await request
    assert failed.value.errno == errno_, os.strerror(failed.value.errno)


def test_a_file_written_renamed_read_and_removed_through_the_handlers(tmp_path: Path, engine_kind: str) -> None:
    async def scenario(mount: Member) -> None:
        ops = mount.ops
        directory = (await ops.mkdir(ROOT_INO, b"layer0", 0o777, ROOT)).st_ino
        data = content(1, 3 * CHUNK + 100)
        ino = await write_file(mount, b"block.tmp", data, parent=directory, rename_to=b"block")
        assert await lookup(mount, b"block.tmp", directory) == 0  # a negative entry
        assert await lookup(mount, b"block", directory) == ino
        attr = await ops.getattr(ino, ROOT)
        assert (attr.st_size, stat.S_IMODE(attr.st_mode)) == (len(data), 0o644)  # umask 022 applied
        assert await read_file(mount, ino) == data
        await mount.store.wait_offloaded()
        assert mount.store.tier_of(await version_of(mount, ino)) == "dram+ssd"
        # Truncating through a handle-less setattr is a short write session: a new version.
        truncated = pyfuse3.EntryAttributes()
        truncated.st_size = CHUNK
        assert (await ops.setattr(ino, truncated, Fields(update_size=True), None, ROOT)).st_size == CHUNK
        assert await read_file(mount, ino) == data[:CHUNK]
        statfs = await ops.statfs(ROOT)
        assert statfs.f_files - statfs.f_ffree == 3  # the root, the directory, the file
        await ops.unlink(directory, b"block", ROOT)
        await ops.rmdir(ROOT_INO, b"layer0", ROOT)
        ops.forget([(ino, 2), (directory, 1)])  # the kernel drops what it looked up
        await until(lambda: not mount.ops.lookups.known(ino), within_s=1)
        assert list(mount.store.residency) == []

    run_mount(tmp_path, engine_kind, scenario)


def test_failures_answer_their_errno_and_the_node_keeps_serving(tmp_path: Path) -> None:
    async def scenario(mount: Member) -> None:
        ops = mount.ops
        ino = await write_file(mount, b"kept", content(2, CHUNK))
        await fails(errno.ENAMETOOLONG, ops.lookup(ROOT_INO, b"x" * 256, ROOT))
        await fails(errno.EEXIST, ops.create(ROOT_INO, b"kept", stat.S_IFREG | 0o644, os.O_CREAT | os.O_EXCL, ROOT))
        await fails(errno.ENOENT, ops.unlink(ROOT_INO, b"absent", ROOT))
        await fails(errno.EBADF, ops.read(9999, 0, CHUNK))
        await fails(errno.EPERM, ops.link(ino, ROOT_INO, b"hard", ROOT))
        await fails(errno.EINVAL, ops.rename(ROOT_INO, b"kept", ROOT_INO, b"other", pyfuse3.RENAME_EXCHANGE, ROOT))
        await ops.mkdir(ROOT_INO, b"dir", 0o755, ROOT)
        await write_file(mount, b"inside", b"x", parent=(await ops.lookup(ROOT_INO, b"dir", ROOT)).st_ino)
        await fails(errno.ENOTEMPTY, ops.rmdir(ROOT_INO, b"dir", ROOT))
        await fails(errno.EFBIG, write_file(mount, b"huge", b"y" * (DRAM + 1)))  # larger than the DRAM tier
        info = await ops.open(ino, os.O_RDONLY, ROOT)
        await fails(errno.EBADF, ops.write(info.fh, 0, b"z"))  # opened for reading
        await ops.release(info.fh)
        assert await read_file(mount, ino) == content(2, CHUNK)  # still serving
        counts = ops.operation_stats.counts
        assert counts[("lookup", "ENAMETOOLONG")] == 1 and counts[("rmdir", "ENOTEMPTY")] == 1
        await ops.unlink(ROOT_INO, b"huge", ROOT)  # (its writer closed it after the failed write)

    run_mount(tmp_path, "threads", scenario)


def test_a_full_ssd_evicts_the_oldest_files_whole_and_the_kernel_forgets_their_names(
        tmp_path: Path, engine_kind: str) -> None:
    async def scenario(mount: Member) -> None:
        inos = {}
        for index in range(12):  # 12 chunks (and their header pages) through an 8-chunk SSD
            name = f"f{index}".encode()
            inos[name] = await write_file(mount, name, content(index, CHUNK))
            assert await lookup(mount, name) == inos[name]  # the kernel holds a reference
            await mount.store.wait_offloaded()
        evicted = [name for name in inos if await lookup(mount, name) == 0]
        kept = [name for name in inos if name not in evicted]
        assert len(evicted) >= 4 and evicted == list(inos)[:len(evicted)]  # the oldest, whole
        assert mount.node.evicted_files == len(evicted)
        assert sorted(mount.kernel.invalidated_entries) == sorted((ROOT_INO, name) for name in evicted)
        for name in kept:
            assert mount.store.is_saved(await version_of(mount, inos[name]))
            assert await read_file(mount, inos[name]) == content(int(name[1:]), CHUNK)

    run_mount(tmp_path, engine_kind, scenario, disk=8 * CHUNK)


def test_a_dram_only_node_evicts_closed_files_and_refuses_when_everything_is_open(tmp_path: Path) -> None:
    async def scenario(mount: Member) -> None:
        ops = mount.ops
        for index in range(8):  # 8 half-tier files through a 16-chunk tier
            await write_file(mount, f"f{index}".encode(), content(index, 4 * CHUNK))
        assert mount.node.evicted_files == 4
        assert [await lookup(mount, f"f{index}".encode()) != 0 for index in range(8)] == [False] * 4 + [True] * 4
        # Every file left held open by a reader: nothing can be evicted, a new write fails.
        readers = [await ops.open(await lookup(mount, f"f{index}".encode()), os.O_RDONLY, ROOT)
                   for index in range(4, 8)]
        info, _ = await ops.create(ROOT_INO, b"more", stat.S_IFREG | 0o644, os.O_CREAT, ROOT)
        await fails(errno.ENOSPC, ops.write(info.fh, 0, b"x" * CHUNK))
        await ops.release(info.fh)
        for reader in readers:
            await ops.release(reader.fh)
        await write_file(mount, b"later", content(9, 4 * CHUNK))  # room again: f4 goes
        assert await lookup(mount, b"f4") == 0
        await ops.unlink(ROOT_INO, b"more", ROOT)

    run_mount(tmp_path, "threads", scenario, disk=0)


def test_watermark_offload_copies_the_oldest_files_once_past_the_high_watermark_and_tells_the_master(
        tmp_path: Path) -> None:
    async def scenario(mount: Member) -> None:
        inos = [await write_file(mount, f"f{index}".encode(), content(index, CHUNK)) for index in range(7)]
        await trio.sleep(60)  # 7 of 16 chunks, below the high watermark (0.5): nothing is copied
        assert [mount.store.tier_of(await version_of(mount, ino)) for ino in inos] == ["dram"] * 7
        inos += [await write_file(mount, f"f{index}".encode(), content(index, CHUNK)) for index in (7, 8)]
        await mount.store.wait_offloaded()
        # Past it: the oldest until DRAM-only bytes are down to the low watermark (0.25: 4 chunks),
        # each reported to the master (the final check compares its view with the store's).
        tiers = [mount.store.tier_of(await version_of(mount, ino)) for ino in inos]
        assert tiers == ["dram+ssd"] * 5 + ["dram"] * 4
        assert mount.store.residency.dram_only_bytes == 4 * CHUNK

    run_mount(tmp_path, "threads", scenario,
              TierSettings(offload="watermark", high_watermark=0.5, low_watermark=0.25, eviction_policy="lru"))


def test_backpressure_waits_its_timeout_in_virtual_time_then_the_write_gets_enospc(
        tmp_path: Path, engine_kind: str) -> None:
    async def scenario(mount: Member) -> None:
        ops, store = mount.ops, mount.store
        repair = fail_ssd_writes(store)
        for index in range(16):  # a DRAM tier full of files that cannot be copied to SSD
            await write_file(mount, f"f{index}".encode(), content(index, CHUNK))
        await until(lambda: store.faults.failing("offload"), within_s=1)
        info, _ = await ops.create(ROOT_INO, b"late", stat.S_IFREG | 0o644, os.O_CREAT, ROOT)
        started = trio.current_time()
        await fails(errno.ENOSPC, ops.write(info.fh, 0, b"x" * CHUNK))
        assert trio.current_time() - started >= store.settings.backpressure_timeout_s  # virtual seconds
        assert mount.node.evicted_files == 0  # no file whose only copy is in DRAM was evicted
        repair()
        store.retry_now()
        await store.wait_offloaded()
        assert await ops.write(info.fh, 0, b"x" * CHUNK) == CHUNK  # a saved copy can be demoted now
        await ops.release(info.fh)
        assert await read_file(mount, await lookup(mount, b"late")) == b"x" * CHUNK

    run_mount(tmp_path, engine_kind, scenario, TierSettings(backpressure_timeout_s=30.0))


def test_a_files_second_read_from_ssd_promotes_it(tmp_path: Path, engine_kind: str) -> None:
    async def scenario(mount: Member) -> None:
        data = content(3, 2 * CHUNK + 7)
        ino = await write_file(mount, b"block", data)
        await mount.store.wait_offloaded()
        assert mount.store.demote_all() == 1
        version = await version_of(mount, ino)
        assert await read_file(mount, ino) == data  # the first touch, from SSD
        assert mount.store.residency.state(version) is State.DEMOTED
        assert await read_file(mount, ino) == data  # the second: promoted into DRAM
        assert mount.store.residency.state(version) is State.ON_SSD
        assert mount.node.reader_opens["ssd"] == 1 and mount.node.reader_opens["dram"] == 1

    run_mount(tmp_path, engine_kind, scenario)


def test_a_users_open_files_are_capped_and_closing_them_frees_the_cap(tmp_path: Path) -> None:
    user = Context(uid=1000, gid=1000)

    async def scenario(mount: Member) -> None:
        ops = mount.ops
        first, _ = await ops.create(ROOT_INO, b"a", stat.S_IFREG | 0o644, os.O_CREAT, user)
        await ops.write(first.fh, 0, b"a" * 3 * CHUNK)
        second, _ = await ops.create(ROOT_INO, b"b", stat.S_IFREG | 0o644, os.O_CREAT, user)
        await fails(errno.EDQUOT, ops.write(second.fh, 0, b"b" * 2 * CHUNK))  # 5 chunks open: past 4
        await write_file(mount, b"root", b"r" * 2 * CHUNK)  # root is exempt
        await ops.release(first.fh)  # sealed: no longer counted
        assert await ops.write(second.fh, 0, b"b" * 2 * CHUNK) == 2 * CHUNK
        await ops.release(second.fh)

    run_mount(tmp_path, "threads", scenario, unsealed_per_user=4 * CHUNK)


def test_orphaned_temp_files_are_collected_after_their_grace(tmp_path: Path) -> None:
    async def scenario(mount: Member) -> None:
        await write_file(mount, b"dead-writer.tmp", content(4, CHUNK))
        await write_file(mount, b"published.tmp", content(5, CHUNK), rename_to=b"published")
        assert await mount.node.collect_orphans() == 0
        await trio.sleep(MasterSettings().temp_grace_s + 1)
        assert await mount.node.collect_orphans() == 1
        assert await lookup(mount, b"dead-writer.tmp") == 0 and await lookup(mount, b"published") != 0

    run_mount(tmp_path, "threads", scenario)
