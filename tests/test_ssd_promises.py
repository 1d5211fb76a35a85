"""Promises of docs/ssd-tier.md tried against what breaks them, through real mounts: a kill -9
right after renames, attribute changes and an fsync of files on SSD, a restart on a full file
system, a second process on a tier in use, segment files cut short or deleted, and a tier
shrunk under its files."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
from conftest import KvfsMount, drop_page_cache, is_stored, small_tmpfs
from test_ssd import stats, sync, tier
from test_ssd_faults import content, fill

from kvfs.disk.index import DiskIndex
from kvfs.disk.records import LayoutMeta
from kvfs.disk.tier import index_map_size

KiB, MiB = 1 << 10, 1 << 20
SEGMENT_SIZE = 256 * MiB


def extents(path: Path) -> list[int]:
    """The tier offsets of a file's chunks on SSD."""
    return [int(item.split("+")[0]) for item in os.getxattr(path, "user.kvfs.ssd_extents").decode().split(",")]


def tree(root: Path) -> dict[str, bytes]:
    drop_page_cache()
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 72 MiB tmpfs: a 64 MiB tier and a little room for its index (asked for before
    make_mount, so that the daemon stops before it goes)."""
    with small_tmpfs(tmp_path / "fs", "72m") as directory:
        yield directory


def test_a_kill_9_right_after_renames_attribute_changes_and_an_fsync_keeps_them(make_mount, tmp_path: Path) -> None:
    """'Renames and attribute changes of a file on SSD rewrite its record before the call
    returns'; 'crash, kill -9: every file whose fsync returned' comes back."""
    mount = make_mount("64M", "--disk", str(tmp_path / "disk"), "--disk-size", "256M")
    root = mount.path
    (root / "m" / "layer").mkdir(parents=True)
    for name in ("a.bin", "b.bin", "m/layer/c.bin", "d.bin.tmp"):
        (root / name).write_bytes(content(name, 3 * MiB))
    sync(root)
    assert all(tier(root / name) == "dram+ssd" for name in ("a.bin", "b.bin", "m/layer/c.bin", "d.bin.tmp"))
    os.rename(root / "a.bin", root / "m" / "a2.bin")  # a file's rename
    os.chmod(root / "m" / "a2.bin", 0o640)
    os.setxattr(root / "b.bin", "user.vllm_kv_crc32", b"777")
    os.rename(root / "m" / "layer", root / "m" / "layer9")  # a directory's rename
    os.rename(root / "d.bin.tmp", root / "d.bin")  # a temp file on SSD published
    (root / "e.bin").write_bytes(content("e.bin", 2 * MiB))
    with open(root / "e.bin", "rb") as f:
        os.fsync(f.fileno())  # on SSD under its name when it returns
    (root / "f.bin").write_bytes(content("f-old", 3 * MiB))
    (root / "f.bin.tmp").write_bytes(content("f-new", 3 * MiB))
    sync(root)
    os.rename(root / "f.bin.tmp", root / "f.bin")  # both versions on SSD: the newer must win
    (root / "g.bin").write_bytes(content("g.bin", 3 * MiB))
    sync(root)
    rewriting = open(root / "g.bin", "r+b")  # a new version of a file on SSD, half written...
    rewriting.truncate(0)
    rewriting.write(content("half", MiB))
    rewriting.flush()
    writing = open(root / "h.bin", "wb")  # ...and a new file, never closed
    writing.write(content("h.bin", MiB))
    writing.flush()
    mount.kill()
    for handle in (rewriting, writing):
        with contextlib.suppress(OSError):  # the daemon is gone
            handle.close()
    mount.start()
    expected = {"m/a2.bin": content("a.bin", 3 * MiB), "b.bin": content("b.bin", 3 * MiB),
                "m/layer9/c.bin": content("m/layer/c.bin", 3 * MiB), "d.bin": content("d.bin.tmp", 3 * MiB),
                "e.bin": content("e.bin", 2 * MiB), "f.bin": content("f-new", 3 * MiB)}
    found = tree(root)
    # Unsealed bytes never come back; the version they were replacing may (it was on SSD).
    assert found.pop("g.bin", content("g.bin", 3 * MiB)) == content("g.bin", 3 * MiB)
    assert found == expected
    assert (root / "m" / "a2.bin").stat().st_mode & 0o777 == 0o640
    assert os.getxattr(root / "b.bin", "user.vllm_kv_crc32") == b"777"


@pytest.mark.parametrize("offload", ["eager", "watermark"])
def test_fsync_right_after_a_rename_that_races_the_copy_survives_a_kill_9(make_mount, tmp_path: Path,
                                                                          offload: str) -> None:
    """ssd-tier.md: fsync 'waits until that file is on SSD under its current name (in watermark
    mode too)'. Each file is renamed the moment its writer closed it, while its copy under the
    temp name is queued or under way; a crash must not bring back only the temp name (which is
    never restored)."""
    mount = make_mount("64M", "--disk", str(tmp_path / "disk"), "--disk-size", "256M", "--offload", offload)
    root = mount.path
    expected = {}
    for i in range(24):
        name = f"k{i:02d}.bin"
        tmp = root / f"{name}.tmp"
        tmp.write_bytes(data := content(name, MiB + 4096 * i))
        os.rename(tmp, root / name)
        if i % 3 == 0:  # and its directory renamed too, while the copy may still run
            (root / f"d{i}").mkdir()
            os.rename(root / name, root / f"d{i}" / name)
            os.rename(root / f"d{i}", root / f"e{i}")
            name = f"e{i}/{name}"
        fd = os.open(root / name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        expected[name] = data
    mount.kill()
    mount.start()
    assert tree(root) == expected


def test_a_restart_on_a_full_file_system_loses_no_file(small_fs: Path, make_mount) -> None:
    """A full disk gives ENOSPC, never a lost or damaged tier: a mount restarted while the
    tier's file system has not one block left brings back every file it had on SSD."""
    disk = small_fs / "disk"
    mount = make_mount("32M", "--disk", str(disk), "--disk-size", "64M", "--backpressure-timeout", "2")
    mount.allowed_errors.extend(("copying files to", "updating the index in"))
    root = mount.path
    names = [f"k{i}.bin" for i in range(8)]
    for name in names:
        (root / name).write_bytes(content(name, 512 * KiB))
    sync(root)
    mount.stop()
    filler = fill(small_fs)
    offset = len(mount.log_text())
    mount.start()
    log = mount.log_text()
    assert "Traceback" not in log
    engines = re.findall(r"SSD tier: .* \((\S+) I/O", log)
    assert len(engines) == 2 and engines[1] == engines[0], "a full file system changed the I/O engine"
    assert "io_uring is unavailable" not in log[offset:]
    assert not (disk / "index.damaged").exists(), "a full file system was taken for a damaged index"
    assert sorted(os.listdir(root)) == names
    for name in names:
        assert (root / name).read_bytes() == content(name, 512 * KiB)
    mount.stop()
    filler.unlink()
    mount.start()
    assert sorted(os.listdir(root)) == names
    for name in names:
        assert (root / name).read_bytes() == content(name, 512 * KiB)


def test_a_second_mount_of_a_tier_in_use_is_refused_and_harms_nothing(make_mount, tmp_path: Path) -> None:
    """DIR/lock: one process uses a tier."""
    disk = tmp_path / "disk"
    mount = make_mount("64M", "--disk", str(disk), "--disk-size", "256M")
    root = mount.path
    (root / "a.bin").write_bytes(content("a.bin", 3 * MiB))
    sync(root)
    other_root = tmp_path / "other"
    other_root.mkdir()
    other = KvfsMount(other_root, "64M", "--disk", str(disk), "--disk-size", "256M")
    try:
        with pytest.raises(RuntimeError) as raised:
            other.start()
    finally:
        other.stop()  # only if it came up against the lock
    assert "in use" in str(raised.value)
    assert other.process is not None and other.process.returncode not in (0, None)
    assert (root / "a.bin").read_bytes() == content("a.bin", 3 * MiB)
    (root / "b.bin").write_bytes(content("b.bin", MiB))
    sync(root)
    mount.stop()
    mount.start()
    assert tree(root) == {"a.bin": content("a.bin", 3 * MiB), "b.bin": content("b.bin", MiB)}


@pytest.mark.parametrize("how", ["truncated", "deleted"])
def test_a_segment_file_cut_short_or_deleted_serves_no_wrong_byte(make_mount, tmp_path: Path, how: str) -> None:
    """A segment file damaged between runs (cut short, or gone): the files whose chunks lay
    there are never served (an error, then absent), every other file is whole, the daemon lives."""
    disk = tmp_path / "disk"
    mount = make_mount("32M", "--disk", str(disk), "--disk-size", "512M")
    root = mount.path
    names = [f"f{i:02d}.bin" for i in range(40)]  # 160 MiB through a 32 MiB DRAM tier
    for name in names:
        (root / name).write_bytes(content(name, 4 * MiB))
    sync(root)
    first = {name for name in names if any(offset < SEGMENT_SIZE for offset in extents(root / name))}
    if how == "deleted":
        first = {name for name in names if all(offset < SEGMENT_SIZE for offset in extents(root / name))} | first
    assert first and len(first) < len(names)
    mount.stop()
    segment = disk / "segments" / "segment-00000.dat"
    if how == "truncated":
        os.truncate(segment, 0)
    else:
        segment.unlink()
    mount.allowed_errors.extend(("failed its checksum", "quarantined"))
    mount.start()
    for name in names:
        try:
            data = (root / name).read_bytes()
        except OSError as error:
            assert name in first and error.errno in (errno.EIO, errno.ENOENT), (name, error)
            continue
        assert data == content(name, 4 * MiB), name
    for name in names:
        if name in first:
            assert not is_stored(root / name), name
        else:
            assert (root / name).read_bytes() == content(name, 4 * MiB)
    (root / "after.bin").write_bytes(content("after.bin", 4 * MiB))  # the tier takes new files
    sync(root)
    assert (root / "after.bin").read_bytes() == content("after.bin", 4 * MiB)
    mount.stop()
    mount.start()
    assert sorted(os.listdir(root)) == sorted([*(set(names) - first), "after.bin"])


def test_shrinking_the_tier_drops_the_files_beyond_its_new_end(make_mount, tmp_path: Path) -> None:
    """configuration.md, --disk-size: 'Growing it later is fine; shrinking drops files beyond
    the new end.'"""
    disk = tmp_path / "disk"
    mount = make_mount("32M", "--disk", str(disk), "--disk-size", "512M")
    root = mount.path
    names = [f"f{i:02d}.bin" for i in range(40)]
    for name in names:
        (root / name).write_bytes(content(name, 4 * MiB))
    sync(root)
    beyond = {name for name in names if any(offset + 4 * MiB > SEGMENT_SIZE for offset in extents(root / name))}
    assert beyond and len(beyond) < len(names)
    mount.stop()
    shrunk = mount.args.index("--disk-size") + 1
    mount.args[shrunk] = "256M"
    mount.start()
    kept = sorted(set(names) - beyond)
    assert sorted(os.listdir(root)) == kept
    for name in kept:
        assert (root / name).read_bytes() == content(name, 4 * MiB)
    assert "Traceback" not in mount.log_text()
    mount.stop()
    mount.args[shrunk] = "512M"  # and grown again
    mount.start()
    assert sorted(os.listdir(root)) == kept
    (root / "late.bin").write_bytes(content("late.bin", 4 * MiB))
    sync(root)
    assert tier(root / "late.bin") == "dram+ssd"
    assert shutil.disk_usage(root).total == 512 * MiB


def start_and_kill_at(mount: KvfsMount, *markers: str, timeout: float = 120) -> str:
    """Starts the daemon and kills it (-9) as soon as its log shows one of `markers`; returns
    what it logged."""
    offset = len(mount.log_text())
    with open(mount.log_path, "ab") as log:
        process = subprocess.Popen(mount.args, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    try:
        while not any(marker in mount.log_text()[offset:] for marker in markers):
            assert process.poll() is None, f"kvfs exited with {process.returncode}:\n{mount.log_text()[offset:]}"
            assert time.monotonic() < deadline, f"none of {markers} within {timeout} s"
            time.sleep(0.005)
    finally:
        process.kill()
        process.wait()
    return mount.log_text()[offset:]


def test_a_rebuild_killed_midway_runs_again_and_loses_nothing(make_mount, tmp_path: Path) -> None:
    """ssd-tier.md: 'a rebuild that is interrupted reads as damage and runs again at the next
    start'. Killed first as the scan begins, then as it reports progress; the damaged index it
    rebuilds from stays aside for a post-mortem, not replaced by a rebuild's remains."""
    disk = tmp_path / "disk"
    mount = make_mount("64M", "--disk", str(disk), "--disk-size", "4G")
    root = mount.path
    expected = {}
    for i in range(48):
        name = f"d{i % 3}/k{i:02d}.bin"
        (root / name).parent.mkdir(exist_ok=True)
        (root / name).write_bytes(data := content(name, 4 * MiB + 4096 * i))
        expected[name] = data
    sync(root)
    mount.stop()
    data = disk / "index" / "data.mdb"
    damaged = bytes(data.stat().st_size)
    data.write_bytes(damaged)  # zeroed
    first = start_and_kill_at(mount, "rebuilding it from the segments")
    assert "rebuilt the SSD index" not in first
    # Killed again as the scan reports progress (a machine that scans 4 GiB within its
    # first second of progress finishes the rebuild instead: then the start below checks it).
    start_and_kill_at(mount, "scanned", "rebuilt the SSD index")
    subprocess.run(["fusermount3", "-u", "-z", str(mount.path)], capture_output=True)  # if it got that far
    mount.start()
    log = mount.log_text()
    assert f"rebuilt the SSD index from {disk / 'segments'}: {len(expected)} files" in log
    assert tree(root) == expected
    rebuilds = log.count("rebuilt the SSD index")
    assert (disk / "index.damaged" / "data.mdb").read_bytes() == damaged
    mount.stop()
    mount.start()  # the rebuilt index is whole: no further rebuild
    assert mount.log_text().count("rebuilt the SSD index") == rebuilds
    assert tree(root) == expected


def test_a_stop_with_files_held_open_is_bounded_and_keeps_every_sealed_file(make_mount, tmp_path: Path) -> None:
    """A clean stop with a reader and a writer that never close: the daemon serves them for
    a grace after the unmount, then stops anyway (a stop never waits on a process that holds a
    file), copies every sealed file to SSD, and the unsealed one is not brought back."""
    mount = make_mount("64M", "--disk", str(tmp_path / "disk"), "--disk-size", "256M", "--offload", "watermark")
    root = mount.path
    (root / "sealed.bin").write_bytes(content("sealed.bin", 3 * MiB))  # only in DRAM (watermark)
    reader = open(root / "sealed.bin", "rb")
    writer = open(root / "unsealed.bin", "wb")
    writer.write(content("unsealed.bin", MiB))
    writer.flush()
    try:
        mount.stop()  # SIGTERM; fails the test if the daemon is still there after 30 s
        assert mount.stop_status == 0
        assert "files were still open" in mount.log_text() and "stopping anyway" in mount.log_text()
        assert "copying 1 files still only in DRAM" in mount.log_text()
    finally:
        for handle in (reader, writer):
            with contextlib.suppress(OSError):  # the daemon is gone: ENOTCONN
                handle.close()
    mount.start()
    assert tree(root) == {"sealed.bin": content("sealed.bin", 3 * MiB)}


def test_fsync_of_a_file_removed_while_open_names_the_removal_not_a_full_tier(make_mount, tmp_path: Path) -> None:
    """fsync never succeeds for a file a crash would lose; when it fails because the file was
    unlinked or replaced while open, its log line says so (not that the SSD tier is full)."""
    mount = make_mount("64M", "--disk", str(tmp_path / "disk"), "--disk-size", "256M", "--offload", "watermark")
    root = mount.path
    (root / "gone.bin").write_bytes(content("gone.bin", 2 * MiB))
    (root / "old.bin").write_bytes(content("old.bin", 2 * MiB))
    gone, old = os.open(root / "gone.bin", os.O_RDONLY), os.open(root / "old.bin", os.O_RDONLY)
    try:
        os.unlink(root / "gone.bin")
        (root / "old.bin.tmp").write_bytes(content("new.bin", 2 * MiB))
        os.rename(root / "old.bin.tmp", root / "old.bin")
        for fd in (gone, old):
            with pytest.raises(OSError) as raised:
                os.fsync(fd)
            assert raised.value.errno == errno.EIO
            assert os.pread(fd, 16, 0) == content("gone.bin" if fd == gone else "old.bin", 16)  # still readable
    finally:
        os.close(gone)
        os.close(old)
    failures = [line for line in mount.log_text().splitlines() if "fsync(" in line and " failed" in line]
    assert len(failures) == 2 and all("no name to save it under was found" in line for line in failures), failures
    assert "SSD tier is full" not in mount.log_text()
    with open(root / "old.bin", "rb") as f:  # the file under the name now: saved by fsync
        os.fsync(f.fileno())
    assert tier(root / "old.bin") == "dram+ssd"


def test_readers_waiting_on_a_promotion_that_meets_a_corrupt_chunk_all_get_eio(make_mount, tmp_path: Path) -> None:
    """ssd-tier.md: a promotion pins its file and other readers wait for it; a chunk that fails
    its checksum fails the read with EIO and quarantines the file. Eight readers open a file at
    its second touch, while its third chunk was damaged on disk: every one gets an answer (EIO,
    or ENOENT once it is quarantined), none a byte of it, and the daemon goes on."""
    disk = tmp_path / "disk"
    mount = make_mount("64M", "--disk", str(disk), "--disk-size", "256M")
    mount.allowed_errors.extend(("failed its checksum", "quarantined"))
    root = mount.path
    for name in ("bad.bin", "good.bin"):
        (root / name).write_bytes(content(name, 16 * MiB))
    sync(root)
    os.setxattr(root, "user.kvfs.control", b"drop-dram")
    drop_page_cache()
    assert (root / "bad.bin").read_bytes() == content("bad.bin", 16 * MiB)  # first touch: from SSD
    assert tier(root / "bad.bin") == "ssd"
    offset = extents(root / "bad.bin")[2]
    fd = os.open(disk / "segments" / f"segment-{offset // SEGMENT_SIZE:05d}.dat", os.O_RDWR)
    try:
        os.pwrite(fd, b"\xde\xad\xbe\xef", offset % SEGMENT_SIZE + 777)
        os.fsync(fd)
    finally:
        os.close(fd)
    drop_page_cache()
    outcomes: list[object] = []

    def reader() -> None:
        try:
            with open(root / "bad.bin", "rb", buffering=0) as f:
                outcomes.append(f.read(16 * MiB))
        except OSError as error:
            outcomes.append(error.errno)

    threads = [threading.Thread(target=reader, daemon=True) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not [thread for thread in threads if thread.is_alive()], "a reader still waits"
    assert len(outcomes) == 8 and set(outcomes) <= {errno.EIO, errno.ENOENT} and errno.EIO in outcomes, outcomes
    assert not is_stored(root / "bad.bin")
    assert stats(root)["quarantined_files"] == 1
    assert (root / "good.bin").read_bytes() == content("good.bin", 16 * MiB)


def set_layout(disk: Path, meta: LayoutMeta) -> None:
    index = DiskIndex(disk / "index", map_size=index_map_size(256 * MiB))
    try:
        index.set_layout(meta)
    finally:
        index.close()


@pytest.mark.parametrize("other", ["chunk size", "segment size", "newer layout"])
def test_a_tier_of_another_layout_is_refused_and_left_as_it_was(make_mount, tmp_path: Path, other: str) -> None:
    """ssd-tier.md: 'A tier with another chunk size or segment size is refused the same way'
    (as an older layout); so is one written by a newer kvfs (a downgrade). The refusal changes
    nothing on disk: with its layout back, every file is there."""
    disk = tmp_path / "disk"
    mount = make_mount("64M", "--disk", str(disk), "--disk-size", "256M")
    root = mount.path
    (root / "a.bin").write_bytes(content("a.bin", 5 * MiB))
    mount.stop()
    ours = DiskIndex(disk / "index", map_size=index_map_size(256 * MiB))
    try:
        layout = ours.layout()
    finally:
        ours.close()
    assert layout is not None
    changed = {"chunk size": LayoutMeta(layout.layout, layout.chunk_size * 2, layout.segment_size),
               "segment size": LayoutMeta(layout.layout, layout.chunk_size, layout.segment_size * 2),
               "newer layout": LayoutMeta(layout.layout + 1, layout.chunk_size, layout.segment_size)}[other]
    set_layout(disk, changed)
    before = {p: p.stat().st_size for p in disk.rglob("*") if p.is_file() and p.name != "lock"}
    result = subprocess.run(mount.args, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "holds an SSD tier of another layout" in result.stderr and "Traceback" not in result.stderr
    assert {p: p.stat().st_size for p in disk.rglob("*") if p.is_file() and p.name != "lock"} == before
    assert not (disk / "index.damaged").exists()
    set_layout(disk, layout)
    mount.start()
    assert tree(root) == {"a.bin": content("a.bin", 5 * MiB)}


def test_fsck_after_a_kill_9_mid_writes_finds_the_tier_whole_and_a_repair_keeps_every_acknowledged_file(
        make_mount, tmp_path: Path) -> None:
    """ssd-tier.md: fsck is for checking a tier 'after a power loss'. Killed while 8 writers
    publish files: fsck finds nothing to repair in what the crash left, --repair loses no file
    that was acknowledged on SSD, and every file that comes back is whole."""
    disk = tmp_path / "disk"
    mount = make_mount("64M", "--disk", str(disk), "--disk-size", "1G")
    root = mount.path
    acknowledged: set[str] = set()
    stop = threading.Event()

    def writer(worker: int) -> None:
        for i in range(300):
            name = f"w{worker}-{i}.bin"
            try:
                (root / f"{name}.tmp").write_bytes(content(name, (1 + i % 3) * MiB))
                os.rename(root / f"{name}.tmp", root / name)
            except OSError:
                return  # the daemon died under us
            if stop.is_set():
                return

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while len(acknowledged) < 20 and time.monotonic() < deadline:
        for name in os.listdir(root):
            with contextlib.suppress(OSError):
                if name.endswith(".bin") and "ssd" in tier(root / name):
                    acknowledged.add(name)
        time.sleep(0.01)
    mount.kill()
    stop.set()
    for thread in threads:
        thread.join()
    subprocess.run(["fusermount3", "-u", "-z", str(root)], check=True)  # the stale mount of the dead daemon
    assert len(acknowledged) >= 20

    def fsck(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*mount.args[:3], "fsck", "--disk", str(disk), *args], capture_output=True, text=True,
                              timeout=300)

    # What the kill may leave: copies it cut short (headers whose index records never
    # committed) and renames it cut short (a temp file's new header written and synced, the
    # index not yet: its entry still names the temp file, which a mount discards). Nothing else.
    found = fsck()
    problems = [line for line in found.stdout.splitlines() if "problem:" in line]
    assert found.returncode == (2 if problems else 0), found.stdout + found.stderr
    assert all("a header the index does not know (a file removed, or a copy cut short" in line
               or (".bin.tmp" in line and "its extent header is missing or stale" in line)
               for line in problems), problems
    assert fsck("--repair").returncode == 0
    after = fsck()
    assert after.returncode == 0 and after.stdout.strip().endswith("clean"), after.stdout + after.stderr
    mount.start()
    names = set(os.listdir(root))
    assert acknowledged <= names and not [name for name in names if name.endswith(".tmp")]
    drop_page_cache()
    for name in names:
        data = (root / name).read_bytes()
        assert data == content(name, len(data)) and len(data) in (MiB, 2 * MiB, 3 * MiB), name
