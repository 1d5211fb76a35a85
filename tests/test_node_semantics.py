"""One node's POSIX view in a cluster, with real mounts: a file seals at the release of its
last writer, a node sees its own namespace changes at once, and a slow or stopped owner is
an I/O error for readers elsewhere, never a missing file."""

from __future__ import annotations

import functools
import errno
import json
import os
import re
import signal
import stat
import subprocess
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Iterator

import pytest
from conftest import Cluster, KvfsMount
from conftest import running_cluster
from conftest import wait_until as _wait_until

from kvfs.node.service import PEER_BUDGET_S

MiB = 1 << 20



wait_until = functools.partial(_wait_until, timeout=10.0)


def reads(path: Path, expected: bytes) -> bool:
    try:
        return path.read_bytes() == expected
    except OSError:
        return False


def sealed(path: Path) -> bool:
    return os.getxattr(path, "user.kvfs.sealed") == b"yes"


def shell(command: str) -> None:
    result = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, ""), f"{command}: {result.returncode} {result.stderr}"


@pytest.fixture
def two_nodes(cluster: Cluster) -> Iterator[tuple[KvfsMount, KvfsMount]]:
    yield cluster.add_node("256M"), cluster.add_node("256M")


def test_shell_redirections_and_dd_write_whole_files_read_on_another_node(two_nodes, tmp_path: Path) -> None:
    """A shell's `> f` opens f, dup2s it to stdout and closes the original: that close ends
    nothing, the file seals when the last duplicate is closed, with every byte."""
    a, b = two_nodes
    shell(f"echo hello > '{a.path / 'echo.txt'}'")
    source = tmp_path / "source.bin"
    source.write_bytes(os.urandom(3 * MiB + 123))
    shell(f"dd if='{source}' of='{a.path / 'dd.bin'}' bs=64k status=none")
    shell(f"head -c 4M /dev/urandom > '{a.path / 'head.bin'}'")
    written = (a.path / "head.bin").read_bytes()
    assert len(written) == 4 * MiB
    assert (b.path / "echo.txt").read_bytes() == b"hello\n"
    assert (b.path / "dd.bin").read_bytes() == source.read_bytes()
    assert (b.path / "head.bin").read_bytes() == written
    for name in ("echo.txt", "dd.bin", "head.bin"):  # one version each: no reopening after a close
        assert os.getxattr(b.path / name, "user.kvfs.version") == os.getxattr(a.path / name, "user.kvfs.version")


def test_a_duplicate_keeps_the_file_open_until_its_own_close(two_nodes) -> None:
    a, b = two_nodes
    path = a.path / "dup.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    version = os.getxattr(path, "user.kvfs.version")
    duplicate = os.dup(fd)
    try:
        assert os.write(fd, b"first ") == 6
        os.close(fd)
        assert os.write(duplicate, b"second") == 6  # the same file, still being written
        assert not sealed(path)
        os.ftruncate(duplicate, 10)
        assert os.write(duplicate, b"!") == 1  # at offset 12: a hole of two bytes
    finally:
        os.close(duplicate)
    wait_until(lambda: sealed(path), what="the seal at the last release")
    assert os.getxattr(path, "user.kvfs.version") == version
    assert (b.path / "dup.bin").read_bytes() == b"first seco\0\0!"


def test_threads_making_directories_and_storing_into_them_on_one_node(two_nodes) -> None:
    """vLLM's store from 16 threads: os.makedirs of fresh directories under a directory the
    node has a copy of, then a file in each; a node's own mkdir is in its copy before the
    reply, so no thread sees a directory another thread just made as absent."""
    a, _ = two_nodes
    root = a.path / "kv"
    root.mkdir()
    failures: list[str] = []
    for round_ in range(50):
        base = root / f"r{round_}-{uuid.uuid4().hex[:6]}"
        start = threading.Barrier(16)

        def store(worker: int) -> None:
            start.wait()
            for key in range(4):
                directory = base / f"{(worker + key) % 4:02x}" / f"{key:02x}"
                try:
                    os.makedirs(directory, exist_ok=True)
                    (directory / f"{worker}-{key}.bin").write_bytes(b"x" * 4096)
                except OSError as error:
                    failures.append(f"round {round_} worker {worker} key {key}: {error}")

        threads = [threading.Thread(target=store, args=(worker,)) for worker in range(16)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert failures == []
    assert sum(1 for _ in root.rglob("*.bin")) == 50 * 16 * 4


def test_long_names_are_refused_before_a_directory_copy_answers(two_nodes) -> None:
    a, _ = two_nodes
    directory = a.path / "names"
    directory.mkdir()
    for i in range(4):  # lookups the master answers, then the node copies the directory
        assert not (directory / f"absent{i}").exists()
    long = "x" * 256
    for call in (lambda: os.unlink(directory / long), lambda: os.rmdir(directory / long),
                 lambda: os.rename(directory / long, directory / "y"), lambda: os.stat(directory / long)):
        with pytest.raises(OSError) as raised:
            call()
        assert raised.value.errno == errno.ENAMETOOLONG


@pytest.fixture
def patient_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Cluster]:
    """A cluster whose master waits 60 s before declaring a silent node dead: a stopped owner
    stays the file's live owner for the whole test."""
    monkeypatch.setenv("KVFS_DEAD_AFTER", "60")
    with running_cluster(tmp_path) as started:
        yield started


def test_a_stopped_owner_is_an_io_error_elsewhere_then_serves_again(patient_cluster: Cluster) -> None:
    owner, reader = patient_cluster.add_node("256M"), patient_cluster.add_node("256M")
    data = os.urandom(2 * MiB + 7)
    (owner.path / "f.bin").write_bytes(data)
    assert (reader.path / "f.bin").read_bytes() == data  # a pooled connection to the owner now exists
    (owner.path / "g.bin").write_bytes(data[::-1])  # not looked up on the reader yet (a lookup prefetches)
    wait_until(lambda: sealed(owner.path / "g.bin"), what="the seal (at the release that follows close)")
    assert owner.process is not None
    os.kill(owner.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(OSError) as raised:
            (reader.path / "g.bin").read_bytes()
        took = time.monotonic() - started
    finally:
        os.kill(owner.process.pid, signal.SIGCONT)
    assert raised.value.errno == errno.EIO, raised.value
    assert took < PEER_BUDGET_S + 2, f"the open failed only after {took:.1f} s"
    print(f"\nopen of a stopped owner's file: EIO after {took:.2f} s")
    wait_until(lambda: reads(reader.path / "g.bin", data[::-1]), timeout=30, what="the owner's bytes again")
    assert (reader.path / "f.bin").read_bytes() == data


def test_a_file_closed_on_one_node_opens_for_writing_at_once_on_another(two_nodes, cpu_hog) -> None:
    """Close-to-open across nodes for a writer too: the seal travels with the kernel's RELEASE,
    after close() returned, so the other node's open waits for it (bounded) instead of EBUSY."""
    a, b = two_nodes
    for round_ in range(30):
        path = f"rw{round_}.bin"
        (a.path / path).write_bytes(b"a" * 65536)
        # As soon as B sees the name (A's create reaches B's directory copy by a push), A's
        # RELEASE may still be on its way.
        wait_until(lambda: os.path.exists(b.path / path), what=f"{path} on node B")
        with open(b.path / path, "r+b") as f:
            f.seek(10)
            f.write(b"B")
        assert (a.path / path).read_bytes() == b"a" * 10 + b"B" + b"a" * 65525


def master_requests(node: KvfsMount) -> dict[str, float]:
    """The node's requests to the master so far, by type (its metrics)."""
    text = urllib.request.urlopen(node.metrics_url, timeout=10).read().decode()
    counts: dict[str, float] = {}
    for request, value in re.findall(r'^kvfs_master_rpc_total\{request="(\w+)",result="\w+"\} (\S+)$', text, re.M):
        counts[request] = counts.get(request, 0.0) + float(value)
    return counts


def store_like_vllm(directory: Path, name: str, data: bytes) -> None:
    tmp = directory / f"{name}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        assert os.write(fd, data) == len(data)
    finally:
        os.close(fd)
    os.rename(tmp, directory / name)


def test_a_file_stored_through_a_node_takes_one_master_request(two_nodes) -> None:
    """vLLM's store (create a temp file, one write, close, rename): the temp file is the
    node's own until the rename, which is one Publish (create, seal and rename); its inode
    and version numbers come from a block granted ahead. The kernel's getattr of the
    directory after the rename is answered with the attributes that came with it, its
    security.capability check before the write by the node (only user.* attributes exist)."""
    a, _ = two_nodes
    directory = a.path / "kv"
    directory.mkdir()
    store_like_vllm(directory, "first.bin", b"x" * 4096)  # the node copies the directory meanwhile
    store_like_vllm(directory, "second.bin", b"x" * 4096)
    before = master_requests(a)
    files = 20
    for i in range(files):
        store_like_vllm(directory, f"{i:064x}.bin", os.urandom(4096))
    spent = {request: count - before.get(request, 0.0) for request, count in master_requests(a).items()}
    assert spent.get("Publish") == files, spent
    assert spent.get("Create", 0) == spent.get("Seal", 0) == spent.get("Rename", 0) == 0, spent
    assert spent.get("GrantNumbers", 0) <= 1, spent  # (one per 4,096 files)
    assert spent.get("Release", 0) == spent.get("GetXattr", 0) == spent.get("Lookup", 0) == 0, spent
    assert spent.get("GetAttr", 0) <= files // 10, spent  # (the kernel may refresh a file's own)
    with pytest.raises(OSError) as raised:
        os.getxattr(directory / "first.bin", "security.capability")
    assert raised.value.errno == errno.ENODATA


def test_directory_attributes_after_a_nodes_own_changes_are_the_masters(two_nodes) -> None:
    """The attributes that answer the kernel after a node's create or rename are exactly what
    the master holds, and a change that brings none (mkdir, chmod, setxattr) is never hidden
    behind them: another node that never looked at the directory sees the same."""
    a, b = two_nodes
    directory = a.path / "attrs"
    directory.mkdir()
    first = os.stat(directory)
    store_like_vllm(directory, "k.bin", b"k" * 4096)
    stored = os.stat(directory)
    assert stored.st_mtime_ns > first.st_mtime_ns and stored.st_ctime_ns > first.st_ctime_ns
    (directory / "sub").mkdir()
    assert os.stat(directory).st_nlink == 3
    os.rename(directory / "k.bin", directory / "sub" / "k.bin")  # both directories change
    moved = os.stat(directory)
    assert moved.st_mtime_ns > stored.st_mtime_ns and moved.st_nlink == 3
    os.chmod(directory, 0o711)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o711
    os.setxattr(directory, "user.tag", b"1")
    tagged = os.stat(directory).st_ctime_ns
    assert tagged > moved.st_ctime_ns
    store_like_vllm(directory / "sub", "j.bin", b"j" * 4096)
    shown = {name: os.stat(node.path / "attrs" / "sub") for name, node in (("a", a), ("b", b))}
    shown.update({f"{name}-parent": os.stat(node.path / "attrs") for name, node in (("a", a), ("b", b))})
    for suffix in ("", "-parent"):
        mine, theirs = shown["a" + suffix], shown["b" + suffix]
        assert (mine.st_mode, mine.st_nlink, mine.st_mtime_ns, mine.st_ctime_ns) == \
            (theirs.st_mode, theirs.st_nlink, theirs.st_mtime_ns, theirs.st_ctime_ns), suffix


def test_a_file_removed_while_written_is_freed_at_its_close(two_nodes) -> None:
    """The close's single request (seal and release) hands back the version the release
    frees: the bytes of a file unlinked while it was written leave the node's tier."""
    a, b = two_nodes
    stats = lambda: json.loads(os.getxattr(a.path, "user.kvfs.stats"))  # noqa: E731
    used = stats()["dram_used"]
    path = a.path / "gone.bin"
    with open(path, "wb") as file:
        file.write(os.urandom(2 * MiB))
        os.unlink(path)
        assert stats()["dram_used"] >= used + 2 * MiB
    wait_until(lambda: stats()["dram_used"] == used, what="the unlinked file's bytes freed at its close")
    assert not (b.path / "gone.bin").exists()
