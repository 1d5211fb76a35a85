"""Timestamps, symbolic links and link counts as POSIX (and pjdfstest) expects them, checked
through real mounts of every kind: a single node, a node with an SSD tier, a cluster node."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
from conftest import Cluster, KvfsMount, _mount

NOBODY = 65534


@pytest.fixture(scope="module", params=["node", "ssd", "cluster"])
def mount_root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "cluster":
        cluster = Cluster(root)
        try:
            cluster.add_node("256M")
            yield cluster.nodes[0].path
        finally:
            errors = cluster.close()
        assert not errors, "kvfs logged unexpected errors:\n" + "\n".join(errors)
        return
    extra = ("--disk", str(root / "disk"), "--disk-size", "256M") if request.param == "ssd" else ()
    mount_dir = root / "mount"
    mount_dir.mkdir()
    mounts: Iterator[KvfsMount] = _mount(mount_dir, "256M", *extra)
    yield next(mounts).path
    next(mounts, None)


@pytest.fixture
def d(mount_root: Path) -> Path:
    """A fresh directory that a user other than root may also work in."""
    directory = mount_root / f"t-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    directory.chmod(0o777)
    return directory


def as_nobody(path: Path, function: Callable[..., object], *args: object) -> int:
    """Runs `function(path.name, *args)` in `path`'s directory as an unprivileged user (who
    could not walk the test's temporary path); returns the errno it failed with (0: none)."""
    pid = os.fork()
    if pid == 0:  # the child: only plain system calls, then _exit
        code = 0
        try:
            os.chdir(path.parent)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            function(path.name, *args)
        except OSError as error:
            code = error.errno or 255
        except BaseException:
            code = 255
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def times(path: Path | int, follow: bool = True) -> tuple[int, int]:
    st = os.stat(path, follow_symlinks=follow)
    return st.st_mtime_ns, st.st_ctime_ns


def changes_ctime(path: Path, operation: Callable[[], object]) -> int:
    """Runs the operation; asserts that it moved the ctime of `path` forward; returns the new one."""
    before = os.lstat(path).st_ctime_ns
    operation()
    after = os.lstat(path).st_ctime_ns
    assert after > before, f"ctime of {path.name} not updated ({before} -> {after})"
    return after


# ctime and mtime ------------------------------------------------------------------------


def test_write_and_ftruncate_on_a_descriptor_update_mtime_and_ctime(d: Path) -> None:
    path = d / "f"
    path.write_bytes(b"x")
    created = times(path)
    fd = os.open(path, os.O_RDWR)
    try:
        assert os.write(fd, b"abc") == 3
        written = times(fd)
        assert written[0] > created[0] and written[1] > created[1]
        os.ftruncate(fd, 123)  # pjdfstest ftruncate/00.t
        truncated = times(fd)
        assert truncated[0] > written[0] and truncated[1] > written[1] and os.fstat(fd).st_size == 123
        os.ftruncate(fd, 123)  # the same size: still a change (as ext4 and tmpfs do)
        assert times(fd)[1] > truncated[1]
        last = times(fd)
    finally:
        os.close(fd)
    assert times(path) == last  # close (the seal) keeps them
    path.read_bytes()
    assert times(path) == last  # a read changes neither


def test_a_duplicate_descriptor_writes_on_after_another_is_closed(d: Path) -> None:
    """A shell's `echo test > f` opens f, dup2s it to stdout and closes the original (pjdfstest
    open/00.t): that close ends nothing, the file is sealed when its last duplicate is closed."""
    path = d / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    duplicate = os.dup(fd)
    os.close(fd)
    try:
        assert os.write(duplicate, b"test\n") == 5
        assert os.fstat(duplicate).st_size == 5 and path.stat().st_size == 5
        os.ftruncate(duplicate, 3)
        assert os.write(duplicate, b"!") == 1  # at offset 5: a hole of two bytes
    finally:
        os.close(duplicate)
    assert path.read_bytes() == b"tes\0\0!"
    result = subprocess.run(["sh", "-c", f"echo test > '{path}'"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stderr == "" and path.read_bytes() == b"test\n"


def test_truncate_chmod_chown_utimens_and_xattrs_update_ctime(d: Path) -> None:
    path = d / "f"
    path.write_bytes(b"0123456789")
    changes_ctime(path, lambda: os.truncate(path, 4))
    assert path.stat().st_size == 4
    changes_ctime(path, lambda: os.chmod(path, 0o600))
    changes_ctime(path, lambda: os.chown(path, 1234, 5678))
    changes_ctime(path, lambda: os.chown(path, 0, 0))
    ctime = changes_ctime(path, lambda: os.utime(path, ns=(1_000_000_000, 2_000_000_000)))
    assert path.stat().st_mtime_ns == 2_000_000_000 and ctime > 2_000_000_000
    changes_ctime(path, lambda: os.setxattr(path, "user.k", b"v"))
    changes_ctime(path, lambda: os.removexattr(path, "user.k"))


def test_utimens_on_an_open_file_survives_its_close(d: Path) -> None:
    path = d / "f"
    with open(path, "wb", buffering=0) as f:
        f.write(b"data")
        os.utime(path, ns=(3_000_000_000, 4_000_000_000))
        ctime = os.stat(path).st_ctime_ns
    st = path.stat()
    assert st.st_mtime_ns == 4_000_000_000 and st.st_ctime_ns >= ctime > 4_000_000_000


def test_failed_changes_leave_ctime_alone(d: Path) -> None:
    path = d / "f"
    path.write_bytes(b"0123456789")
    path.chmod(0o644)
    before = os.stat(path)
    assert as_nobody(path, os.truncate, 1) == errno.EACCES
    assert as_nobody(path, os.chmod, 0o777) == errno.EPERM
    assert as_nobody(path, os.chown, NOBODY, NOBODY) == errno.EPERM
    assert as_nobody(path, os.utime, (1, 1)) == errno.EPERM
    assert as_nobody(path, os.setxattr, "user.k", b"v") == errno.EACCES
    after = os.stat(path)
    assert (after.st_ctime_ns, after.st_mtime_ns, after.st_size, after.st_mode) == \
        (before.st_ctime_ns, before.st_mtime_ns, before.st_size, before.st_mode)


def test_rename_updates_the_file_and_both_directories(d: Path) -> None:
    (d / "a").mkdir()
    (d / "b").mkdir()
    (d / "a" / "f").write_bytes(b"x")
    (d / "b" / "old").write_bytes(b"y")
    file_ctime, a, b = os.stat(d / "a" / "f").st_ctime_ns, times(d / "a"), times(d / "b")
    with open(d / "b" / "old", "rb") as replaced:
        replaced_ctime = os.fstat(replaced.fileno()).st_ctime_ns
        os.rename(d / "a" / "f", d / "b" / "old")
        st = os.fstat(replaced.fileno())
        assert st.st_nlink == 0 and st.st_ctime_ns > replaced_ctime  # the replaced file lost its name
    assert os.stat(d / "b" / "old").st_ctime_ns > file_ctime
    for before, after in ((a, times(d / "a")), (b, times(d / "b"))):
        assert after[0] > before[0] and after[1] > before[1]
    # A directory moved to another parent: its ".." changed.
    (d / "a" / "sub").mkdir()
    sub = os.stat(d / "a" / "sub").st_ctime_ns
    os.rename(d / "a" / "sub", d / "b" / "sub")
    assert os.stat(d / "b" / "sub").st_ctime_ns > sub


def test_entries_added_and_removed_update_the_directory(d: Path) -> None:
    def updates_directory(operation: Callable[[], object]) -> None:
        before = times(d)
        operation()
        after = times(d)
        assert after[0] > before[0] and after[1] > before[1], f"{before} -> {after}"

    updates_directory(lambda: (d / "f").write_bytes(b"x"))
    updates_directory(lambda: (d / "sub").mkdir())
    updates_directory(lambda: os.symlink("f", d / "l"))
    updates_directory(lambda: os.rename(d / "f", d / "g"))
    updates_directory(lambda: os.unlink(d / "l"))
    updates_directory(lambda: os.rmdir(d / "sub"))
    with open(d / "g", "rb") as f:
        ctime = os.fstat(f.fileno()).st_ctime_ns
        updates_directory(lambda: os.unlink(d / "g"))
        st = os.fstat(f.fileno())
        assert st.st_nlink == 0 and st.st_ctime_ns > ctime
    before = times(d)
    (d / "absent").exists()
    os.listdir(d)
    assert times(d) == before  # lookups and listings change nothing


# Symbolic links -------------------------------------------------------------------------


def test_symlink_readlink_lstat_and_following(d: Path) -> None:
    (d / "target").write_bytes(b"through the link")
    os.symlink("target", d / "link")
    assert os.readlink(d / "link") == "target"
    st = os.lstat(d / "link")
    assert stat.S_ISLNK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o777
    assert st.st_size == len("target") and st.st_nlink == 1 and (st.st_uid, st.st_gid) == (os.getuid(), os.getgid())
    assert (d / "link").read_bytes() == b"through the link"
    assert os.stat(d / "link").st_ino == os.stat(d / "target").st_ino
    with open(d / "link", "ab") as f:  # writes go to the target
        f.write(b"!")
    assert (d / "target").read_bytes() == b"through the link!"
    entries = {entry.name: entry for entry in os.scandir(d)}
    assert entries["link"].is_symlink() and not entries["target"].is_symlink()
    with pytest.raises(OSError) as raised:
        os.open(d / "link", os.O_RDONLY | os.O_NOFOLLOW)
    assert raised.value.errno == errno.ELOOP
    with pytest.raises(OSError) as raised:
        os.readlink(d / "target")
    assert raised.value.errno == errno.EINVAL
    with pytest.raises(FileExistsError):
        os.symlink("elsewhere", d / "target")


def test_dangling_absolute_and_long_targets(d: Path) -> None:
    os.symlink("nowhere", d / "dangling")
    assert os.lstat(d / "dangling") and not (d / "dangling").exists()
    with pytest.raises(FileNotFoundError):
        (d / "dangling").read_bytes()
    (d / "dangling").write_bytes(b"made")  # creating through a dangling link creates its target
    assert (d / "nowhere").read_bytes() == b"made"
    (d / "sub").mkdir()
    (d / "sub" / "f").write_bytes(b"in sub")
    os.symlink(str(d / "sub"), d / "absolute")
    assert (d / "absolute" / "f").read_bytes() == b"in sub" and sorted(os.listdir(d / "absolute")) == ["f"]
    longest = "x/" * 2047 + "y"  # 4095 bytes: PATH_MAX - 1
    os.symlink(longest, d / "longest")
    assert os.readlink(d / "longest") == longest and os.lstat(d / "longest").st_size == 4095
    with pytest.raises(OSError) as raised:
        os.symlink(longest + "z", d / "too-long")
    assert raised.value.errno == errno.ENAMETOOLONG
    with pytest.raises(FileNotFoundError):
        os.symlink("", d / "empty")


def test_symlinks_rename_unlink_and_own_attributes(d: Path) -> None:
    (d / "f").write_bytes(b"file")
    os.symlink("f", d / "l")
    before = os.lstat(d / "l")
    os.rename(d / "l", d / "m")
    after = os.lstat(d / "m")
    assert after.st_ino == before.st_ino and after.st_ctime_ns > before.st_ctime_ns
    assert os.readlink(d / "m") == "f" and not os.path.lexists(d / "l")
    (d / "other").write_bytes(b"other")
    os.rename(d / "other", d / "m")  # a file replaces the link
    assert not os.path.islink(d / "m") and (d / "m").read_bytes() == b"other"
    os.symlink("f", d / "n")
    os.rename(d / "n", d / "m")  # and a link a file
    assert os.readlink(d / "m") == "f" and (d / "f").read_bytes() == b"file"
    changes_ctime(d / "m", lambda: os.chown(d / "m", 1234, 5678, follow_symlinks=False))
    assert (os.lstat(d / "m").st_uid, os.stat(d / "f").st_uid) == (1234, os.getuid())
    os.utime(d / "m", ns=(5_000_000_000, 6_000_000_000), follow_symlinks=False)
    assert os.lstat(d / "m").st_mtime_ns == 6_000_000_000 and os.stat(d / "f").st_mtime_ns != 6_000_000_000
    os.unlink(d / "m")
    assert not os.path.lexists(d / "m") and (d / "f").read_bytes() == b"file"


def test_hard_links_and_special_files_are_refused(d: Path) -> None:
    (d / "f").write_bytes(b"x")
    os.symlink("f", d / "l")
    for operation in (lambda: os.link(d / "f", d / "h"), lambda: os.mkfifo(d / "p"),
                      lambda: os.link(d / "l", d / "h2", follow_symlinks=False)):
        with pytest.raises(OSError) as raised:
            operation()
        assert raised.value.errno == errno.EPERM
    assert os.stat(d / "f").st_nlink == 1 and sorted(os.listdir(d)) == ["f", "l"]


# Link counts ----------------------------------------------------------------------------


def test_directory_link_count_is_two_plus_subdirectories(d: Path) -> None:
    def nlink(path: Path) -> int:
        return os.stat(path).st_nlink

    assert nlink(d) == 2
    (d / "f").write_bytes(b"x")
    os.symlink("f", d / "l")
    assert nlink(d) == 2  # files and links do not count
    for name in ("a", "b", "c"):
        (d / name).mkdir()
    assert nlink(d) == 5 and nlink(d / "a") == 2
    os.rename(d / "c", d / "a" / "c")  # pjdfstest rename/24.t
    assert (nlink(d), nlink(d / "a")) == (4, 3)
    os.rename(d / "b", d / "a" / "c")  # replaces an empty directory
    assert (nlink(d), nlink(d / "a")) == (3, 3)
    os.rmdir(d / "a" / "c")
    assert nlink(d / "a") == 2
    root = d.parent
    assert nlink(root) == 2 + sum(1 for entry in os.scandir(root) if entry.is_dir(follow_symlinks=False))
    assert len({os.stat(d).st_ino, os.stat(d / "a" / "..").st_ino}) == 1
