"""The systemd units verify, and the daemons speak the notify protocol to a socket of the test's own."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import tls_dir
from kvfs.fuse.mount import find_mount

UNITS = Path(__file__).resolve().parent.parent / "scripts" / "systemd"


def test_the_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    for unit in UNITS.glob("*.service"):
        shutil.copy(unit, tmp_path / unit.name)
    # Templates are verified as the instances an operator would enable.
    (tmp_path / "kvfs-node@mnt-kvfs.service").symlink_to("kvfs-node@.service")
    (tmp_path / "kvfs-mount@mnt-kvfs.service").symlink_to("kvfs-mount@.service")
    units = ["kvfs-master.service", "kvfs-node@mnt-kvfs.service", "kvfs-mount@mnt-kvfs.service"]
    result = subprocess.run(["systemd-analyze", "verify", *[f"./{unit}" for unit in units]], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
        result.stdout + result.stderr


class NotifySocket:
    """The datagram socket systemd would pass in NOTIFY_SOCKET."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))

    def next_message(self, timeout: float = 30.0) -> str:
        self.sock.settimeout(timeout)
        return self.sock.recv(4096).decode()

    def wait_for(self, state: str, timeout: float = 30.0) -> list[str]:
        """Messages up to and including the one that sets `state` (e.g. READY=1)."""
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            message = self.next_message(max(0.01, deadline - time.monotonic()))
            seen.append(message)
            if state in message.split("\n"):
                return seen


def start(args: list[str], notify: NotifySocket, log: Path, **env: str) -> subprocess.Popen[bytes]:
    with open(log, "ab") as output:
        return subprocess.Popen([sys.executable, "-m", "kvfs", *args], stdout=output, stderr=subprocess.STDOUT,
                                env={**os.environ, "NOTIFY_SOCKET": str(notify.path), **env})


def test_a_mount_is_ready_only_when_it_answers_and_says_stopping_on_sigterm(tmp_path: Path) -> None:
    notify = NotifySocket(tmp_path / "notify")
    mountpoint = tmp_path / "mnt"
    daemon = start(["mount", str(mountpoint), "--foreground", "--dram", "64M"], notify, tmp_path / "kvfs.log",
                   WATCHDOG_USEC="400000")
    try:
        notify.wait_for("READY=1")
        # At the moment readiness arrives the mount is there and answers.
        assert find_mount(str(mountpoint)) is not None
        assert os.stat(mountpoint).st_ino == 1
        (mountpoint / "block").write_bytes(b"kv" * 1000)
        # The watchdog is fed from the event loop, every half of WATCHDOG_USEC.
        assert notify.wait_for("WATCHDOG=1", timeout=5)
        assert notify.wait_for("WATCHDOG=1", timeout=5)
        daemon.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING=1")
        assert daemon.wait(timeout=30) == 0
        assert find_mount(str(mountpoint)) is None, "the mount is gone once the service stopped"
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        if find_mount(str(mountpoint)) is not None:
            subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
    assert "Traceback" not in (tmp_path / "kvfs.log").read_text()


def test_the_master_is_ready_when_it_accepts_nodes(tmp_path: Path) -> None:
    notify = NotifySocket(tmp_path / "notify")
    master = start(["master", "--listen", "127.0.0.1:0", "--data", str(tmp_path / "data")], notify,
                   tmp_path / "master.log", KVFS_TLS_DIR=tls_dir("master", "master"))
    try:
        messages = notify.wait_for("READY=1")
        status = next(line for line in messages[-1].split("\n") if line.startswith("STATUS="))
        port = int(status.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        master.send_signal(signal.SIGTERM)
        notify.wait_for("STOPPING=1")
        assert master.wait(timeout=30) == 0
    finally:
        if master.poll() is None:
            master.kill()
            master.wait()


def test_without_systemd_nothing_is_sent(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfs import systemd

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    assert systemd.notify("READY=1") is False
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.setenv("WATCHDOG_PID", "1")  # another process's watchdog
    assert systemd.watchdog_interval() is None
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 15.0


@pytest.mark.vm
def test_the_units_under_a_real_systemd_in_the_vm(tmp_path: Path) -> None:
    """systemd is not PID 1 here: boots the test VM with it (scripts/rdma_vm.py run --systemd) and
    runs tests/vm/systemd_units.sh: kvfs-mount@ ready only when the mount answers, status text,
    journald priorities, metrics, a crashed daemon restarted with its stale mount cleaned, clean
    stops; kvfs-master (sandboxed) and kvfs-node@ joining, a master restart — all with the units'
    hardening in force."""
    out = tmp_path / "vm"
    result = subprocess.run([sys.executable, str(UNITS.parent / "rdma_vm.py"), "run", "--systemd",
                             "tests/vm/systemd_units.sh", "--out", str(out), "--timeout", "900"],
                            capture_output=True, text=True, timeout=1800)
    log = (out / "guest.log").read_text(errors="replace") if (out / "guest.log").exists() else ""
    summary = re.search(r"SYSTEMD-VM-SUMMARY passed=(\d+) failed=(\d+)", log)
    assert summary, f"no summary from the VM:\n{result.stderr[-2000:]}\n{log[-4000:]}"
    assert summary.groups() == ("9", "0"), log[-6000:]
    assert result.returncode == 0, result.stderr[-2000:]
