"""Masters elected in etcd, with real processes on loopback: a 3-member etcd, two `kvfs master
--etcd` processes (one leads, one stands by) and three `kvfs node --master etcd://...` mounts
under vLLM's fs-tier pattern (stores: write a temp file, rename it; loads: open, read whole,
close). The leader is killed (-9), or frozen past its lease and resumed; an etcd member is
killed; etcd loses its quorum. Acknowledged stores are never lost, reads of files a node holds
go on while no master leads, and a deposed leader lands nothing."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import mmap
import os
import random
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest
from conftest import KvfsMount, wait_until
from etcd import ElectedMaster, EtcdCluster
from etcd import leader as etcd_leader

CLUSTER = "failover"
LEASE_TTL_S = 2  # the masters' --lease-ttl
MASTER_WAIT_S = 3.0  # the nodes' --master-wait
FAILOVER_S = 5.0  # issue 19: a new leader within this after the old one is killed
SIZE = 64 << 10  # a KV block; small, so that nothing is evicted from the nodes' 256 MiB
PER_WRITER = 400  # acknowledged stores at most, per writer thread
WRITERS = 2  # per node
PACE_S = 0.01  # between a writer's stores: the load runs through each fault instead of ending before it
FAILED_PAUSE_S = 0.1  # after a failed store (an outage fails them at once once --master-wait has passed)
TOP = "llama_failover"
libc = ctypes.CDLL(None, use_errno=True)


def block_path(root: Path, key: int) -> Path:
    """vLLM's layout: model / 3 hex / 2 hex + group / digest.bin."""
    digest = hashlib.sha256(str(key).encode()).hexdigest()
    return root / TOP / digest[:3] / f"{digest[3:5]}_g0" / f"{digest}.bin"


def content(key: int) -> bytes:
    return random.Random(key).randbytes(SIZE)


class Ha:
    """etcd, two masters, three nodes (node1 with an SSD tier, the others DRAM only)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.etcd = EtcdCluster(root, members=3)
        self.masters: list[ElectedMaster] = []
        self.nodes: list[KvfsMount] = []
        self.etcd_address = "etcd://" + ",".join(url.removeprefix("http://") for url in self.etcd.urls) + f"/{CLUSTER}"

    def start(self) -> None:
        for i in range(2):
            self.masters.append(ElectedMaster(self.root / f"master{i}", self.etcd, cluster=CLUSTER,
                                              lease_ttl=LEASE_TTL_S).start())
        wait_until(lambda: self.leader() is not None, what="a master to be elected", timeout=30)
        for i in range(3):
            node_root = self.root / f"node{i + 1}"
            node_root.mkdir()
            disk = ("--disk", str(node_root / "disk"), "--disk-size", "256M") if i == 0 else ()
            node = KvfsMount(node_root, "256M", "--master-wait", str(MASTER_WAIT_S), *disk, master=self.etcd_address)
            node.start()
            self.nodes.append(node)

    def leader(self) -> tuple[str, int] | None:
        """(address, epoch) etcd names now; None while none leads or etcd cannot tell."""
        return etcd_leader(self.etcd, CLUSTER)

    def leading(self) -> tuple[ElectedMaster, int]:
        found = self.leader()
        assert found is not None, "no master leads"
        return next(master for master in self.masters if master.address == found[0]), found[1]

    def wait_new_leader(self, old_epoch: int, timeout: float = 15.0) -> tuple[ElectedMaster, int, float]:
        seconds = wait_until(lambda: (self.leader() or ("", 0))[1] > old_epoch, what="a new leader", timeout=timeout)
        master, epoch = self.leading()
        return master, epoch, seconds

    def errors(self) -> list[str]:
        return [f"{node.root.name}: {line}" for node in self.nodes for line in node.new_errors()]

    def close(self) -> list[str]:
        errors = self.errors()
        with contextlib.ExitStack() as stack:  # everything is stopped, whatever fails first
            stack.callback(self.etcd.close)
            for master in self.masters:
                stack.callback(master.close)
            for node in self.nodes:
                stack.callback(node.stop)
        return errors


@pytest.fixture
def ha(tmp_path: Path) -> Iterator[Ha]:
    started = Ha(tmp_path)
    try:
        started.start()
        yield started
    finally:
        errors = started.close()
        assert not errors, "kvfs logged unexpected errors:\n" + "\n".join(errors)


def rename_noreplace(old: Path, new: Path) -> None:
    if libc.renameat2(-100, bytes(old), -100, bytes(new), 1) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(new))


@dataclass
class Load:
    """vLLM-pattern stores on every node (WRITERS threads each) and loads, by one thread per
    node, of the files that node stored itself (held there: readable with no master)."""

    nodes: list[KvfsMount]
    acked: dict[int, tuple[int, float]] = field(default_factory=dict)  # key -> (node, when its rename returned)
    uncertain: dict[int, float] = field(default_factory=dict)  # key -> when its failed rename was started
    store_failures: list[tuple[float, str]] = field(default_factory=list)
    loads: list[tuple[float, int, str]] = field(default_factory=list)  # (when, node, "ok" or why not)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> "Load":
        for n in range(len(self.nodes)):
            for w in range(WRITERS):
                self.threads.append(threading.Thread(target=self._writer, args=(n, w), daemon=True))
            self.threads.append(threading.Thread(target=self._reader, args=(n,), daemon=True))
        for thread in self.threads:
            thread.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=120)
        assert not any(thread.is_alive() for thread in self.threads), "a load thread hangs"

    def _store(self, node: int, key: int) -> None:
        path = block_path(self.nodes[node].path, key)
        for level in (path.parent.parent.parent, path.parent.parent, path.parent):
            # As vLLM does: a mkdir only where stat finds nothing (a mkdir of an existing name
            # makes the kernel ask the node again, and an EIO answer drops its cached entry).
            try:
                os.stat(level)
            except FileNotFoundError:
                try:
                    os.mkdir(level)
                except FileExistsError:
                    pass
        tmp = Path(f"{path}_{random.getrandbits(63)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            assert os.write(fd, content(key)) == SIZE
        finally:
            os.close(fd)
        started = time.monotonic()
        try:
            rename_noreplace(tmp, path)
        except OSError:
            with self.lock:
                self.uncertain[key] = started  # the rename may or may not have been applied
            raise
        with self.lock:
            self.acked[key] = (node, time.monotonic())

    def _writer(self, node: int, worker: int) -> None:
        stored = 0
        key = (node * WRITERS + worker) * 100_000
        while stored < PER_WRITER and not self.stop.is_set():
            key += 1
            try:
                self._store(node, key)
                stored += 1
                time.sleep(PACE_S)
            except OSError as error:
                with self.lock:
                    self.store_failures.append((time.monotonic(), f"node{node + 1} key {key}: {error}"))
                time.sleep(FAILED_PAUSE_S)  # a failed store is a miss to vLLM; it goes on with the next block

    def _reader(self, node: int) -> None:
        rng = random.Random(node)
        buffer = mmap.mmap(-1, SIZE)
        while not self.stop.is_set():
            with self.lock:
                mine = [key for key, (owner, _) in self.acked.items() if owner == node]
            if not mine:
                time.sleep(0.01)
                continue
            key = rng.choice(mine)
            try:
                fd = os.open(block_path(self.nodes[node].path, key), os.O_RDONLY)
                try:
                    count = os.readv(fd, [buffer])
                finally:
                    os.close(fd)
                outcome = "ok" if count == SIZE and buffer[:] == content(key) else f"key {key}: WRONG BYTES"
            except OSError as error:
                outcome = f"key {key}: {error}"
            with self.lock:
                self.loads.append((time.monotonic(), node, outcome))

    def count(self, since: float = 0.0) -> int:
        """Stores acknowledged after `since`, on the node that has the fewest."""
        with self.lock:
            return min(sum(1 for owner, at in self.acked.values() if owner == n and at > since)
                       for n in range(len(self.nodes)))

    def loads_between(self, start: float, end: float) -> tuple[int, list[str]]:
        with self.lock:
            window = [outcome for at, _, outcome in self.loads if start <= at <= end]
        return sum(1 for outcome in window if outcome == "ok"), [o for o in window if o != "ok"]

    def failures_between(self, start: float, end: float) -> list[str]:
        with self.lock:
            return [what for at, what in self.store_failures if start <= at <= end]


def listed(node: KvfsMount) -> set[str]:
    """The published blocks a node's mount lists (temp files left out)."""
    names = set()
    for directory, _, files in os.walk(node.path / TOP):
        names.update(os.path.join(directory, f)[len(str(node.path)):] for f in files if not f.endswith(".tmp"))
    return names


def check_namespace(ha: Ha, load: Load, landed_if_uncertain: set[int]) -> None:
    """Every acknowledged store is listed by every node and reads back byte-identical there;
    nothing else is listed but the stores in `landed_if_uncertain` (failed renames that may
    have been applied)."""
    relative = {key: str(block_path(Path("/"), key)) for key in load.acked}
    maybe = {str(block_path(Path("/"), key)) for key in landed_if_uncertain}
    wanted = set(relative.values())
    buffer = mmap.mmap(-1, SIZE)
    for node in ha.nodes:
        names = listed(node)
        missing = wanted - names
        assert not missing, f"{node.root.name}: {len(missing)} acknowledged files lost, e.g. {sorted(missing)[:3]}"
        extra = names - wanted - maybe
        assert not extra, f"{node.root.name}: {len(extra)} files nobody was told were stored: {sorted(extra)[:3]}"
        for key, name in relative.items():
            fd = os.open(node.path / name.lstrip("/"), os.O_RDONLY)
            try:
                assert os.readv(fd, [buffer]) == SIZE and buffer[:] == content(key), f"{node.root.name}: {name}"
            finally:
                os.close(fd)
        stats = json.loads(os.getxattr(node.path, "user.kvfs.stats"))
        assert stats["evicted_files"] == 0, f"{node.root.name} evicted files: the check would not mean much"


def kvfs_status(master: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfs", "status", "--master", master, "--json"],
                          capture_output=True, text=True, timeout=60)


def allow_master_faults(ha: Ha) -> None:
    """A node logs its master's faults (lost connections, failed heartbeats) as they happen."""
    for node in ha.nodes:
        node.allowed_errors.append("master")


def test_leader_killed_under_load_fails_over_within_5_s_and_loses_nothing(ha: Ha) -> None:
    load = Load(ha.nodes).start()
    try:
        wait_until(lambda: load.count() >= 20, what="stores before the kill", timeout=60)
        old, old_epoch = ha.leading()
        old.kill()
        killed_at = time.monotonic()
        new, new_epoch, elected_s = ha.wait_new_leader(old_epoch)
        elected_at = killed_at + elected_s
        serving_s = wait_until(lambda: load.count(since=killed_at) >= 1, what="stores through the new leader",
                               timeout=30) + elected_s
        wait_until(lambda: load.count(since=elected_at) >= 20, what="stores after the failover", timeout=60)
    finally:
        load.finish()
    gap_ok, gap_failed = load.loads_between(killed_at, elected_at)
    failed = load.failures_between(killed_at, time.monotonic())
    print(f"\nleader {old.root.name} (epoch {old_epoch}) killed; {new.root.name} elected (epoch {new_epoch}) in "
          f"{elected_s:.2f} s, stores through it on every node {serving_s:.2f} s after the kill; "
          f"{gap_ok} local loads served while no master led ({len(gap_failed)} failed); {len(load.acked)} stores "
          f"acknowledged, {len(failed)} failed during the failover")
    assert new is not old and new_epoch > old_epoch
    assert elected_s <= FAILOVER_S
    assert gap_ok > 0 and not gap_failed, f"local loads failed while no master led: {gap_failed[:3]}"
    check_namespace(ha, load, set(load.uncertain))
    allow_master_faults(ha)


def test_a_frozen_leader_is_replaced_and_fenced_when_it_resumes(ha: Ha) -> None:
    load = Load(ha.nodes).start()
    try:
        wait_until(lambda: load.count() >= 20, what="stores before the freeze", timeout=60)
        old, old_epoch = ha.leading()
        old.stop()
        frozen_at = time.monotonic()
        new, new_epoch, elected_s = ha.wait_new_leader(old_epoch)
        wait_until(lambda: load.count(since=frozen_at + elected_s) >= 10, what="stores through the new leader",
                   timeout=60)
        offsets = [len(node.log_text()) for node in ha.nodes]
        old.cont()
        resumed_at = time.monotonic()
        # The deposed leader runs again while the load goes on: what the nodes had sent it
        # before they left it is in its sockets.
        wait_until(lambda: "stepped down" in old.log_text() or old.process.poll() is not None,
                   what="the resumed leader to notice it lost its lease", timeout=15)
        # Stores acknowledged since the resume, however slowly a loaded machine makes them (a
        # count in a sliding window would ask for a rate: 10 stores/s per node).
        wait_until(lambda: load.count(since=resumed_at) >= 5, what="stores after the resume", timeout=30)
    finally:
        load.finish()
    followed = sum("leaving master " + old.address in node.log_text() for node in ha.nodes)
    deposed = kvfs_status(old.address)
    current = kvfs_status(ha.etcd_address)
    print(f"\nleader {old.root.name} (epoch {old_epoch}) frozen; {new.root.name} elected (epoch {new_epoch}) in "
          f"{elected_s:.2f} s; {len(load.acked)} stores acknowledged, {len(load.store_failures)} failed "
          f"({len(load.uncertain)} at the rename); {followed} nodes left it once etcd named the new one; the resumed "
          f"one answers: {deposed.stderr.strip()[:120]}")
    assert new is not old and new_epoch > old_epoch
    assert deposed.returncode != 0  # it answers nobody, not even a status request
    assert current.returncode == 0, current.stderr  # etcd:// leads a command to the current leader
    assert [node["live"] for node in json.loads(current.stdout)["nodes"]] == [True, True, True]
    for node, offset in zip(ha.nodes, offsets):  # no node went back to the deposed leader
        assert f"connected to master {old.address}" not in node.log_text()[offset:], node.root.name
    # Renames that failed after the freeze were sent to the frozen leader or never sent: none may land.
    check_namespace(ha, load, {key for key, at in load.uncertain.items() if at < frozen_at})
    assert ha.leading()[0] is new
    allow_master_faults(ha)


def etcd_raft_leader(ha: Ha) -> int:
    """The index of the etcd member that leads etcd's own raft group."""
    for i, url in enumerate(ha.etcd.urls):
        request = urllib.request.Request(f"{url}/v3/maintenance/status", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=2) as response:
            status = json.loads(response.read())
        if status["header"]["member_id"] == status["leader"]:
            return i
    raise AssertionError("no etcd member leads")


def test_one_etcd_member_killed_changes_nothing(ha: Ha) -> None:
    raft_leader = etcd_raft_leader(ha)
    victim = next(i for i in range(3) if i != raft_leader)  # a follower: etcd itself needs no election
    load = Load(ha.nodes).start()
    try:
        wait_until(lambda: load.count() >= 20, what="stores before the kill", timeout=60)
        _, epoch = ha.leading()
        ha.etcd.kill(victim)
        killed_at = time.monotonic()
        wait_until(lambda: load.count(since=killed_at) >= 40, what="stores after the member was killed", timeout=60)
    finally:
        load.finish()
    ok, failed_loads = load.loads_between(killed_at, time.monotonic())
    print(f"\netcd member {victim} (of 3, raft leader {raft_leader}) killed: {load.count(since=killed_at)} stores "
          f"per node and {ok} loads after it, {len(load.store_failures)} stores failed")
    assert not load.store_failures, load.store_failures[:3]
    assert ok > 0 and not failed_loads, failed_loads[:3]
    assert ha.leading()[1] == epoch  # the same leadership throughout
    check_namespace(ha, load, set())
    checked = subprocess.run([sys.executable, "-m", "kvfs", "check", "--master", ha.etcd_address, "--no-metrics"],
                             capture_output=True, text=True, timeout=60)
    leader_line = next(line for line in checked.stdout.splitlines() if line.startswith("master "))
    assert leader_line.split()[1] == "ok" and ha.leading()[0].address in leader_line, checked.stdout


def test_etcd_quorum_lost_then_back(ha: Ha) -> None:
    load = Load(ha.nodes).start()
    try:
        wait_until(lambda: load.count() >= 20, what="stores before quorum is lost", timeout=60)
        leader, epoch = ha.leading()
        offsets = [len(node.log_text()) for node in ha.nodes]
        ha.etcd.kill(1)
        ha.etcd.kill(2)
        lost_at = time.monotonic()
        # The leader can no longer renew its lease: it stops answering within its TTL.
        stepped_down_s = wait_until(
            lambda: all("lost the connection to master" in node.log_text()[offset:]
                        for node, offset in zip(ha.nodes, offsets)),
            what="the leader to step down", timeout=LEASE_TTL_S + 10)
        # A store now fails with EIO once --master-wait has passed; local loads go on.
        wait_until(lambda: any("Input/output error" in what for what in load.failures_between(lost_at, time.monotonic())),
                   what="a store to fail", timeout=LEASE_TTL_S + MASTER_WAIT_S + 10)
        probe = ha.nodes[1].path / "probe.bin"
        started = time.monotonic()
        with pytest.raises(OSError) as failed:
            probe.write_bytes(b"x")
        probe_s = time.monotonic() - started
        # Loads of files held on each node keep being served while the outage lasts.
        wait_until(lambda: load.loads_between(started, time.monotonic())[0] >= 50, what="local loads without etcd",
                   timeout=30)
        outage_end = time.monotonic()
        ok, failed_loads = load.loads_between(lost_at + stepped_down_s, outage_end)
        for i in (1, 2):
            ha.etcd.restart(i)
        ha.etcd.wait_healthy()
        back_at = time.monotonic()
        wait_until(lambda: ha.leader() is not None, what="a leader after quorum returned", timeout=30)
        wait_until(lambda: load.count(since=back_at) >= 10, what="stores after quorum returned", timeout=60)
    finally:
        load.finish()
    print(f"\nquorum lost: leader {leader.root.name} (epoch {epoch}) stopped serving within {stepped_down_s:.2f} s; "
          f"a new file failed with {errno.errorcode[failed.value.errno]} after {probe_s:.2f} s; {ok} local loads "
          f"served meanwhile ({len(failed_loads)} failed); after quorum returned: {ha.leading()[0].root.name} leads "
          f"(epoch {ha.leading()[1]})")
    assert failed.value.errno == errno.EIO
    # A node's connection ends when its own --master-wait passes unanswered (commits wait for a
    # quorum) or when a request of its reaches the leader once paused (its deadline passed).
    assert stepped_down_s <= LEASE_TTL_S + MASTER_WAIT_S
    assert ok > 0 and not failed_loads, failed_loads[:3]
    check_namespace(ha, load, set(load.uncertain))
    allow_master_faults(ha)
