"""Directories of a single-node mount with an SSD tier across restarts (a clean stop and
kill -9): their modes, owners and times, empty ones, renames and removals, and a damaged
or missing directory record, which never costs a file."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import lmdb
import pytest

MiB = 1 << 20
USER = 1000


def ssd_mount(make_mount, tmp_path: Path):
    return make_mount("64M", "--disk", str(tmp_path / "disk"), "--disk-size", "256M")


def sync(root: Path) -> None:
    os.setxattr(root, "user.kvfs.control", b"sync")


def restart(mount, how: str) -> None:
    if how == "stop":
        mount.stop()
    else:
        mount.kill()  # kill -9: the records must already be on disk
    mount.start()


def write_as(root: Path, relative: str, data: bytes, uid: int = USER) -> subprocess.CompletedProcess[str]:
    """Creates root/relative as uid (through a descriptor of the mount's root: the test's
    temporary directories above it are not searchable by other users)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        code = (f"import os; f = os.open({relative!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640, dir_fd={fd}); "
                f"os.write(f, {data!r}); os.close(f)")
        return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/usr/bin/python3",
                               "-c", code], capture_output=True, text=True, timeout=30, pass_fds=(fd,))
    finally:
        os.close(fd)


def owner_and_mode(path: Path) -> tuple[int, int, int]:
    info = path.stat()
    assert stat.S_ISDIR(info.st_mode)
    return info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode)


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_lmcache_directory_of_a_user_survives_a_restart(make_mount, tmp_path: Path, how: str) -> None:
    mount = ssd_mount(make_mount, tmp_path)
    root = mount.path
    (root / "lmcache").mkdir()
    os.chown(root / "lmcache", USER, USER)
    os.chmod(root / "lmcache", 0o750)
    first = write_as(root, "lmcache/a.pt", b"a" * 5000)
    assert first.returncode == 0, first.stderr
    sync(root)
    restart(mount, how)
    assert owner_and_mode(root / "lmcache") == (USER, USER, 0o750)
    second = write_as(root, "lmcache/b.pt", b"b" * 5000)
    assert second.returncode == 0, second.stderr  # EACCES before directories were saved
    assert (root / "lmcache" / "a.pt").read_bytes() == b"a" * 5000
    assert (root / "lmcache" / "a.pt").stat().st_uid == USER


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_nested_directories_across_a_rename_and_an_rmdir(make_mount, tmp_path: Path, how: str) -> None:
    mount = ssd_mount(make_mount, tmp_path)
    root = mount.path
    (root / "bare").mkdir()  # saved just after: with the chown's commit below at the latest
    (root / "a" / "b" / "c").mkdir(parents=True)
    (root / "a" / "gone").mkdir()
    (root / "empty").mkdir()
    os.chown(root / "a", 1001, 1002)
    os.chmod(root / "a", 0o711)
    os.chown(root / "a" / "b", USER, USER)
    os.chmod(root / "a" / "b", 0o2770)  # setgid kept too
    os.chmod(root / "a" / "b" / "c", 0o700)
    os.chmod(root / "empty", 0o1777)
    os.utime(root / "empty", ns=(1_700_000_000_000_000_000, 1_700_000_000_123_456_789))
    (root / "a" / "b" / "c" / "f.bin").write_bytes(b"f" * MiB)
    sync(root)
    os.rename(root / "a", root / "top")  # one record rewritten; the file's record follows it
    os.rename(root / "top" / "b", root / "top" / "moved")
    os.rmdir(root / "top" / "gone")
    restart(mount, how)
    assert sorted(os.listdir(root)) == ["bare", "empty", "top"]
    assert owner_and_mode(root / "bare") == (0, 0, 0o755)
    assert sorted(os.listdir(root / "top")) == ["moved"]
    assert owner_and_mode(root / "top") == (1001, 1002, 0o711)
    assert owner_and_mode(root / "top" / "moved") == (USER, USER, 0o2770)
    assert owner_and_mode(root / "top" / "moved" / "c") == (0, 0, 0o700)
    assert (root / "top" / "moved" / "c" / "f.bin").read_bytes() == b"f" * MiB
    assert owner_and_mode(root / "empty") == (0, 0, 0o1777)
    assert os.listdir(root / "empty") == []
    assert (root / "empty").stat().st_mtime_ns == 1_700_000_000_123_456_789
    # A second restart: the records were rewritten under the new numbers, and still hold.
    os.chmod(root / "top", 0o755)
    (root / "top" / "moved" / "c").rename(root / "c")
    restart(mount, how)
    assert owner_and_mode(root / "top") == (1001, 1002, 0o755)
    assert owner_and_mode(root / "c") == (0, 0, 0o700)
    assert (root / "c" / "f.bin").read_bytes() == b"f" * MiB
    assert sorted(os.listdir(root)) == ["bare", "c", "empty", "top"]


def test_the_root_and_an_empty_directory(make_mount, tmp_path: Path) -> None:
    mount = ssd_mount(make_mount, tmp_path)
    root = mount.path
    os.chmod(root, 0o777)
    (root / "only").mkdir(0o705)
    os.chmod(root / "only", 0o705)
    restart(mount, "kill")
    assert stat.S_IMODE(root.stat().st_mode) == 0o777
    assert owner_and_mode(root / "only") == (0, 0, 0o705)
    assert os.listdir(root) == ["only"]


def dir_table(disk: Path) -> tuple[lmdb.Environment, object]:
    env = lmdb.open(str(disk / "index"), map_size=1 << 30, max_dbs=3)
    return env, env.open_db(b"dirs")


def keys_by_name(disk: Path) -> dict[bytes, bytes]:
    """Each directory record's key, by the directory's name (read with the mount stopped)."""
    import msgspec
    from kvfs.disk.records import DiskDir
    env, table = dir_table(disk)
    try:
        with env.begin(db=table) as txn:
            return {msgspec.msgpack.decode(value, type=DiskDir).name: bytes(key) for key, value in txn.cursor()}
    finally:
        env.close()


@pytest.mark.parametrize("damage", ["garbled", "absent", "invalid"])
def test_a_bad_directory_record_never_loses_files(make_mount, tmp_path: Path, damage: str) -> None:
    mount = ssd_mount(make_mount, tmp_path)
    root = mount.path
    (root / "d" / "e").mkdir(parents=True)
    os.chown(root / "d", USER, USER)
    os.chmod(root / "d", 0o700)
    os.chmod(root / "d" / "e", 0o750)
    (root / "d" / "e" / "x.bin").write_bytes(b"x" * 70000)
    (root / "kept").mkdir(0o711)
    os.chmod(root / "kept", 0o711)
    sync(root)
    mount.stop()
    key = keys_by_name(tmp_path / "disk")[b"d"]
    env, table = dir_table(tmp_path / "disk")
    with env.begin(db=table, write=True) as txn:
        if damage == "garbled":
            txn.put(key, b"\xc1 not msgpack")
        elif damage == "absent":
            txn.delete(key)
        else:  # decodes, but names a file's mode
            import msgspec
            from kvfs.disk.records import DiskDir
            record = msgspec.msgpack.decode(txn.get(key), type=DiskDir)
            record.mode = stat.S_IFREG | 0o644
            txn.put(key, msgspec.msgpack.encode(record))
    env.close()
    mount.start()
    # The file is back; "d" falls back to the mount's owner with mode 0755, its child keeps
    # its attributes only where its record's chain of parents still holds.
    assert (root / "d" / "e" / "x.bin").read_bytes() == b"x" * 70000
    assert owner_and_mode(root / "d") == (0, 0, 0o755)
    assert owner_and_mode(root / "kept") == (0, 0, 0o711)
    log = mount.log_text()
    assert "WARNING kvfs.node.dirrecords" in log
    assert "have no directory record" in log
    # The table was rewritten whole: the next restart is clean, with d as it is now.
    os.chmod(root / "d", 0o770)
    offset = len(mount.log_text())
    restart(mount, "stop")
    assert owner_and_mode(root / "d") == (0, 0, 0o770)
    assert "dirrecords" not in mount.log_text()[offset:]
    stats = json.loads(os.getxattr(root, "user.kvfs.stats"))
    assert stats["ssd_used"] > 0
