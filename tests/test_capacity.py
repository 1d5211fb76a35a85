"""Capacity management through a mount: eviction of whole files, ENOSPC only when nothing can go."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

import pytest
from conftest import drop_page_cache, is_stored

MiB = 1 << 20


def content(index: int, size: int) -> bytes:
    stamp = index.to_bytes(4, "little")
    return (stamp * (size // 4 + 1))[:size]


def test_writing_three_times_dram_never_fails_or_corrupts(make_mount) -> None:
    mount = make_mount("64M")
    root = mount.path
    sizes = [2 * MiB, 4 * MiB + 4096, 8 * MiB, 3 * MiB + 123]
    written: list[tuple[Path, int, int]] = []
    total = 0
    index = 0
    while total < 3 * 64 * MiB:
        size = sizes[index % len(sizes)]
        path = root / f"d{index % 5}" / f"block{index}.bin"
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(content(index, size))
        os.rename(tmp, path)
        written.append((path, index, size))
        total += size
        index += 1
        st = os.statvfs(root)
        assert st.f_bfree <= st.f_blocks
    drop_page_cache()  # read back from the daemon, not from the kernel's copy
    present = 0
    for path, i, size in written:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            continue
        assert data == content(i, size), f"{path} has wrong bytes"
        present += 1
    assert 0 < present < len(written)
    newest = written[-4:]
    assert all(path.read_bytes() == content(i, size) for path, i, size in newest)
    listed = {p.name for d in root.iterdir() for p in d.iterdir()}
    assert {p.name for p, _, _ in written if is_stored(p)} == listed
    assert not any(name.endswith(".tmp") for name in listed)
    st = os.statvfs(root)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    stored = sum(size for path, _, size in written if is_stored(path))
    assert stored <= used <= 64 * MiB


def test_enospc_only_when_nothing_is_evictable(make_mount) -> None:
    mount = make_mount("32M")
    mount.allowed_errors.append("no file can be evicted")
    root = mount.path
    held = []
    for i in range(4):  # fill the tier with files that stay open for reading
        path = root / f"pinned{i}"
        path.write_bytes(content(i, 8 * MiB))
        held.append(open(path, "rb"))
    with pytest.raises(OSError) as raised:
        (root / "one-too-many").write_bytes(content(9, 4 * MiB))
    assert raised.value.errno == errno.ENOSPC
    for i, handle in enumerate(held):  # what was stored is undamaged
        assert handle.read() == content(i, 8 * MiB)
        handle.close()
    (root / "after").write_bytes(content(10, 4 * MiB))  # now an old file can be evicted
    assert (root / "after").read_bytes() == content(10, 4 * MiB)


def test_file_larger_than_the_tier_is_refused(make_mount) -> None:
    mount = make_mount("32M")
    path = mount.path / "huge"
    with pytest.raises(OSError) as raised:
        path.write_bytes(bytes(40 * MiB))
    assert raised.value.errno == errno.EFBIG
    with pytest.raises(OSError) as raised:
        os.truncate(mount.path / "huge", 64 * MiB)
    assert raised.value.errno == errno.EFBIG


def test_orphaned_temp_files_are_collected(make_mount) -> None:
    import time

    mount = make_mount("64M", "--temp-grace", "0.5", "--gc-interval", "0.2")
    orphan = mount.path / "x.bin_1234.tmp"
    orphan.write_bytes(b"abandoned by a writer that died")
    kept = mount.path / "x.bin"
    kept.write_bytes(b"published")
    deadline = time.monotonic() + 20
    while orphan.name in os.listdir(mount.path):
        assert time.monotonic() < deadline, "the orphaned temp file was never collected"
        time.sleep(0.1)
    assert not is_stored(orphan)
    assert kept.read_bytes() == b"published"
    assert "collected 1 orphaned temp files" in mount.log_text()


def stats(mount_path: Path) -> dict:
    import json

    return json.loads(os.getxattr(mount_path, "user.kvfs.stats"))


@pytest.mark.parametrize("tier", ["dram", "ssd"])
@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "O_DIRECT"])
def test_files_waiting_for_their_rename_outlive_published_ones(make_mount, tmp_path: Path, tier: str,
                                                               direct: bool) -> None:
    """LMCache's fs connector: a batch writes all its `<key>.tmp` files, then renames each
    to `<key>.data`. On a tier full of published files that were read (worth keeping by
    every policy), the temp files rank last: the published files go, and no rename fails."""
    import mmap

    if tier == "dram":
        mount = make_mount("96M")
    else:  # the SSD tier holds every file; DRAM is its cache
        mount = make_mount("32M", "--disk", str(tmp_path / "disk"), "--disk-size", "96M")
    root = mount.path
    size = 8 * MiB
    published = [root / f"old{i}.data" for i in range(12)]  # 96 MiB: the tier is full
    for i, path in enumerate(published):
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(content(i, size))
        os.replace(tmp, path)
        assert path.read_bytes()[:4] == content(i, 4)  # read once: no longer a one-off block
    buffer = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    batch = [root / f"new{i}.data" for i in range(6)]
    for i, path in enumerate(batch):
        buffer[:] = content(100 + i, size)
        flags = os.O_WRONLY | os.O_CREAT | (os.O_DIRECT if direct else os.O_TRUNC)  # LMCache: no O_TRUNC with O_DIRECT
        fd = os.open(path.with_suffix(".tmp"), flags, 0o644)
        try:
            assert os.write(fd, buffer) == size
        finally:
            os.close(fd)
    if tier == "ssd":
        # Offload is asynchronous: wait until the temp files are on SSD (room made for them)
        # while they are still unpublished; after the renames they rank like any new file.
        os.setxattr(root, "user.kvfs.control", b"sync")
    failed = []
    for path in batch:
        try:
            os.replace(path.with_suffix(".tmp"), path)
        except FileNotFoundError:
            failed.append(path.name)
    assert failed == []
    drop_page_cache()
    for i, path in enumerate(batch):
        assert path.read_bytes() == content(100 + i, size)
    evicted = [path for path in published if not is_stored(path)]
    assert len(evicted) >= len(batch) - 1  # their room went to the batch
    assert stats(root)["evicted_files"] == len(evicted)
    reason = "DRAM tier full" if tier == "dram" else "SSD tier full"
    assert re.search(rf" INFO .*removed \d+ files.*: {reason}", mount.log_text())  # not only at debug
