"""The command line and the mount lifecycle: background mount, umount, signals, stale mounts."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvfs import __version__
from kvfs.fuse.mount import find_mount

KVFS = [sys.executable, "-m", "kvfs"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVFS, *args], capture_output=True, text=True, timeout=timeout)


def test_version() -> None:
    result = run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"kvfs {__version__}"


def test_background_mount_and_umount(tmp_path: Path) -> None:
    mountpoint, log = tmp_path / "mnt", tmp_path / "kvfs.log"
    result = run("mount", str(mountpoint), "--dram", "64M", "--log-file", str(log))
    try:
        assert result.returncode == 0, result.stderr
        assert f"kvfs mounted on {mountpoint}" in result.stdout
        info = find_mount(str(mountpoint))
        assert info is not None and info.fstype == "fuse.kvfs"
        (mountpoint / "f").write_bytes(b"hello")
        assert (mountpoint / "f").read_bytes() == b"hello"
        assert os.statvfs(mountpoint).f_blocks * 4096 == 64 << 20
        again = run("mount", str(mountpoint), "--dram", "64M", "--log-file", str(tmp_path / "second.log"))
        assert again.returncode == 1 and "already mounted" in again.stderr
    finally:
        unmounted = run("umount", str(mountpoint))
    assert unmounted.returncode == 0, unmounted.stderr
    assert find_mount(str(mountpoint)) is None
    assert "is ready" in log.read_text() and "unmounted" in log.read_text()


def test_sigint_unmounts_cleanly(make_mount) -> None:
    mount = make_mount("64M")
    (mount.path / "f").write_bytes(b"x")
    mount.process.send_signal(signal.SIGINT)
    assert mount.process.wait(timeout=30) == 0
    assert find_mount(str(mount.path)) is None
    assert "received SIGINT, unmounting" in mount.log_text()


def test_stale_mount_is_cleaned_on_next_mount(make_mount) -> None:
    mount = make_mount("64M")
    mount.kill()
    with pytest.raises(OSError) as raised:
        os.statvfs(mount.path)
    assert raised.value.errno == errno.ENOTCONN
    mount.start()  # the same mount point again
    assert "stale mount" in mount.log_text()
    (mount.path / "g").write_bytes(b"fresh")
    assert os.listdir(mount.path) == ["g"]


def test_invalid_arguments_give_clear_errors(tmp_path: Path) -> None:
    result = run("mount", str(tmp_path / "m"), "--dram", "lots", "-f")
    assert result.returncode == 1 and "--dram: cannot parse size 'lots'" in result.stderr
    result = run("mount", str(tmp_path / "m"), "--dram", "1M", "-f")
    assert result.returncode == 1 and "below the 16 MiB minimum" in result.stderr
    result = run("umount", str(tmp_path))
    assert result.returncode == 1 and "is not a kvfs mount" in result.stderr
    (tmp_path / "file").write_bytes(b"")
    result = run("mount", str(tmp_path / "file"), "--dram", "64M", "--log-file", str(tmp_path / "l.log"))
    assert result.returncode == 1 and "not a directory" in result.stderr
