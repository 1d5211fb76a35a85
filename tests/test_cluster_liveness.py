"""Liveness against a master that stalls, with real processes on loopback: a master paused
longer than a node's dead-after deadline convicts nobody, and no file is lost."""

from __future__ import annotations

import os
import signal
import time

from conftest import Cluster, KvfsMount

FILES = 30
STALL_S = 5.0  # twice the master's dead-after deadline (2.5 s)
SETTLE_S = 20.0  # bound for the cluster to be whole again after the stall


def content(i: int) -> bytes:
    return f"block {i}:".encode() * (1000 + 37 * i)


def unreadable(nodes: list[KvfsMount]) -> list[str]:
    """Each node's files that it cannot read with the right bytes, named node:file (cause)."""
    bad = []
    for node in nodes:
        for i in range(FILES):
            path = node.path / "blocks" / f"k{i}.bin"
            try:
                if path.read_bytes() != content(i):
                    bad.append(f"{node.root.name}:{path.name} (wrong bytes)")
            except OSError as error:
                bad.append(f"{node.root.name}:{path.name} ({os.strerror(error.errno or 0)})")
    return bad


def test_a_master_paused_past_the_deadline_loses_no_dram_only_file(cluster: Cluster) -> None:
    a, b = cluster.add_node("128M"), cluster.add_node("128M")  # no --disk: every file lives only in DRAM
    (a.path / "blocks").mkdir()
    for i in range(FILES):
        writer = a if i % 2 == 0 else b
        (writer.path / "blocks" / f"k{i}.bin").write_bytes(content(i))
    assert unreadable([a, b]) == []

    master = cluster.master.process
    assert master is not None
    offset = len(cluster.master.log_text())
    os.kill(master.pid, signal.SIGSTOP)
    try:
        time.sleep(STALL_S)  # the fault itself: the master is stopped this long
    finally:
        os.kill(master.pid, signal.SIGCONT)

    deadline = time.monotonic() + SETTLE_S
    while (bad := unreadable([a, b])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert bad == [], f"after a {STALL_S:.0f} s stall of the master, {len(bad)} reads failed: {bad[:10]}"
    log = cluster.master.log_text()[offset:]
    assert "stopped heartbeating" not in log, log[-3000:]  # no node was declared dead
    assert "the master stalled" in log
