"""The SSD tier through real mounts: offload, demotion, promotion, eviction, recovery, corruption."""

from __future__ import annotations

import errno
import json
import os
import random
import threading
import time
from pathlib import Path

import pytest
from conftest import drop_page_cache, is_stored

MiB = 1 << 20
SEGMENT_SIZE = 256 * MiB


def content(name: str, size: int) -> bytes:
    seed = name.encode().ljust(32, b".")[:32]
    return (seed * (size // 32 + 1))[:size]


def store(path: Path, size: int) -> None:
    tmp = path.with_name(path.name + f"_{random.getrandbits(32)}.tmp")
    tmp.write_bytes(content(path.name, size))
    os.rename(tmp, path)


def stats(root: Path) -> dict:
    return json.loads(os.getxattr(root, "user.kvfs.stats"))


def sync(root: Path) -> None:
    os.setxattr(root, "user.kvfs.control", b"sync")


def tier(path: Path) -> str:
    return os.getxattr(path, "user.kvfs.tier").decode()


def ssd_mount(make_mount, tmp_path: Path, dram: str = "64M", disk_size: str = "256M", *extra: str):
    return make_mount(dram, "--disk", str(tmp_path / "disk"), "--disk-size", disk_size, *extra)


def test_writing_four_times_dram_keeps_every_byte(make_mount, tmp_path: Path) -> None:
    mount = ssd_mount(make_mount, tmp_path, "64M", "512M")  # room for all 273 MiB
    root = mount.path
    sizes = [2 * MiB, 4 * MiB, 8 * MiB, 3 * MiB + 4096]
    names = [(root / f"b{i}.bin", sizes[i % 4]) for i in range(64)]  # 273 MiB
    failures: list[str] = []

    def writer(part: list) -> None:
        try:
            for path, size in part:
                store(path, size)
        except OSError as error:
            failures.append(repr(error))

    threads = [threading.Thread(target=writer, args=(names[i::4],)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures
    assert sum(size for _, size in names) >= 4 * 64 * MiB
    drop_page_cache()
    for path, size in names:
        assert path.read_bytes() == content(path.name, size), path
    counters = stats(root)
    assert counters["evicted_files"] == 0 and counters["demoted_files"] > 0
    assert counters["offloaded_files"] == len(names)
    assert counters["dram_used"] <= 64 * MiB


def test_tiers_promotion_and_stats(make_mount, tmp_path: Path) -> None:
    mount = ssd_mount(make_mount, tmp_path)
    root = mount.path
    path = root / "hot.bin"
    store(path, 6 * MiB)
    sync(root)
    assert tier(path) == "dram+ssd"
    os.setxattr(root, "user.kvfs.control", b"drop-dram")
    assert tier(path) == "ssd"
    drop_page_cache()
    assert path.read_bytes() == content("hot.bin", 6 * MiB)  # first touch: served from SSD
    assert tier(path) == "ssd"
    drop_page_cache()
    assert path.read_bytes() == content("hot.bin", 6 * MiB)  # second touch: promoted
    assert tier(path) == "dram+ssd"
    counters = stats(root)
    assert counters["promoted_files"] == 1 and counters["ssd_reads"] == 2
    assert len(os.getxattr(path, "user.kvfs.ssd_extents").decode().split(",")) == 2


def test_watermark_offload_waits_for_dram_pressure(make_mount, tmp_path: Path) -> None:
    mount = ssd_mount(make_mount, tmp_path, "64M", "256M", "--offload", "watermark",
                      "--high-watermark", "0.5", "--low-watermark", "0.25")
    root = mount.path
    store(root / "first.bin", 8 * MiB)
    sync(root)
    assert tier(root / "first.bin") == "dram"
    for i in range(5):  # 48 MiB: past the 32 MiB high watermark
        store(root / f"more{i}.bin", 8 * MiB)
    sync(root)
    assert tier(root / "first.bin") == "dram+ssd"  # the oldest went first
    assert stats(root)["offloaded_files"] >= 2


def test_ssd_full_evicts_whole_files(make_mount, tmp_path: Path) -> None:
    mount = ssd_mount(make_mount, tmp_path, "32M", "128M")
    root = mount.path
    paths = []
    for i in range(96):  # 384 MiB into a 128 MiB SSD tier
        path = root / f"f{i:03d}.bin"
        store(path, 4 * MiB)
        paths.append(path)
    sync(root)
    present = [p for p in paths if is_stored(p)]
    assert 0 < len(present) < len(paths)
    assert paths[-1] in present
    drop_page_cache()
    for path in present:
        assert path.read_bytes() == content(path.name, 4 * MiB)
    st = os.statvfs(root)
    assert st.f_blocks * st.f_frsize == 128 * MiB and st.f_bfree >= 0
    assert stats(root)["evicted_files"] > 0


def test_enospc_only_when_both_tiers_are_pinned(make_mount, tmp_path: Path) -> None:
    mount = ssd_mount(make_mount, tmp_path, "32M", "64M", "--backpressure-timeout", "2")
    mount.allowed_errors.append("nothing can be demoted or evicted")
    root = mount.path
    for i in range(15):  # 15 chunks and their extent headers fill the 16 blocks of 4 MiB
        store(root / f"p{i}.bin", 4 * MiB)
    sync(root)
    held = [open(root / f"p{i}.bin", "rb") for i in range(15)]  # open files are never evicted
    try:
        with pytest.raises(OSError) as raised:
            store(root / "extra.bin", 4 * MiB)
        assert raised.value.errno == errno.ENOSPC
        for i, handle in enumerate(held):
            assert handle.read() == content(f"p{i}.bin", 4 * MiB)
    finally:
        for handle in held:
            handle.close()
    store(root / "extra.bin", 4 * MiB)
    assert (root / "extra.bin").read_bytes() == content("extra.bin", 4 * MiB)


def test_restart_recovers_names_attributes_and_renames(make_mount, tmp_path: Path) -> None:
    mount = ssd_mount(make_mount, tmp_path)
    root = mount.path
    (root / "m_r0" / "abc").mkdir(parents=True)
    moved = root / "m_r0" / "abc" / "late.bin.tmp"
    moved.write_bytes(content("late", 5 * MiB))
    sync(root)  # on SSD under its temp name...
    os.rename(moved, root / "m_r0" / "abc" / "late.bin")  # ...then published
    os.setxattr(root / "m_r0" / "abc" / "late.bin", "user.vllm_kv_crc32", b"1234")
    os.chmod(root / "m_r0" / "abc" / "late.bin", 0o640)
    os.rename(root / "m_r0", root / "model_r0")  # a directory rename moves recorded paths too
    (root / "orphan.bin_77.tmp").write_bytes(b"never published")
    store(root / "replaced.bin", 2 * MiB)
    sync(root)
    (root / "replaced.bin.tmp").write_bytes(content("new", 3 * MiB))
    os.rename(root / "replaced.bin.tmp", root / "replaced.bin")
    mount.stop()
    mount.start()
    late = root / "model_r0" / "abc" / "late.bin"
    assert late.read_bytes() == content("late", 5 * MiB)
    assert os.getxattr(late, "user.vllm_kv_crc32") == b"1234"
    assert late.stat().st_mode & 0o777 == 0o640
    assert (root / "replaced.bin").read_bytes() == content("new", 3 * MiB)
    assert sorted(os.listdir(root)) == ["model_r0", "replaced.bin"]
    assert "recovered 2 files" in mount.log_text()


def test_clean_restart_with_ten_thousand_files(make_mount, tmp_path: Path) -> None:
    mount = ssd_mount(make_mount, tmp_path, "256M", "256M", "--log-level", "info")
    root = mount.path
    for d in range(10):
        (root / f"d{d}").mkdir()
        for i in range(1000):
            (root / f"d{d}" / f"k{i}.bin").write_bytes(content(f"k{d}-{i}", 4096))
    mount.stop()
    mount.start()
    assert sum(len(os.listdir(root / f"d{d}")) for d in range(10)) == 10_000
    for d, i in [(0, 0), (3, 517), (9, 999)]:
        assert (root / f"d{d}" / f"k{i}.bin").read_bytes() == content(f"k{d}-{i}", 4096)
    line = [l for l in mount.log_text().splitlines() if "recovered 10000 files" in l]
    assert line and " in " in line[-1]


def test_corrupt_chunks_are_never_served(make_mount, tmp_path: Path) -> None:
    mount = ssd_mount(make_mount, tmp_path)
    root = mount.path
    for name in ("a.bin", "b.bin", "c.bin"):
        store(root / name, 8 * MiB)
    sync(root)
    # b.bin: its second chunk; c.bin: its first chunk.
    targets = {name: int(os.getxattr(root / name, "user.kvfs.ssd_extents").decode().split(",")[chunk].split("+")[0])
               for name, chunk in (("b.bin", 1), ("c.bin", 0))}
    mount.stop()
    for offset in targets.values():
        segment = tmp_path / "disk" / "segments" / f"segment-{offset // SEGMENT_SIZE:05d}.dat"
        with open(segment, "r+b") as f:
            f.seek(offset % SEGMENT_SIZE + 1000)
            f.write(b"\xde\xad\xbe\xef")
    mount.start()
    mount.allowed_errors.append("failed its checksum on disk")
    with pytest.raises(OSError) as raised:  # verified before the open returns
        open(root / "c.bin", "rb")
    assert raised.value.errno == errno.EIO
    with open(root / "b.bin", "rb") as f:  # the first chunk is good: served; the second is not
        assert f.read(4 * MiB) == content("b.bin", 8 * MiB)[: 4 * MiB]
        with pytest.raises(OSError) as raised:
            f.read()
        assert raised.value.errno == errno.EIO
    for name in ("b.bin", "c.bin"):  # both quarantined: absent from now on
        with pytest.raises(FileNotFoundError):
            open(root / name, "rb")
    assert (root / "a.bin").read_bytes() == content("a.bin", 8 * MiB)
    assert sorted(os.listdir(root)) == ["a.bin"]
    counters = stats(root)
    assert counters["checksum_failures"] == 2 and counters["quarantined_files"] == 2
    quarantined = [line for line in mount.log_text().splitlines() if "quarantined" in line]
    assert len(quarantined) == 2 and " ERROR " in quarantined[0], quarantined  # once per file, with its path
    assert sorted(line.split(" kvfs.store.tiered: ")[1].split(":")[0] for line in quarantined) == ["/b.bin", "/c.bin"]
    # Quarantined for good: their records and extents are gone, so a restart never lists them again.
    mount.stop()
    mount.start()
    assert sorted(os.listdir(root)) == ["a.bin"]
    for name in ("b.bin", "c.bin"):
        assert not os.path.lexists(root / name)
    assert "recovered 1 files" in mount.log_text()
    assert stats(root)["ssd_used"] == 8 * MiB + 4096  # a.bin: two chunks and its extent header; the others freed
    assert (root / "a.bin").read_bytes() == content("a.bin", 8 * MiB)
    mount.stop()
    mount.start()
    assert sorted(os.listdir(root)) == ["a.bin"] and stats(root)["checksum_failures"] == 0


@pytest.mark.parametrize("kill_after_acknowledged", [1, 10, 40])
def test_kill_9_during_writes_loses_no_acknowledged_file(make_mount, tmp_path: Path,
                                                          kill_after_acknowledged: int) -> None:
    mount = ssd_mount(make_mount, tmp_path, "64M", "2G")
    root = mount.path
    published: list[tuple[Path, int]] = []
    acknowledged: list[tuple[Path, int]] = []
    stop = threading.Event()
    lock = threading.Lock()

    def writer(worker: int) -> None:
        rng = random.Random(worker)
        for i in range(200):
            if stop.is_set():
                return
            path, size = root / f"w{worker}-{i}.bin", rng.choice([MiB, 2 * MiB, 4 * MiB])
            try:
                store(path, size)
            except OSError:
                return  # the daemon died under us
            with lock:
                published.append((path, size))

    def acknowledger() -> None:  # a file is acknowledged once kvfs reports it on SSD
        while not stop.is_set():
            with lock:
                candidates = [item for item in published if item not in acknowledged]
            for path, size in candidates:
                try:
                    if "ssd" in tier(path):
                        acknowledged.append((path, size))
                except OSError:
                    pass
            time.sleep(0.02)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(16)] + [threading.Thread(target=acknowledger)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60  # kill points: once this many files are safe on SSD, writers still busy
    while len(acknowledged) < kill_after_acknowledged and time.monotonic() < deadline:
        time.sleep(0.005)
    mount.kill()
    stop.set()
    for thread in threads:
        thread.join()
    mount.start()
    names = os.listdir(root)
    assert not [n for n in names if n.endswith(".tmp")]
    for path, size in acknowledged:
        assert path.read_bytes() == content(path.name, size), f"acknowledged {path.name} lost or wrong"
    for name in names:  # whatever else survived is whole
        data = (root / name).read_bytes()
        assert data == content(name, len(data)) and len(data) in (MiB, 2 * MiB, 4 * MiB)
    assert len(acknowledged) >= kill_after_acknowledged
