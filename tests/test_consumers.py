"""The access patterns of real KV-cache consumers (../shared/CONSUMERS.md), through a mount."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import mmap
import os
import random
import threading
from pathlib import Path

import pytest
from conftest import is_stored, run_writers_then_readers

libc = ctypes.CDLL(None, use_errno=True)
MiB = 1 << 20


def key_path(root: Path, key: int, group: int = 0) -> Path:
    digest = hashlib.sha256(str(key).encode()).hexdigest()
    return root / "llama_0123456789ab_r0" / digest[:3] / f"{digest[3:5]}_g{group}" / f"{digest}.bin"


def fill(buffer: mmap.mmap, base: bytes, key: int) -> None:
    """Distinct content per key: a shared random base with the key stamped every MiB."""
    buffer[:] = base
    stamp = key.to_bytes(8, "little")
    for offset in range(0, len(buffer), MiB):
        buffer[offset : offset + 8] = stamp


def vllm_store(path: Path, buffer: mmap.mmap, direct: bool) -> bool:
    """vLLM's fs-tier store of one chunk (0.29-0.33). Returns False when it skipped an existing file."""
    if os.access(path, os.F_OK):
        return False
    parent = path.parent
    for level in reversed([parent, parent.parent, parent.parent.parent]):
        try:
            os.stat(level)
        except FileNotFoundError:
            try:
                os.mkdir(level, 0o777)
            except FileExistsError:
                pass
    tmp = Path(f"{path}_{random.getrandbits(63)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(tmp, flags, 0o644)
    try:
        written = os.write(fd, buffer)
        assert written == len(buffer), f"short write {written}"
    finally:
        os.close(fd)
    try:
        rename_noreplace(tmp, path)
    except FileExistsError:
        os.unlink(tmp)  # another writer published the same key first: success
    return True


def rename_noreplace(old: Path, new: Path) -> None:
    if libc.renameat2(-100, bytes(old), -100, bytes(new), 1) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(new))


def vllm_load(path: Path, buffer: mmap.mmap, direct: bool) -> int:
    """vLLM's load: open, ONE read of the chunk size, close. Returns the byte count."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
    try:
        return os.readv(fd, [buffer])
    finally:
        os.close(fd)


def run_vllm_pattern(write_root: Path, read_root: Path, size: int, keys: list[int], workers: int,
                     direct: bool) -> tuple[bytes, list[int]]:
    """vLLM's fs tier under load: `workers` writers store `keys` (distinct content each) into
    write_root while as many readers load published keys from read_root, and look up keys that
    were never stored. Every load is whole and byte-exact or a clean miss (ENOENT: evicted, or
    not visible yet on another node). Returns the shared content base and the published keys."""
    base = os.urandom(size)
    published: list[int] = []
    lock = threading.Lock()
    failures: list[str] = []
    loaded = [0]
    done = threading.Event()

    def writer(worker: int) -> None:
        buffer = mmap.mmap(-1, size)
        try:
            for key in keys[worker::workers]:
                fill(buffer, base, key)
                vllm_store(key_path(write_root, key), buffer, direct)
                with lock:
                    published.append(key)
        except Exception as error:  # reported below, with the key
            failures.append(f"writer {worker}: {error!r}")

    def reader(worker: int) -> None:
        rng = random.Random(worker)
        buffer, expected = mmap.mmap(-1, size), mmap.mmap(-1, size)
        try:
            while True:
                finished = done.is_set()  # one more load after the writers are done
                with lock:
                    key = rng.choice(published) if published else None
                if os.access(key_path(read_root, rng.randrange(10**6, 10**7)), os.F_OK):
                    failures.append("a key that was never stored exists")
                if key is not None:
                    try:
                        count = vllm_load(key_path(read_root, key), buffer, direct)
                    except FileNotFoundError:
                        count = -1  # a miss, as vLLM expects
                    if count >= 0:
                        fill(expected, base, key)
                        if count != size:
                            failures.append(f"short read of key {key}: {count} of {size}")
                        elif buffer[:] != expected[:]:
                            failures.append(f"wrong bytes for key {key}")
                        else:
                            loaded[0] += 1
                if finished:
                    break
        except Exception as error:
            failures.append(f"reader {worker}: {error!r}")

    run_writers_then_readers([functools.partial(writer, i) for i in range(workers)],
                             [functools.partial(reader, i) for i in range(workers)], done)
    assert not failures, failures[:10]
    assert loaded[0] > 0
    return base, published


@pytest.mark.parametrize("direct", [True, False], ids=["c-path-o_direct", "python-path-buffered"])
@pytest.mark.parametrize("tiers, size", [("dram", 2 * MiB), ("dram", 32 * MiB), ("dram", 64 * MiB),
                                         ("dram+ssd", 2 * MiB), ("dram+ssd", 32 * MiB)],
                         ids=["dram-2MiB", "dram-32MiB", "dram-64MiB", "ssd-2MiB", "ssd-32MiB"])
def test_vllm_fs_tier_16_writers_16_readers(make_mount, tmp_path: Path, size: int, direct: bool, tiers: str) -> None:
    # Room for every writer's and reader's file at once plus a few sealed ones: the
    # DRAM tier cannot evict files that are being written or read, so a smaller
    # tier would rightly answer ENOSPC. 48 files overflow it, so eviction runs.
    # With an SSD tier, 36 files fit on SSD and DRAM holds what is in flight.
    dram = 36 * size
    if tiers == "dram":
        mount = make_mount(f"{dram // MiB}M")
    else:
        mount = make_mount(f"{34 * size // MiB}M", "--disk", str(tmp_path / "disk"),
                           "--disk-size", f"{dram // MiB}M")
    root = mount.path
    keys = list(range(48))
    _, published = run_vllm_pattern(root, root, size, keys, workers=16, direct=direct)
    # Capacity was managed: some keys were evicted (cleanly absent), the newest one
    # is there, and the mount is not over-full.
    present = [key for key in keys if is_stored(key_path(root, key))]
    assert 0 < len(present) < len(keys)
    buffer = mmap.mmap(-1, size)
    assert vllm_load(key_path(root, published[-1]), buffer, direct) == size
    st = os.statvfs(root)
    assert st.f_bfree >= 0 and (st.f_blocks - st.f_bfree) * 4096 <= dram


def test_vllm_startup_probe_and_config(kvfs_dir: Path) -> None:
    model_dir = kvfs_dir / "llama_0123456789ab"
    model_dir.mkdir()
    probe = model_dir / f".o_direct_probe_{random.getrandbits(32)}.tmp"
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    page = mmap.mmap(-1, 4096)
    assert os.write(fd, page) == 4096
    os.close(fd)
    os.unlink(probe)
    config = model_dir / "config.json"
    if not config.exists():
        config.write_text('{"block_size": 16}')
    assert config.read_text() == '{"block_size": 16}'
    assert os.listdir(model_dir) == ["config.json"]


def test_lookups_of_absent_keys_are_misses(kvfs_dir: Path) -> None:
    for key in range(2048):
        assert not os.access(key_path(kvfs_dir, key), os.F_OK)
    for key in range(2048):  # the vLLM lookup thread repeats them every scheduler step
        assert not os.access(key_path(kvfs_dir, key), os.F_OK)


def test_rename_eexist_counts_as_stored(kvfs_dir: Path) -> None:
    path = key_path(kvfs_dir, 7)
    first, second = mmap.mmap(-1, 2 * MiB), mmap.mmap(-1, 2 * MiB)
    first.write(b"1" * 2 * MiB)
    second.write(b"2" * 2 * MiB)
    assert vllm_store(path, first, direct=True)
    # A second writer that raced past access() publishes the same name: EEXIST, tmp removed.
    tmp = Path(f"{path}_99.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    os.write(fd, second)
    os.close(fd)
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp, path)
    os.unlink(tmp)
    assert path.read_bytes() == b"1" * 2 * MiB
    assert sorted(os.listdir(path.parent)) == [path.name]


def test_file_evicted_between_lookup_and_load(make_mount) -> None:
    mount = make_mount("64M", "--eviction-policy", "lru")  # so that the victim is the oldest file
    root = mount.path
    victim = key_path(root, 0)
    buffer = mmap.mmap(-1, 8 * MiB)
    vllm_store(victim, buffer, direct=True)
    assert os.access(victim, os.F_OK)  # the kernel now caches the entry
    fd = os.open(victim, os.O_RDONLY)  # and the inode
    os.close(fd)
    for key in range(1, 12):  # 88 MiB into a 64 MiB tier evicts the oldest file
        vllm_store(key_path(root, key), buffer, direct=True)
    with pytest.raises(FileNotFoundError):
        vllm_load(victim, buffer, direct=True)
    assert vllm_load(key_path(root, 11), buffer, direct=True) == 8 * MiB


def test_llmd_standalone_backend_pattern(kvfs_dir: Path) -> None:
    path = kvfs_dir / "chunk.bin"
    data = os.urandom(5 * MiB + 4096)
    try:  # existence check by opening for read
        open(path, "rb").close()
        exists = True
    except FileNotFoundError:
        exists = False
    assert not exists
    tmp = kvfs_dir / "chunk.bin.tmp"
    with open(tmp, "wb") as f:
        for offset in range(0, len(data), MiB):
            f.write(data[offset : offset + MiB])
    os.rename(tmp, path)
    os.utime(path)  # refreshes atime on a hit
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        assert size == len(data) and f.read(size) == data


def test_lmcache_disk_and_fs_connector_patterns(kvfs_dir: Path) -> None:
    block = os.statvfs(kvfs_dir).f_bsize
    assert block == 4096
    data = os.urandom(3 * MiB)
    pt = kvfs_dir / "llama@1@0@abc123@bfloat16.pt"
    fd = os.open(pt, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)  # O_DIRECT without O_TRUNC
    aligned = mmap.mmap(-1, len(data))
    aligned.write(data)
    os.write(fd, aligned)
    os.close(fd)
    with open(pt, "rb") as f:
        target = bytearray(len(data))
        f.readinto(target)
    assert target == data
    os.remove(pt)
    for round_ in range(3):  # fs connector: a shared <name>.tmp, then replace
        tmp = kvfs_dir / "key.data.tmp"
        tmp.write_bytes(bytes([round_]) * 28 + data[:MiB])
        os.replace(tmp, kvfs_dir / "key.data")
    assert (kvfs_dir / "key.data").read_bytes()[:28] == bytes([2]) * 28
    assert [p.name for p in kvfs_dir.glob("*.data")] == ["key.data"]
