"""A file closed on one node is found at once on another, with real master and node
processes on loopback, on a machine whose CPUs are busy elsewhere.

The reading node answers misses in a directory from its copy of the directory's names
(docs/cluster.md, "Directory copies"), kept current by the master's pushes. A push that
reached it after the writer's close and rename had returned made it answer "absent" for
a file that existed (the benchmark's lookup-first load stopped at the last file written).
Each block here is stored on A (vLLM's temp file, close, rename) and looked up on B the
moment the rename returns, which is when that push raced the lookup."""

from __future__ import annotations

import json
import os
from pathlib import Path

from conftest import Cluster, busy_cpus, wait_until
from kvfs.net.pushes import reply_waits
from kvfs.wire import messages as m

BLOCKS = 80
SIZE = 64 << 10
HOGS = 4  # spinning processes beside the daemons, on the machine's two cores


def stats(node_path: Path) -> dict:
    return json.loads(os.getxattr(node_path, "user.kvfs.stats"))


def block(key: int) -> bytes:
    return key.to_bytes(4, "little") * (SIZE // 4)


def store(directory: Path, key: int) -> None:
    """vLLM's store of one block: an exclusive temp file, one write, close, rename."""
    final = directory / f"{key}.bin"
    tmp = directory / f"{key}.bin_7.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC, 0o644)
    try:
        os.write(fd, block(key))
    finally:
        os.close(fd)
    os.rename(tmp, final)


def test_a_block_stored_on_one_node_is_found_on_another_as_soon_as_its_rename_returns(cluster: Cluster) -> None:
    a, b = cluster.add_node("256M", name="a"), cluster.add_node("256M", name="b")
    (a.path / "blocks").mkdir()
    on_a, on_b = a.path / "blocks", b.path / "blocks"
    wait_until(lambda: on_b.is_dir(), what="the directory on node b")
    for i in range(3):  # lookups the master answers: then b copies the directory's names
        assert not os.access(on_b / f"never-{i}", os.F_OK)
    wait_until(lambda: stats(b.path)["cached_directories"] >= 1, what="b's copy of the directory")

    misses: list[str] = []
    answered = stats(b.path)["misses_answered_locally"]
    with busy_cpus(HOGS):
        for key in range(BLOCKS):
            store(on_a, key)
            if not os.access(on_b / f"{key}.bin", os.F_OK):
                misses.append(f"{key}.bin")
            assert not os.access(on_b / f"absent-{key}.bin", os.F_OK)  # a true miss stays one
    print(f"\n{BLOCKS} blocks stored on a and looked up on b at once beside {HOGS} busy processes: "
          f"{len(misses)} reported absent")
    assert misses == [], f"b did not find {len(misses)} of {BLOCKS} blocks closed on a: {misses[:10]}"
    # The copy still answered misses itself: the fix keeps lookups off the master.
    assert stats(b.path)["misses_answered_locally"] > answered
    for key in range(BLOCKS):
        assert (on_b / f"{key}.bin").read_bytes() == block(key)


def test_only_replies_that_add_a_name_others_look_up_wait_for_their_pushes() -> None:
    assert reply_waits(m.Create(1, b"key.bin", 0o644, 0, 0, 1, True), b".tmp")
    assert reply_waits(m.Rename(1, b"key.bin_7.tmp", 1, b"key.bin"), b".tmp")  # publishing waits
    assert reply_waits(m.MkDir(1, b"layer", 0o755, 0, 0), b".tmp")
    assert not reply_waits(m.Create(1, b"key.bin_7.tmp", 0o644, 0, 0, 1, True), b".tmp")  # a writer's own
    assert reply_waits(m.Create(1, b"key.bin_7.tmp", 0o644, 0, 0, 1, True), b"")  # no temp names configured
    assert not reply_waits(m.Unlink(1, b"key.bin"), b".tmp")  # a removal never makes a copy answer "absent"


def test_a_name_refused_as_existing_is_found_by_the_next_path_walk(cluster: Cluster) -> None:
    """vLLM's store makes the parents where `stat` finds nothing and ignores EEXIST: when
    another node made the directory between this node's miss and its mkdir, the kernel
    still holds the miss (a negative entry) and the node's copy may not have the other
    node's change yet. The next path walk through the name must find the directory, not
    fail with ENOENT (the eviction test's writers stopped so)."""
    a, b = cluster.add_node("256M", name="a"), cluster.add_node("256M", name="b")
    for round in range(20):
        on_b = b.path / f"model_{round}_r0"
        assert not os.path.exists(on_b)  # b's kernel caches the miss; the master answers it
        (a.path / f"model_{round}_r0").mkdir()
        try:
            os.mkdir(on_b)
            raise AssertionError(f"mkdir of {on_b} succeeded: a made it first")
        except FileExistsError:
            pass
        os.mkdir(on_b / "abc")  # the walk through the name the mkdir was refused for
        assert os.path.isdir(a.path / f"model_{round}_r0" / "abc")
