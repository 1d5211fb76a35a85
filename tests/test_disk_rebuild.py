"""The SSD tier rebuilt from its own data: extent headers, a damaged index found at mount
and rebuilt from the segments, damaged extents skipped by name, `kvfs fsck`."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import lmdb
import msgspec
import pytest
from conftest import drop_page_cache

from kvfs.disk.header import HeaderError, decode_header, encode_header, magic_pages
from kvfs.disk.rebuild import Found, choose
from kvfs.disk.records import DiskFile, DiskRecord, LayoutMeta

MiB = 1 << 20
SEGMENT_SIZE = 256 * MiB
CHUNK = 4 * MiB
# Sizes around the chunk and page boundaries, an empty file among them.
SIZES = [0, 1, 4096, 5000, CHUNK, CHUNK + 1, 2 * CHUNK + 12345, 300_000]


def content(name: str, size: int) -> bytes:
    return random.Random(name).randbytes(size)


def record(version: int, path: str, chunks: list[tuple[int, int, int]], size: int) -> DiskRecord:
    parts = [part.encode() for part in path.split("/")]
    return DiskRecord(version, DiskFile(parts, size, 0o100644, 0, 0, 1, {b"user.k": b"v"}), chunks)


# Headers, pure -------------------------------------------------------------------------


def test_header_round_trip_and_damage_detection() -> None:
    original = record(7, "m/a.bin", [(0, CHUNK, 11), (CHUNK, 10, 12)], CHUNK + 10)
    block = encode_header(original, CHUNK, 99)
    assert len(block) % 4096 == 0
    body = decode_header(block)
    assert body.record == original and body.chunk_size == CHUNK and body.written_ns == 99
    garbled = bytearray(block)
    garbled[40] ^= 1
    with pytest.raises(HeaderError, match="checksum"):
        decode_header(bytes(garbled))
    with pytest.raises(HeaderError, match="magic"):
        decode_header(bytes(4096))
    window = bytes(8192) + block + b"x" * 100 + block[:24] + bytes(4096 - 124)  # the second copy is unaligned
    assert magic_pages(window) == [8192]


def test_choose_keeps_the_newest_of_overlapping_headers() -> None:
    def found(offset: int, version: int, chunk_offset: int, written: int = 0) -> Found:
        block = encode_header(record(version, f"f{version}", [(chunk_offset, 100, 1)], 100), CHUNK, written)
        body = decode_header(block)
        return Found(offset, 4096, body)

    kept, skipped = choose([found(0, 1, CHUNK), found(4096, 2, CHUNK), found(8192, 3, 2 * CHUNK),
                            found(3 * CHUNK, 3, 2 * CHUNK, written=5)], 4 * CHUNK, CHUNK)
    # Version 1's chunk was reused by version 2; of version 3's two headers the later rewrite wins.
    assert sorted((f.body.record.version, f.offset) for f in kept) == [(2, 4096), (3, 3 * CHUNK)]
    assert len(skipped) == 2 and all("overlap" in line for line in skipped)


# Through real mounts -------------------------------------------------------------------


def ssd_mount(make_mount, tmp_path: Path, *extra: str):
    return make_mount("64M", "--disk", str(tmp_path / "disk"), "--disk-size", "1G", *extra)


def ssd_used(root: Path) -> int:
    return json.loads(os.getxattr(root, "user.kvfs.stats"))["ssd_used"]


def fill(root: Path) -> dict[str, bytes]:
    """Files in nested directories, one renamed and one given xattrs after reaching SSD,
    one removed: the expected tree, path -> bytes."""
    expected: dict[str, bytes] = {}
    for layer in ("layer0", "layer1"):
        (root / "model" / layer).mkdir(parents=True)
    for i, size in enumerate(SIZES * 3):
        name = f"model/layer{i % 2}/k{i}.bin"
        (root / name).write_bytes(data := content(name, size))
        expected[name] = data
    (root / "gone.bin").write_bytes(b"removed before the damage")
    os.setxattr(root, "user.kvfs.control", b"sync")
    os.rename(root / "model/layer1/k1.bin", root / "model/renamed.bin")
    expected["model/renamed.bin"] = expected.pop("model/layer1/k1.bin")
    os.setxattr(root / "model/renamed.bin", "user.vllm", b"42")
    used = ssd_used(root)
    os.unlink(root / "gone.bin")
    deadline = time.monotonic() + 10  # its extents (and header) are freed in the background
    while ssd_used(root) == used and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ssd_used(root) < used
    return expected


def tree(root: Path) -> dict[str, bytes]:
    drop_page_cache()
    return {str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def damage(index: Path, how: str) -> None:
    data = index / "data.mdb"
    size = data.stat().st_size
    if how == "deleted":
        shutil.rmtree(index)
    elif how == "zeroed":
        data.write_bytes(bytes(size))
    elif how == "truncated":  # lmdb would die of SIGBUS on the pages cut off
        os.truncate(data, size // 2)
    elif how == "random":  # the meta pages survive; the tree is noise
        with open(data, "r+b") as f:
            f.seek(8192)
            f.write(random.Random(1).randbytes(size - 8192))
    elif how == "emptied":
        os.truncate(data, 0)


@pytest.mark.parametrize("how", ["deleted", "zeroed", "truncated", "random", "emptied"])
def test_a_damaged_index_is_rebuilt_at_mount(make_mount, tmp_path: Path, how: str) -> None:
    mount = ssd_mount(make_mount, tmp_path)
    root = mount.path
    expected = fill(root)
    mount.stop()
    index = tmp_path / "disk" / "index"
    damage(index, how)
    mount.start()
    log = mount.log_text()
    assert "the SSD index" in log and "rebuilding it from the segments" in log
    assert f"rebuilt the SSD index from {tmp_path / 'disk' / 'segments'}: {len(expected)} files" in log
    assert "Traceback" not in log
    assert tree(root) == expected  # every intact file, byte-exact; the removed one stays removed
    assert os.getxattr(root / "model/renamed.bin", "user.vllm") == b"42"
    if how != "deleted":
        assert (tmp_path / "disk" / "index.damaged" / "data.mdb").exists()
    mount.stop()
    mount.start()  # the rebuilt index is healthy: no second rebuild
    assert mount.log_text().count("rebuilding it from the segments") == 1
    assert tree(root) == expected


def test_damaged_extents_are_skipped_by_name(make_mount, tmp_path: Path) -> None:
    mount = ssd_mount(make_mount, tmp_path)
    root = mount.path
    for name in ("a.bin", "b.bin", "c.bin"):
        (root / name).write_bytes(content(name, 6 * MiB))
    os.setxattr(root, "user.kvfs.control", b"sync")
    b_chunk = int(os.getxattr(root / "b.bin", "user.kvfs.ssd_extents").decode().split(",")[1].split("+")[0])
    mount.stop()
    segments = tmp_path / "disk" / "segments"

    def poke(offset: int, data: bytes) -> None:
        with open(segments / f"segment-{offset // SEGMENT_SIZE:05d}.dat", "r+b") as f:
            f.seek(offset % SEGMENT_SIZE)
            f.write(data)

    poke(b_chunk + 1000, b"\xde\xad")  # b.bin: its second chunk
    c_header = [o for o in header_offsets(segments) if b"c.bin" in read_at(segments, o, 4096)]
    assert len(c_header) == 1
    poke(c_header[0] + 60, b"\xff\xff")  # c.bin: its header
    shutil.rmtree(tmp_path / "disk" / "index")
    mount.start()
    log = mount.log_text()
    assert "Traceback" not in log
    assert [line for line in log.splitlines() if "/b.bin" in line and "chunk 1" in line and "checksum" in line]
    assert [line for line in log.splitlines() if f"header at tier offset {c_header[0]}" in line
            and "checksum" in line]
    assert "rebuilt the SSD index" in log and ": 1 files" in log
    assert sorted(os.listdir(root)) == ["a.bin"]
    assert (root / "a.bin").read_bytes() == content("a.bin", 6 * MiB)


def header_offsets(segments: Path) -> list[int]:
    found = []
    for path in sorted(segments.glob("segment-*.dat")):
        base = int(path.stem.split("-")[1]) * SEGMENT_SIZE
        with open(path, "rb") as f:
            position = 0
            while window := f.read(4 * MiB):
                found += [base + position + o for o in magic_pages(window)]
                position += len(window)
    return found


def read_at(segments: Path, offset: int, length: int) -> bytes:
    with open(segments / f"segment-{offset // SEGMENT_SIZE:05d}.dat", "rb") as f:
        f.seek(offset % SEGMENT_SIZE)
        return f.read(length)


def run_kvfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfs", *args], capture_output=True, text=True, timeout=120)


def test_an_old_layout_is_refused_with_what_to_do(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    (disk / "index").mkdir(parents=True)
    env = lmdb.open(str(disk / "index"), max_dbs=2)
    with env.begin(db=env.open_db(b"meta"), write=True) as txn:
        txn.put(b"layout", msgspec.msgpack.encode(LayoutMeta(1, CHUNK, SEGMENT_SIZE)))
    with env.begin(db=env.open_db(b"files"), write=True) as txn:  # a layout 1 record: no header
        txn.put((5).to_bytes(8, "big"), msgspec.msgpack.encode(record(5, "old.bin", [(0, 10, 1)], 10)))
    env.close()
    (tmp_path / "mnt").mkdir()
    result = run_kvfs("mount", str(tmp_path / "mnt"), "--foreground", "--dram", "64M", "--disk", str(disk),
                      "--disk-size", "1G", "--io-engine", "threads", "--no-metrics")
    assert result.returncode == 1
    assert "layout 1" in result.stderr and f"remove {disk / 'index'}" in result.stderr
    assert "Traceback" not in result.stderr


def test_fsck_checks_and_repairs(make_mount, tmp_path: Path) -> None:
    mount = ssd_mount(make_mount, tmp_path)
    root = mount.path
    expected = fill(root)
    disk = str(tmp_path / "disk")
    busy = run_kvfs("fsck", "--disk", disk)
    assert busy.returncode == 1 and "in use" in busy.stderr  # never beside a mount
    mount.stop()
    clean = run_kvfs("fsck", "--disk", disk)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert f"{len(expected)} intact files" in clean.stdout and "clean" in clean.stdout
    damage(tmp_path / "disk" / "index", "truncated")
    found = run_kvfs("fsck", "--disk", disk)
    assert found.returncode == 2 and "damaged" in found.stdout and "--repair" in found.stdout
    repaired = run_kvfs("fsck", "--disk", disk, "--repair")
    assert repaired.returncode == 0 and "repaired" in repaired.stdout
    assert run_kvfs("fsck", "--disk", disk).returncode == 0
    mount.start()
    assert "rebuilding it from the segments" not in mount.log_text()
    assert tree(root) == expected


def test_fsck_repairs_entries_and_headers_against_a_healthy_index(make_mount, tmp_path: Path) -> None:
    mount = ssd_mount(make_mount, tmp_path)
    root = mount.path
    for name in ("a.bin", "b.bin", "c.bin", "d.bin"):
        (root / name).write_bytes(content(name, MiB))
    os.setxattr(root, "user.kvfs.control", b"sync")
    segments = tmp_path / "disk" / "segments"

    def header_of(name: str) -> int:
        found = [o for o in header_offsets(segments) if name.encode() in read_at(segments, o, 4096)]
        assert len(found) == 1, (name, found)
        return found[0]

    def poke(offset: int, data: bytes) -> None:
        with open(segments / f"segment-{offset // SEGMENT_SIZE:05d}.dat", "r+b") as f:
            f.seek(offset % SEGMENT_SIZE)
            f.write(data)

    b_chunk = int(os.getxattr(root / "b.bin", "user.kvfs.ssd_extents").decode().split("+")[0])
    d_header = header_of("d.bin")
    d_page = read_at(segments, d_header, 4096)
    used = ssd_used(root)
    os.unlink(root / "d.bin")
    deadline = time.monotonic() + 10
    while ssd_used(root) == used and time.monotonic() < deadline:
        time.sleep(0.02)
    mount.stop()
    assert header_of("c.bin") and not [o for o in header_offsets(segments) if o == d_header]  # erased
    poke(d_header, d_page)  # as if its erasure never reached the disk
    poke(b_chunk + 100, b"\x00\xff")  # b.bin: damaged data
    poke(header_of("c.bin") + 30, b"\x00\xff")  # c.bin: a damaged header, intact data
    disk = str(tmp_path / "disk")
    found = run_kvfs("fsck", "--disk", disk)
    assert found.returncode == 2, found.stdout + found.stderr
    problems = [line for line in found.stdout.splitlines() if "problem:" in line]
    assert len(problems) == 3, found.stdout
    assert any("/b.bin" in p and "checksum" in p for p in problems)
    assert any("/c.bin" in p and "header is missing or stale" in p for p in problems)
    assert any("/d.bin" in p and "does not know" in p for p in problems)
    repaired = run_kvfs("fsck", "--disk", disk, "--repair")
    assert repaired.returncode == 0 and "repaired" in repaired.stdout, repaired.stdout + repaired.stderr
    again = run_kvfs("fsck", "--disk", disk)
    assert again.returncode == 0 and "clean" in again.stdout, again.stdout + again.stderr
    shutil.rmtree(tmp_path / "disk" / "index")  # the repaired headers alone give back the same tree
    mount.start()
    assert tree(root) == {name: content(name, MiB) for name in ("a.bin", "c.bin")}


def test_the_index_check_reports_any_damage_without_dying(tmp_path: Path) -> None:
    """Random pages of a real index overwritten, again and again: the check answers "ok" (the
    damage missed every page it reads) or "damaged", and never raises or hangs."""
    from kvfs.disk.index import DiskIndex
    from kvfs.disk.index_check import check_index
    from kvfs.disk.records import IndexEntry

    pristine = tmp_path / "pristine"
    index = DiskIndex(pristine)
    index.set_layout(LayoutMeta(2, CHUNK, SEGMENT_SIZE))
    index.put([IndexEntry(record(v, f"d/k{v}.bin", [(2 * v * 4096 + 4096, 4096, v)], 4096), 2 * v * 4096, 4096)
               for v in range(3000)])
    index.close()
    size = (pristine / "data.mdb").stat().st_size
    kinds = []
    for seed in range(12):
        rng = random.Random(seed)
        copy = tmp_path / f"copy{seed}"
        shutil.copytree(pristine, copy)
        with open(copy / "data.mdb", "r+b") as f:
            for _ in range(rng.randint(1, 4)):
                f.seek(rng.randrange(size // 4096) * 4096 + rng.randrange(4096 - 64))
                f.write(rng.randbytes(64))
        state = check_index(copy, 1 << 30, CHUNK, 1 << 30, timeout_s=60)
        assert state.kind in ("ok", "damaged"), state
        assert state.kind == "damaged" or state.records == 3000, state
        kinds.append(state.kind)
    assert "damaged" in kinds, kinds


def test_a_cluster_node_rebuilds_its_index_and_serves_its_files_again(cluster, tmp_path: Path) -> None:
    owner = cluster.add_node("64M", "--disk", str(tmp_path / "owner-disk"), "--disk-size", "256M", name="owner")
    reader = cluster.add_node("64M", name="reader")
    files = {f"m/k{i}.bin": content(f"k{i}", size) for i, size in enumerate(SIZES)}
    (owner.path / "m").mkdir()
    for name, data in files.items():
        (owner.path / name).write_bytes(data)
    os.setxattr(owner.path, "user.kvfs.control", b"flush")
    owner.stop()
    damage(tmp_path / "owner-disk" / "index", "zeroed")
    owner.start()
    assert "rebuilding it from the segments" in owner.log_text()
    assert f": {len(files)} files" in owner.log_text()
    deadline = time.monotonic() + 30
    while not all((reader.path / name).exists() for name in files) and time.monotonic() < deadline:
        time.sleep(0.1)
    drop_page_cache()
    for name, data in files.items():
        assert (reader.path / name).read_bytes() == data, name
