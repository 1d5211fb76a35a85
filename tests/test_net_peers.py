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


def _stats(node) -> dict:  # type: ignore[no-untyped-def]
    return json.loads(os.getxattr(node.path, "user.kvfs.stats"))


def test_a_readers_release_rides_on_the_next_open_or_goes_on_its_own(cluster: Cluster) -> None:
    """A reader's close needs no answer from the master: its release rides on the node's next
    OpenRead, or, when no open follows, goes by itself a moment later. Either way the lease
    holds until the master has it: a version rewritten while a reader on another node has it
    open stays on its owner until that reader closed, and then goes."""
    owner, reader = cluster.add_node("256M"), cluster.add_node("256M")
    old, new = os.urandom(2 * MiB), os.urandom(2 * MiB)
    (owner.path / "kv.bin").write_bytes(old)
    wait_until(lambda: os.access(reader.path / "kv.bin", os.F_OK), "kv.bin on the reader")
    one_version = _stats(owner)["dram_used"]
    with open(reader.path / "kv.bin", "rb") as held:
        assert held.read() == old
        (owner.path / "kv.bin").write_bytes(new)  # a new version; the reader's stays leased
        assert _stats(owner)["dram_used"] > one_version
        assert held.read(1) == b""
    # Closed, and no open follows: the release goes on its own, and the old version with it.
    wait_until(lambda: _stats(owner)["dram_used"] == one_version, "the old version to go once its reader closed")
    assert _stats(reader)["releases_flushed"] >= 1
    assert (reader.path / "kv.bin").read_bytes() == new
    (owner.path / "other.bin").write_bytes(old)
    wait_until(lambda: os.access(reader.path / "other.bin", os.F_OK), "other.bin on the reader")

    def sent(stats: dict) -> int:
        return stats["releases_carried"] + stats["releases_flushed"]

    # The two opens so far (the held one, the read just above) released before counting on:
    # the kernel's RELEASE of the last comes after its close returned, so it may still be owed.
    wait_until(lambda: sent(_stats(reader)) == 2, "the earlier reads' releases to reach the master")
    before = _stats(reader)
    for _ in range(5):  # loads back to back, as vLLM's: a close's release rides on the next open
        assert (reader.path / "kv.bin").read_bytes() == new
        assert (reader.path / "other.bin").read_bytes() == old

    def released() -> int:
        return sent(_stats(reader)) - sent(before)

    wait_until(lambda: released() == 10, "every reader's release to reach the master")
    assert _stats(reader)["releases_carried"] > before["releases_carried"]
