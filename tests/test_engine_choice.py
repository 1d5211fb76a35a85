"""Choosing the SSD I/O engine: io_uring is proven in a child process, so an extension that
crashes (SIGILL on a CPU without the instructions it was built for) never takes the daemon down."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import small_tmpfs

from kvfs.disk.probe import open_engine, probe_io_uring

CRASHING_EXTENSION = """
#include <Python.h>
/* Dies the way a wheel built for AVX-512 dies on a CPU without it: an illegal instruction. */
PyMODINIT_FUNC PyInit_liburing(void) { __builtin_trap(); return NULL; }
"""


@pytest.fixture
def crashing_liburing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A native `liburing` module that dies with SIGILL when imported, first on PYTHONPATH."""
    directory = tmp_path / "crashing"
    directory.mkdir()
    source = directory / "fake.c"
    source.write_text(CRASHING_EXTENSION)
    target = directory / f"liburing{sysconfig.get_config_var('EXT_SUFFIX')}"
    subprocess.run(["gcc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(source),
                    "-o", str(target)], check=True)
    crash = subprocess.run([sys.executable, "-c", "import liburing"], env={**os.environ, "PYTHONPATH": str(directory)},
                           capture_output=True)
    assert crash.returncode == -4, "the stand-in extension must really die with SIGILL"
    monkeypatch.setenv("PYTHONPATH", str(directory))
    return directory


def test_io_uring_is_proven_and_chosen_on_this_machine() -> None:
    assert probe_io_uring() is None
    engine = open_engine("auto")
    try:
        assert engine.kind == "io_uring"
    finally:
        engine.close()


@pytest.mark.parametrize("full", ["inodes", "bytes"])
def test_a_full_file_system_does_not_cost_io_uring(tmp_path: Path, full: str) -> None:
    """A node restarted on a full disk keeps io_uring: a write refused for want of space ran
    through the ring, and a directory where not even the scratch file fits is probed elsewhere."""
    with small_tmpfs(tmp_path / "fs", "1m,nr_inodes=16") as directory:
        with pytest.raises(OSError) as raised:
            if full == "inodes":
                for i in range(100):
                    (directory / f"f{i}").touch()
            else:
                with open(directory / "filler", "wb") as f:
                    for _ in range(100):
                        f.write(bytes(65536))
                        f.flush()
        assert raised.value.errno == errno.ENOSPC
        assert probe_io_uring(directory) is None
        open_engine("io_uring", directory).close()


def test_the_probe_names_a_crash_and_auto_falls_back(crashing_liburing: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    reason = probe_io_uring()
    assert reason is not None and "SIGILL" in reason
    engine = open_engine("auto")
    assert engine.kind == "threads"
    warnings = [record for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "SIGILL" in warnings[0].getMessage()


def test_a_mount_survives_a_crashing_io_uring_binding(crashing_liburing: Path, make_mount, tmp_path: Path) -> None:
    mount = make_mount("64M", "--disk", str(tmp_path / "disk"), "--disk-size", "256M")
    log = mount.log_text()
    fallbacks = [line for line in log.splitlines() if "io_uring is unavailable" in line]
    assert len(fallbacks) == 1 and " WARNING " in fallbacks[0] and "SIGILL" in fallbacks[0]
    data = os.urandom(3 << 20)
    (mount.path / "block.bin").write_bytes(data)
    os.setxattr(mount.path, "user.kvfs.control", b"flush")
    os.setxattr(mount.path, "user.kvfs.control", b"drop-dram")
    assert os.getxattr(mount.path / "block.bin", "user.kvfs.tier") == b"ssd"
    assert (mount.path / "block.bin").read_bytes() == data  # served by the thread engine from SSD
    stats = json.loads(os.getxattr(mount.path, "user.kvfs.stats"))
    assert stats["io_engine"] == "threads"
    status = subprocess.run([sys.executable, "-m", "kvfs", "status", str(mount.path)], capture_output=True,
                            text=True, timeout=30, check=True).stdout
    assert "threads" in status.splitlines()[2]


def test_io_uring_required_refuses_to_start_with_the_reason(crashing_liburing: Path, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = subprocess.run([sys.executable, "-m", "kvfs", "mount", str(mountpoint), "--foreground", "--dram", "64M",
                             "--disk", str(tmp_path / "disk"), "--disk-size", "256M", "--io-engine", "io_uring"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "io_engine io_uring: unavailable here: the liburing extension died with SIGILL" in result.stderr
    assert "Traceback" not in result.stderr


def test_an_ssd_mount_reports_its_engine(make_mount, tmp_path: Path) -> None:
    mount = make_mount("64M", "--disk", str(tmp_path / "disk"), "--disk-size", "256M")
    assert json.loads(os.getxattr(mount.path, "user.kvfs.stats"))["io_engine"] == "io_uring"
    assert "io_uring is unavailable" not in mount.log_text()
    status = subprocess.run([sys.executable, "-m", "kvfs", "status", str(mount.path)], capture_output=True,
                            text=True, timeout=30, check=True).stdout
    header, row = status.splitlines()[1:3]
    assert header.split()[-2:] == ["SSD", "I/O"] and row.split()[-1] == "io_uring"


def test_the_probe_runs_in_the_tier_directory_and_names_it_when_it_cannot_write(tmp_path: Path) -> None:
    assert probe_io_uring(tmp_path) is None
    assert [entry.name for entry in tmp_path.iterdir()] == []  # the scratch file is gone
    reason = probe_io_uring(Path("/proc/self"))
    assert reason is not None and reason.startswith("cannot write a scratch file in /proc/self:")


def test_the_probe_reason_is_the_childs_verdict_not_its_traceback(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "liburing.py").write_text("raise OSError(13, 'Permission denied')\n")
    monkeypatch.setenv("PYTHONPATH", str(broken))
    disk = tmp_path / "disk"
    disk.mkdir()
    assert probe_io_uring(disk) == "liburing is not importable: PermissionError: [Errno 13] Permission denied"
    assert list(disk.iterdir()) == []  # the scratch directory is removed by the parent


def test_a_child_killed_by_a_signal_leaves_no_scratch_directory(crashing_liburing: Path, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    assert "SIGILL" in (probe_io_uring(disk) or "")
    assert list(disk.iterdir()) == []
