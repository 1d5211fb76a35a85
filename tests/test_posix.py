"""POSIX behaviour through a real mount: every operation KV consumers and tools use."""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import subprocess
from pathlib import Path

import pytest

libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
RENAME_NOREPLACE = 1


def renameat2(old: Path, new: Path, flags: int) -> None:
    if libc.renameat2(AT_FDCWD, bytes(old), AT_FDCWD, bytes(new), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(new))


def raises(code: int, function, *args) -> None:
    with pytest.raises(OSError) as raised:
        function(*args)
    assert raised.value.errno == code, f"expected {errno.errorcode[code]}, got {raised.value}"


def test_create_write_read_stat(kvfs_dir: Path) -> None:
    path = kvfs_dir / "block.bin"
    data = os.urandom(3 * 1024 * 1024 + 17)
    path.write_bytes(data)
    assert path.read_bytes() == data
    st = path.stat()
    assert st.st_size == len(data) and stat.S_ISREG(st.st_mode) and st.st_nlink == 1
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(st.st_mode) == 0o666 & ~umask


def test_create_exclusive(kvfs_dir: Path) -> None:
    path = kvfs_dir / "x"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.close(fd)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    raises(errno.EEXIST, os.open, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)


def test_missing_names(kvfs_dir: Path) -> None:
    raises(errno.ENOENT, os.stat, kvfs_dir / "absent")
    raises(errno.ENOENT, os.open, kvfs_dir / "absent", os.O_RDONLY)
    raises(errno.ENOENT, os.unlink, kvfs_dir / "absent")
    assert not os.access(kvfs_dir / "absent", os.F_OK)
    (kvfs_dir / "absent").write_bytes(b"now here")  # a cached negative entry does not hide a new file
    assert os.access(kvfs_dir / "absent", os.F_OK)


def test_mkdir_rmdir(kvfs_dir: Path) -> None:
    d = kvfs_dir / "a"
    d.mkdir()
    raises(errno.EEXIST, os.mkdir, d)
    (d / "f").write_bytes(b"1")
    raises(errno.ENOTEMPTY, os.rmdir, d)
    raises(errno.ENOTDIR, os.rmdir, d / "f")
    raises(errno.ENOTDIR, os.mkdir, d / "f" / "sub")
    raises(errno.EISDIR, os.unlink, d)
    raises(errno.EISDIR, os.open, d, os.O_WRONLY)
    os.unlink(d / "f")
    os.rmdir(d)
    assert not d.exists()
    os.makedirs(kvfs_dir / "x" / "y" / "z", exist_ok=True)
    os.makedirs(kvfs_dir / "x" / "y" / "z", exist_ok=True)


def test_name_and_path_limits(kvfs_dir: Path) -> None:
    raises(errno.ENAMETOOLONG, os.open, kvfs_dir / ("n" * 256), os.O_WRONLY | os.O_CREAT, 0o644)
    raises(errno.ENAMETOOLONG, os.mkdir, kvfs_dir / ("n" * 256))
    raises(errno.ENAMETOOLONG, os.stat, kvfs_dir / ("n" * 256))
    (kvfs_dir / ("n" * 255)).write_bytes(b"ok")
    deep = str(kvfs_dir) + ("/" + "d" * 200) * 21
    raises(errno.ENAMETOOLONG, os.makedirs, deep)


def test_rename_overwrite_and_noreplace(kvfs_dir: Path) -> None:
    (kvfs_dir / "a").write_bytes(b"A")
    (kvfs_dir / "b").write_bytes(b"B")
    raises(errno.EEXIST, renameat2, kvfs_dir / "a", kvfs_dir / "b", RENAME_NOREPLACE)
    os.rename(kvfs_dir / "a", kvfs_dir / "b")
    assert (kvfs_dir / "b").read_bytes() == b"A" and not (kvfs_dir / "a").exists()
    renameat2(kvfs_dir / "b", kvfs_dir / "c", RENAME_NOREPLACE)
    assert (kvfs_dir / "c").read_bytes() == b"A"
    (kvfs_dir / "d1").mkdir()
    (kvfs_dir / "d2").mkdir()
    (kvfs_dir / "d2" / "f").write_bytes(b"")
    raises(errno.ENOTEMPTY, os.rename, kvfs_dir / "d1", kvfs_dir / "d2")
    raises(errno.EISDIR, os.rename, kvfs_dir / "c", kvfs_dir / "d1")
    raises(errno.ENOTDIR, os.rename, kvfs_dir / "d1", kvfs_dir / "c")
    raises(errno.EINVAL, os.rename, kvfs_dir / "d2", kvfs_dir / "d2" / "inside")
    os.rename(kvfs_dir / "d2", kvfs_dir / "d1")
    assert (kvfs_dir / "d1" / "f").exists()


def test_truncate_and_open_trunc(kvfs_dir: Path) -> None:
    path = kvfs_dir / "t"
    path.write_bytes(b"0123456789")
    os.truncate(path, 4)
    assert path.read_bytes() == b"0123"
    os.truncate(path, 8)
    assert path.read_bytes() == b"0123" + bytes(4)
    with open(path, "r+b") as f:
        f.truncate(2)
        f.seek(5)
        f.write(b"x")
    assert path.read_bytes() == b"01\0\0\0x"
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    os.close(fd)
    assert path.stat().st_size == 0 and path.read_bytes() == b""


def test_copy_on_write_keeps_open_readers_on_old_bytes(kvfs_dir: Path) -> None:
    path = kvfs_dir / "f"
    path.write_bytes(b"old" * 1000)
    with open(path, "rb", buffering=0) as reader:
        assert reader.read(3) == b"old"
        with open(path, "r+b") as writer:
            writer.write(b"NEW")
        assert path.read_bytes()[:6] == b"NEWold"
        assert reader.read(6) == b"oldold"  # the reader still sees the version it opened


def test_append_and_random_writes(kvfs_dir: Path) -> None:
    path = kvfs_dir / "log"
    with open(path, "ab") as f:
        f.write(b"one\n")
    with open(path, "ab") as f:
        f.write(b"two\n")
    assert path.read_bytes() == b"one\ntwo\n"
    fd = os.open(path, os.O_RDWR)
    os.pwrite(fd, b"X", 6 * 1024 * 1024)
    assert os.pread(fd, 4, 0) == b"one\n"
    assert os.fstat(fd).st_size == 6 * 1024 * 1024 + 1
    os.close(fd)
    data = path.read_bytes()
    assert data[:8] == b"one\ntwo\n" and data[8:-1] == bytes(len(data) - 9) and data[-1:] == b"X"


def test_readdir_lists_everything_once(kvfs_dir: Path) -> None:
    names = {f"k{i:04d}.bin" for i in range(1000)}
    for name in names:
        (kvfs_dir / name).write_bytes(b"")
    (kvfs_dir / "sub").mkdir()
    assert sorted(os.listdir(kvfs_dir)) == sorted(names | {"sub"})
    entries = {e.name: e.is_dir() for e in os.scandir(kvfs_dir)}
    assert entries["sub"] is True and entries["k0000.bin"] is False
    result = subprocess.run(["ls", "-la", str(kvfs_dir)], capture_output=True, text=True, check=True)
    assert "k0999.bin" in result.stdout


def test_chmod_chown_utimens(kvfs_dir: Path) -> None:
    path = kvfs_dir / "f"
    path.write_bytes(b"x")
    os.chmod(path, 0o600)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    os.chown(path, 1234, 5678)
    assert (path.stat().st_uid, path.stat().st_gid) == (1234, 5678)
    os.utime(path, ns=(1_000_000_000, 2_000_000_000))
    st = path.stat()
    assert (st.st_atime_ns, st.st_mtime_ns) == (1_000_000_000, 2_000_000_000)


def test_user_xattrs_and_virtual_ones(kvfs_dir: Path) -> None:
    path = kvfs_dir / "f"
    data = os.urandom(5 * 1024 * 1024)
    path.write_bytes(data)
    os.setxattr(path, "user.vllm_kv_crc32", b"deadbeef")
    assert os.getxattr(path, "user.vllm_kv_crc32") == b"deadbeef"
    names = os.listxattr(path)
    assert "user.vllm_kv_crc32" in names and "user.kvfs.tier" in names
    assert os.getxattr(path, "user.kvfs.tier") == b"dram"
    assert os.getxattr(path, "user.kvfs.size") == str(len(data)).encode()
    assert os.getxattr(path, "user.kvfs.chunks") == b"2"
    import xxhash

    expected = [f"xxh3:{xxhash.xxh3_64_intdigest(data[i:i + 4 << 20]):016x}" for i in (0, 4 << 20)]
    assert os.getxattr(path, "user.kvfs.checksum").decode().split(",") == expected
    path.read_bytes()
    assert int(os.getxattr(path, "user.kvfs.hits")) >= 1
    raises(errno.EPERM, os.setxattr, path, "user.kvfs.tier", b"ssd")
    raises(errno.ENODATA, os.getxattr, path, "user.nothing")
    raises(errno.ENOTSUP, os.setxattr, path, "trusted.x", b"1")
    os.removexattr(path, "user.vllm_kv_crc32")
    raises(errno.ENODATA, os.getxattr, path, "user.vllm_kv_crc32")
    dump = subprocess.run(["getfattr", "-d", "-m", "-", str(path)], capture_output=True, text=True, check=True)
    assert 'user.kvfs.tier="dram"' in dump.stdout


def test_statfs_is_truthful(shared_mount, kvfs_dir: Path) -> None:
    before = os.statvfs(kvfs_dir)
    assert before.f_bsize == 4096 and before.f_frsize == 4096 and before.f_namemax == 255
    assert before.f_blocks * before.f_frsize == 1 << 30
    (kvfs_dir / "big").write_bytes(os.urandom(8 << 20))
    after = os.statvfs(kvfs_dir)
    assert (before.f_bfree - after.f_bfree) * 4096 == 8 << 20
    os.unlink(kvfs_dir / "big")
    assert os.statvfs(kvfs_dir).f_bfree == before.f_bfree


def test_unsupported_node_types_fail_cleanly(kvfs_dir: Path) -> None:
    (kvfs_dir / "f").write_bytes(b"x")
    raises(errno.EPERM, os.link, kvfs_dir / "f", kvfs_dir / "h")
    raises(errno.EPERM, os.mkfifo, kvfs_dir / "p")


def test_o_direct_reads_and_writes(kvfs_dir: Path) -> None:
    import mmap

    size = 2 << 20
    buffer = mmap.mmap(-1, size)
    buffer.write(os.urandom(size))
    path = kvfs_dir / "direct.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    assert os.write(fd, buffer) == size
    os.close(fd)
    target = mmap.mmap(-1, size)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    assert os.readv(fd, [target]) == size
    os.close(fd)
    assert target[:] == buffer[:]


def test_fsync_flush_and_unlinked_open_file(kvfs_dir: Path) -> None:
    path = kvfs_dir / "f"
    with open(path, "wb") as f:
        f.write(b"data")
        f.flush()
        os.fsync(f.fileno())
    with open(path, "rb") as f:
        os.unlink(path)
        assert os.fstat(f.fileno()).st_nlink == 0
        assert f.read() == b"data"
    assert not path.exists()
