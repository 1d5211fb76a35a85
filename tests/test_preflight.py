"""The preflight and the command's failures: each bad input is refused with one line on stderr,
`kvfs: error: …` naming the path or address and the cause, a non-zero exit, within seconds."""

from __future__ import annotations

import errno
import os
import pty
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from conftest import KvfsMount, MasterDaemon, foreign_tls, small_tmpfs, tls_dir, wait_until
from kvfs.fuse.mount import find_mount
from kvfs.preflight import FAIL, OK, available_memory, check_memory

KVFS = [sys.executable, "-m", "kvfs"]
BOUND_S = 15  # a refusal comes within this, on a loaded machine
NODE_TLS = tls_dir("preflight-node")


def refused(*args: str, tls: str | None = None, bound: float = BOUND_S) -> str:
    """Runs kvfs expecting a refusal (with the bundle TLS, else the tests' admin bundle);
    returns its one line of stderr."""
    env = dict(os.environ)
    if tls is not None:
        env["KVFS_TLS_DIR"] = tls
    started = time.monotonic()
    result = subprocess.run([*KVFS, *args], capture_output=True, text=True, timeout=bound + 30, env=env)
    elapsed = time.monotonic() - started
    lines = result.stderr.splitlines()
    assert result.returncode != 0, result.stdout + result.stderr
    assert len(lines) == 1 and lines[0].startswith("kvfs: error: "), result.stderr
    assert "Traceback" not in result.stderr and elapsed < bound, (elapsed, result.stderr)
    return lines[0]


def daemons_of(path: Path) -> list[int]:
    """Processes whose command line names `path` (a daemon that should have exited)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(path).encode() in cmdline:
            found.append(int(pid))
    return found


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 128 MiB tmpfs: a disk whose free space is known and small."""
    with small_tmpfs(tmp_path / "disk", "128M") as disk:
        yield disk


def test_unreachable_master_in_the_background_fails_after_the_stated_timeout(tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    line = refused("node", "--master", "127.0.0.1:1", "--mount", str(mountpoint), "--dram", "64M",
                   "--start-timeout", "3", "--log-file", str(tmp_path / "log"), tls=NODE_TLS)
    assert f"{mountpoint}: the daemon was not up within 3 s" in line
    assert "master 127.0.0.1:1: cannot register (Connection refused)" in line and "--start-timeout" in line
    assert not daemons_of(mountpoint) and find_mount(str(mountpoint)) is None


def test_a_background_start_shows_its_progress_on_a_terminal(tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    terminal, stderr = pty.openpty()
    started = time.monotonic()
    process = subprocess.Popen([*KVFS, "node", "--master", "127.0.0.1:1", "--mount", str(mountpoint), "--dram", "64M",
                                "--start-timeout", "7", "--log-file", str(tmp_path / "log")],
                               stdout=subprocess.DEVNULL, stderr=stderr, env={**os.environ, "KVFS_TLS_DIR": NODE_TLS})
    os.close(stderr)
    shown = b""
    deadline = time.monotonic() + 30
    try:
        while True:
            ready, _, _ = select.select([terminal], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"the command wrote nothing and did not exit within 30 s: {shown!r}"
            try:
                chunk = os.read(terminal, 4096)
            except OSError:  # the pty's other end closed: the command exited
                break
            if not chunk:
                break
            shown += chunk
        assert process.wait(timeout=30) == 1
    finally:
        os.close(terminal)
        if process.poll() is None:
            process.kill()
            process.wait()
    lines = shown.decode().splitlines()
    assert time.monotonic() - started < BOUND_S
    progress = [line for line in lines if line.startswith("kvfs: master 127.0.0.1:1: cannot register")]
    assert len(progress) >= 2, lines  # every 5 s while it waits
    assert lines[-1].startswith(f"kvfs: error: {mountpoint}: the daemon was not up within 7 s"), lines


def test_unreachable_master_in_the_foreground_is_reported_every_few_seconds(tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    process = subprocess.Popen([*KVFS, "node", "--master", "127.0.0.1:1", "--mount", str(mountpoint), "-f",
                                "--dram", "64M"], stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "KVFS_TLS_DIR": NODE_TLS})
    try:
        reports = []
        deadline = time.monotonic() + 30
        while len(reports) < 3 and time.monotonic() < deadline:
            line = process.stderr.readline()  # type: ignore[union-attr]
            if "cannot register" in line:
                reports.append((time.monotonic(), line))
        assert len(reports) == 3, reports
        assert all("master 127.0.0.1:1: cannot register (Connection refused); retrying" in r[1] for r in reports)
        gaps = [later[0] - earlier[0] for earlier, later in zip(reports, reports[1:])]
        assert all(3 < gap < 10 for gap in gaps), gaps
    except BaseException:
        process.kill()
        process.wait()
        raise
    assert_stops_on_sigint(process, timeout=15)


def test_a_node_started_with_sigint_ignored_stops_on_it_while_it_registers(tmp_path: Path) -> None:
    # `trap '' INT` then exec: what a shell's `&` gives its jobs (the suite run that way once
    # left the test above waiting on a node that kept retrying).
    process = subprocess.Popen(["bash", "-c", "trap '' INT; exec \"$@\"", "kvfs", *KVFS, "node", "--master",
                                "127.0.0.1:1", "--mount", str(tmp_path / "mnt"), "-f", "--dram", "64M"],
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "KVFS_TLS_DIR": NODE_TLS})
    try:
        deadline = time.monotonic() + 30
        line = ""
        while "cannot register" not in line and time.monotonic() < deadline and process.poll() is None:
            line = process.stderr.readline()  # type: ignore[union-attr]
        assert "cannot register" in line, line
    except BaseException:
        process.kill()
        process.wait()
        raise
    assert_stops_on_sigint(process, timeout=BOUND_S)


def assert_stops_on_sigint(process: subprocess.Popen, timeout: float) -> None:
    """A foreground node told SIGINT exits 130 with one line and no traceback."""
    process.send_signal(signal.SIGINT)
    try:
        rest = process.communicate(timeout=timeout)[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130 and rest.splitlines()[-1] == "kvfs: error: node: interrupted", rest
    assert "Traceback" not in rest


def test_a_background_daemon_interrupted_while_it_registers(tmp_path: Path) -> None:
    mountpoint, log = tmp_path / "mnt", tmp_path / "log"
    process = subprocess.Popen([*KVFS, "node", "--master", "127.0.0.1:1", "--mount", str(mountpoint), "--dram", "64M",
                                "--log-file", str(log)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "KVFS_TLS_DIR": NODE_TLS})
    try:
        wait_until(lambda: log.exists() and "cannot register" in log.read_text(), "the daemon's first retry",
                   timeout=30)
        daemons = [pid for pid in daemons_of(mountpoint) if pid != process.pid]
        assert len(daemons) == 1, daemons
        os.kill(daemons[0], signal.SIGINT)
        rest = process.communicate(timeout=BOUND_S)[1]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 1 and rest.splitlines() == [
        f"kvfs: error: {mountpoint}: the daemon was interrupted (SIGINT) before the mount came up"], rest
    assert "Traceback" not in log.read_text() and not daemons_of(mountpoint)


def test_a_certificate_of_another_ca_for_status(tmp_path: Path) -> None:
    master = MasterDaemon(tmp_path)
    master.start()
    stranger = str(foreign_tls("operator", "admin").directory)
    try:
        line = refused("status", "--master", master.address, tls=stranger)
    finally:
        master.stop()
    assert line.startswith(f"kvfs: error: master {master.address} refused this client (admin 'operator' of "
                           f"{stranger}; is it issued by the master's CA?)")
    assert refused("status", "--master", "127.0.0.1:1") == "kvfs: error: master 127.0.0.1:1: Connection refused"


def test_master_on_a_port_in_use(tmp_path: Path, taken_port: int) -> None:
    line = refused("master", "--listen", f"127.0.0.1:{taken_port}", "--data", str(tmp_path / "data"),
                   tls=tls_dir("master", "master"))
    assert line == f"kvfs: error: --listen 127.0.0.1:{taken_port}: Address already in use"


def test_taken_metrics_port(tmp_path: Path, taken_port: int) -> None:
    line = refused("mount", str(tmp_path / "mnt"), "--dram", "64M", "--metrics-listen", f"127.0.0.1:{taken_port}")
    assert line == f"kvfs: error: --metrics-listen 127.0.0.1:{taken_port}: Address already in use"
    assert find_mount(str(tmp_path / "mnt")) is None


def test_status_of_a_stale_mount_a_subdirectory_and_no_mount(make_mount, tmp_path: Path) -> None:
    mount = make_mount("64M")
    (mount.path / "model" / "r0").mkdir(parents=True)
    shown = subprocess.run([*KVFS, "status", str(mount.path / "model" / "r0")], capture_output=True, text=True,
                           timeout=60)
    assert shown.returncode == 0 and f"mount {mount.path}:" in shown.stdout, shown.stderr
    line = refused("status", str(tmp_path))
    assert line.startswith(f"kvfs: error: {tmp_path} is not in a kvfs mount (it is on ")
    mount.kill()
    line = refused("status", str(mount.path / "model"))
    assert line.startswith(f"kvfs: error: {mount.path} is a stale kvfs mount: its daemon died")
    mount.start()  # cleans the stale mount up, and lets the fixture stop it


def test_non_empty_mountpoint_needs_nonempty(tmp_path: Path) -> None:
    mount = KvfsMount(tmp_path, "64M", "--nonempty")
    (mount.path / "left-behind").write_text("x")
    line = refused("mount", str(mount.path), "--dram", "64M")
    assert line == (f"kvfs: error: {mount.path} is not empty (1 entries would be hidden); "
                    f"--nonempty mounts over them")
    mount.start()
    try:
        assert os.listdir(mount.path) == []  # mounted over
    finally:
        mount.stop()
    assert os.listdir(mount.path) == ["left-behind"]


def test_a_readable_key_a_missing_bundle_or_one_of_another_role_is_refused(tmp_path: Path) -> None:
    bundle = tmp_path / "tls"
    shutil.copytree(NODE_TLS, bundle)
    key = bundle / "identity.key"
    key.chmod(0o644)
    node = ["node", "--master", "127.0.0.1:1", "--mount", str(tmp_path / "mnt"), "--dram", "64M"]
    line = refused(*node, "--tls-dir", str(bundle))
    assert line == (f"kvfs: error: {key}: mode 0644 is wider than 0600; a private key must be readable by its "
                    f"owner only (chmod 600 {key})")
    assert "mode 0644 is wider than 0600" in refused("status", "--master", "127.0.0.1:1", "--tls-dir", str(bundle))
    line = refused(*node, "--tls-dir", str(tmp_path / "none"))
    assert line == (f"kvfs: error: {tmp_path / 'none' / 'ca.crt'}: no such file (issue this process's credentials "
                    f"with `kvfs ca issue NAME --role node --address IP --out {tmp_path / 'none'}` and copy them "
                    f"here, or point --tls-dir at them)")
    line = refused(*node)  # the tests' admin bundle is no node's
    assert line.startswith("kvfs: error: ") and "is admin 'operator', this needs role node" in line
    line = refused(*node, "--name", "someone-else", tls=NODE_TLS)
    assert "--name 'someone-else': the certificate in" in line and "is for node 'preflight-node'" in line


def test_disk_size_beyond_the_free_space(tmp_path: Path, small_disk: Path) -> None:
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    line = refused("mount", str(tmp_path / "mnt"), "--dram", "64M", "--disk", str(small_disk / "kvfs"),
                   "--disk-size", "1G")
    assert line == (f"kvfs: error: --disk-size 1.0 GiB is more than the 128.0 MiB free in {small_disk} "
                    f"(--disk-fit takes what fits)")
    after = os.statvfs(small_disk)
    assert after.f_bavail * after.f_frsize == free and not (small_disk / "kvfs").exists()  # nothing allocated
    (tmp_path / "fit").mkdir()
    mount = KvfsMount(tmp_path / "fit", "64M", "--disk", str(small_disk / "kvfs"), "--disk-size", "1G", "--disk-fit",
                      "--io-engine", "threads", "--no-direct-io")
    mount.start()
    try:
        stats = os.statvfs(mount.path)  # 95% of the free 128 MiB (121 MiB), in whole chunks
        assert 112 << 20 <= stats.f_blocks * stats.f_frsize <= 121 << 20
        left = os.statvfs(small_disk)
        assert left.f_bavail * left.f_frsize >= 6 << 20  # the disk is not filled
    finally:
        mount.stop()


def test_dram_beyond_memory(tmp_path: Path) -> None:
    line = refused("mount", str(tmp_path / "mnt"), "--dram", "1T")
    assert line.startswith("kvfs: error: dram: 1.0 TiB is more than 90% of this machine's")
    available = available_memory()
    over = check_memory(available + (1 << 30))
    assert over.result == FAIL and "of memory available" in over.detail
    assert check_memory(64 << 20).result == OK


def test_usage_errors_are_one_line(tmp_path: Path) -> None:
    line = refused("mount", str(tmp_path / "mnt"), "--dram")
    assert line == "kvfs: error: argument --dram: expected one argument (see 'kvfs mount --help')"


def test_check_prints_the_preflight_as_a_table(tmp_path: Path, small_disk: Path, taken_port: int) -> None:
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    bundle = tmp_path / "tls"
    shutil.copytree(NODE_TLS, bundle)
    (bundle / "identity.key").chmod(0o640)
    env = dict(os.environ)
    result = subprocess.run([*KVFS, "check", str(full), "--dram", "64M", "--disk", str(small_disk), "--disk-size",
                             "1G", "--metrics-listen", f"127.0.0.1:{taken_port}", "--tls-dir", str(bundle),
                             "--io-engine", "threads", "--master", "127.0.0.1:1"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 1, result.stderr
    rows = {line[:20].strip(): line[20:].split(None, 1) for line in result.stdout.splitlines()[1:]}
    assert result.stdout.splitlines()[0].split() == ["CHECK", "RESULT", "DETAIL"]
    assert rows["memory"][0] == "ok" and rows["fuse"][0] == "ok" and rows["io_uring"][0] == "ok"
    assert rows["mount point"][0] == "fail" and "is not empty" in rows["mount point"][1]
    assert rows["disk space"][0] == "fail" and "128.0 MiB free" in rows["disk space"][1]
    assert rows["port metrics-listen"][0] == "fail" and "Address already in use" in rows["port metrics-listen"][1]
    assert rows["credentials"][0] == "fail" and "mode 0640" in rows["credentials"][1]
    assert rows["master"] == ["fail", "master 127.0.0.1:1: Connection refused"]
    (bundle / "identity.key").chmod(0o600)
    result = subprocess.run([*KVFS, "check", str(tmp_path / "new"), "--dram", "64M", "--no-metrics",
                             "--tls-dir", str(bundle)], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0 and result.stdout.count(" ok ") == 4, result.stdout


def test_a_failed_preallocation_gives_the_space_back(small_disk: Path) -> None:
    """Space taken after the preflight (another writer, thin provisioning): the tier that
    could not start leaves no segment behind, so the disk is as free as before."""
    from kvfs.disk.segments import SegmentFiles
    from kvfs.errors import StorageError

    free_before = os.statvfs(small_disk).f_bavail
    with pytest.raises(StorageError) as raised:
        SegmentFiles(small_disk / "segments", 1 << 30, direct_io=True)
    assert raised.value.errno == errno.ENOSPC
    assert list((small_disk / "segments").iterdir()) == []
    assert os.statvfs(small_disk).f_bavail == free_before
