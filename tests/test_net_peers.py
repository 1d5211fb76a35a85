"""Connections between real nodes: a reader's pooled connections when the owner restarts or freezes."""

from __future__ import annotations

import functools
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import Cluster, is_stored
from conftest import wait_until as _wait_until
from kvfs.net.transport import PEER_SILENCE_S

MiB = 1 << 20


wait_until = functools.partial(_wait_until, timeout=30.0)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _live_nodes(cluster: Cluster) -> dict[str, bool]:
    status = subprocess.run([sys.executable, "-m", "kvfs", "status", "--master", cluster.master.address, "--json"],
                            capture_output=True, text=True, timeout=30)
    return {node["name"]: node["live"] for node in json.loads(status.stdout)["nodes"]}



def test_the_first_read_after_an_owner_restart_succeeds(cluster: Cluster, tmp_path: Path) -> None:
    """The reader keeps connections to the owner from before its restart (same address, now
    closed by the owner's old process): its first read afterwards must not fail on them."""
    listen = f"127.0.0.1:{_free_port()}"
    owner = cluster.add_node("256M", "--disk", str(tmp_path / "owner-disk"), "--disk-size", "512M",
                             "--listen", listen, name="owner")
    reader = cluster.add_node("256M")
    before, after = os.urandom(12 * MiB), os.urandom(40 * MiB)  # the second too large for a prefetch
    (owner.path / "before.bin").write_bytes(before)
    (owner.path / "after.bin").write_bytes(after)
    os.setxattr(owner.path, "user.kvfs.control", b"flush")  # both on the owner's SSD: they survive it
    assert (reader.path / "before.bin").read_bytes() == before  # two runs: two pooled connections
    owner.stop()
    owner.start()  # same name, address and disk
    wait_until(lambda: _live_nodes(cluster).get("owner") is True, "the owner to register again")
    wait_until(lambda: is_stored(owner.path / "after.bin"), "the owner to serve its SSD files again")
    with open(reader.path / "after.bin", "rb") as f:  # the first read from the reader, no retry here
        assert f.read() == after
    assert "lost peer" not in reader.log_text() and "unreachable" not in reader.log_text()


def test_a_reader_of_a_frozen_owner_fails_within_the_peer_budget(cluster: Cluster, tmp_path: Path) -> None:
    """SIGSTOP the owner: a read on another node fails after about PEER_SILENCE_S (its pooled
    connection goes silent), not after TCP's minutes; after SIGCONT the owner's files are back."""
    owner = cluster.add_node("256M", "--disk", str(tmp_path / "owner-disk"), "--disk-size", "512M", name="owner")
    reader = cluster.add_node("256M")
    warm, frozen = os.urandom(12 * MiB), os.urandom(40 * MiB)
    (owner.path / "warm.bin").write_bytes(warm)
    (owner.path / "frozen.bin").write_bytes(frozen)
    os.setxattr(owner.path, "user.kvfs.control", b"flush")
    assert (reader.path / "warm.bin").read_bytes() == warm  # the reader now holds connections to the owner
    assert owner.process is not None
    os.kill(owner.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(OSError) as raised:
            (reader.path / "frozen.bin").read_bytes()
        failed_after = time.monotonic() - started
    finally:
        os.kill(owner.process.pid, signal.SIGCONT)
    assert raised.value.errno in (errno.EIO, errno.ENOENT), raised.value
    assert failed_after < PEER_SILENCE_S + 2, f"the read failed only after {failed_after:.1f} s"
    print(f"\nread of a frozen owner's file failed after {failed_after:.2f} s ({raised.value.strerror})")
    wait_until(lambda: is_stored(reader.path / "frozen.bin"), "the owner's SSD files to come back")
    assert (reader.path / "frozen.bin").read_bytes() == frozen
