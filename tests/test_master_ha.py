"""Masters elected through a real 3-member etcd on loopback, as real processes: one leads,
the other stands by; kill -9 or a freeze of the leader hands over to the other with the
namespace intact; a resumed old leader is fenced; etcd's own leader killed changes nothing
(default lease TTL); etcd's quorum lost for less than the leader's pause allows pauses it
and resumes it at the same epoch; lost for longer makes it step down, and a leader serves
again once it returns."""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import msgspec
import pytest
import trio

from conftest import load_tls, wait_until
from etcd import ElectedMaster, EtcdCluster, leader, state_keys
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.records import SavedInode
from kvfs.errors import MetadataError
from kvfs.net.etcd import EtcdClient, create_revision_is, delete, leader_key, leader_value, put
from kvfs.net.handshake import REFUSALS
from kvfs.net.rpc import RemoteMaster
from kvfs.wire import messages as m

TTL = 2  # the masters' --lease-ttl here (the default is 3)
FAILOVER_S = 5.0  # the bound the design promises: a new leader serving within this after the old one died


def run_masters(tmp_path: Path, etcd_cluster: EtcdCluster, ttl: int | None) -> Iterator[list[ElectedMaster]]:
    started: list[ElectedMaster] = []
    try:
        for i in range(2):
            started.append(ElectedMaster(tmp_path / f"master{i}", etcd_cluster, lease_ttl=ttl).start())
        yield started
    finally:
        statuses = [master.close() for master in started]
        for master in started:
            assert "Traceback" not in master.log_text(), master.log_text()[-4000:]
        assert all(status in (0, None, -9) for status in statuses), statuses


@pytest.fixture
def masters(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[list[ElectedMaster]]:
    yield from run_masters(tmp_path, etcd_cluster, TTL)


def leading(etcd: EtcdCluster, masters: list[ElectedMaster], timeout: float = 15.0,
            other_than: ElectedMaster | None = None) -> tuple[ElectedMaster, int]:
    """The master etcd names as leader (and its epoch), once there is one (not OTHER_THAN)."""
    by_address = {master.address: master for master in masters}
    found: list[Any] = []

    def check() -> bool:
        current = leader(etcd)
        if current is None or current[0] not in by_address or by_address[current[0]] is other_than:
            return False
        found[:] = [by_address[current[0]], current[1]]
        return True

    wait_until(check, "a leader in etcd", timeout)
    return found[0], found[1]


class Session:
    """A node's connection to a master, run in its own trio loop per call."""

    def __init__(self, master: ElectedMaster, name: str = "n1", timeout_s: float = 10.0) -> None:
        self.master = master
        self.name = name
        self.timeout_s = timeout_s

    async def _with(self, work: Any) -> Any:
        async with trio.open_nursery() as nursery:
            host, port = self.master.address.rsplit(":", 1)
            remote = await RemoteMaster.connect(host, int(port), load_tls(self.name, "node"), nursery,
                                                request_timeout_s=self.timeout_s)
            try:
                await remote.call(m.Register(self.name, "127.0.0.1:0"))
                await remote.call(m.Report([]))
                await remote.call(m.FinishRegistration())
                return await work(remote)
            finally:
                await remote.aclose()

    def epoch(self) -> int:
        """The epoch the master's Welcome announced."""
        async def work(remote: RemoteMaster) -> int:
            return remote._frames.welcome.epoch

        return trio.run(self._with, work)

    def mkdirs(self, names: list[bytes]) -> None:
        async def work(remote: RemoteMaster) -> None:
            for name in names:
                await remote.call(m.MkDir(ROOT_INO, name, 0o755, 0, 0))

        trio.run(self._with, work)

    def present(self, names: list[bytes]) -> set[bytes]:
        async def work(remote: RemoteMaster) -> set[bytes]:
            found = set()
            for name in names:
                entry = await remote.call(m.Lookup(ROOT_INO, name))
                if entry.attr is not None:
                    found.add(name)
            return found

        return trio.run(self._with, work)

    def serves(self, names: list[bytes]) -> bool:
        """Whether this master answers, holding every one of NAMES."""
        answered = False
        try:
            answered = self.present(names) == set(names)
        except* (OSError, MetadataError, *REFUSALS):  # closed, refused, not reachable
            pass
        return answered


def metrics(master: ElectedMaster) -> dict[str, float]:
    """The master's metrics now (every elected master serves them, on the port its log names)."""
    found = re.search(r"metrics on http://\S+?:(\d+)/metrics", master.log_text())
    assert found, master.log_text()[-2000:]
    with urllib.request.urlopen(f"http://127.0.0.1:{found.group(1)}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {name: float(value) for name, value in re.findall(r"^(\w+) (\S+)$", text, re.M)}


def saved_names(etcd: EtcdCluster) -> set[bytes]:
    """The names of every inode record in etcd."""
    decode = msgspec.msgpack.Decoder(SavedInode).decode
    return {decode(value).name for key, value in state_keys(etcd).items() if b"/state/i/" in key}


def test_one_leads_the_other_stands_by_and_kill_9_hands_over(etcd_cluster: EtcdCluster,
                                                              masters: list[ElectedMaster]) -> None:
    first, epoch = leading(etcd_cluster, masters)
    standby = masters[1] if first is masters[0] else masters[0]
    names = [b"d%03d" % i for i in range(100)]
    Session(first).mkdirs(names)
    assert not Session(standby).serves(names[:1])  # a standby answers nothing
    assert "standing by" in standby.log_text() and "master leading" not in standby.log_text()
    assert set(names) <= saved_names(etcd_cluster)  # acknowledged means in etcd

    first.kill()
    killed_at = time.monotonic()
    new, new_epoch = leading(etcd_cluster, masters, FAILOVER_S, other_than=first)
    wait_until(lambda: Session(new).serves(names), "the new leader serving the namespace",
               FAILOVER_S - (time.monotonic() - killed_at))
    assert new is standby and new_epoch > epoch
    assert Session(new).epoch() == new_epoch  # announced in the handshake
    Session(new).mkdirs([b"after"])
    assert Session(new).present([b"after", b"never", *names]) == {b"after", *names}


def test_a_frozen_leader_is_replaced_and_fenced_when_it_resumes(etcd_cluster: EtcdCluster,
                                                                 masters: list[ElectedMaster]) -> None:
    old, epoch = leading(etcd_cluster, masters)
    Session(old).mkdirs([b"before"])

    async def frozen_then_provoked() -> str:
        """Connected to the old leader before it froze; sends a write while it is frozen and
        the other leads, resumes it, and reports what came back."""
        async with trio.open_nursery() as nursery:
            host, port = old.address.rsplit(":", 1)
            remote = await RemoteMaster.connect(host, int(port), load_tls("n2", "node"), nursery, request_timeout_s=10)
            await remote.call(m.Register("n2", "127.0.0.1:0"))
            await remote.call(m.Report([]))
            await remote.call(m.FinishRegistration())
            old.stop()
            new, new_epoch = await trio.to_thread.run_sync(
                lambda: leading(etcd_cluster, masters, 15.0, other_than=old))
            assert new_epoch > epoch
            await trio.to_thread.run_sync(lambda: wait_until(lambda: Session(new, "n1").serves([b"before"]),
                                                             "the new leader serving", 10.0))
            try:
                with trio.fail_after(15):
                    async with trio.open_nursery() as calls:
                        outcome: list[str] = []

                        async def stale_write() -> None:
                            try:
                                await remote.call(m.MkDir(ROOT_INO, b"from-the-old-leader", 0o755, 0, 0))
                                outcome.append("answered")
                            except MetadataError as error:
                                outcome.append(f"failed: {error}")

                        calls.start_soon(stale_write)
                        await trio.sleep(0.2)  # the request is on its way to the frozen process
                        old.cont()
                return outcome[0]
            finally:
                await remote.aclose()

    assert trio.run(frozen_then_provoked).startswith("failed")
    new, _ = leading(etcd_cluster, masters, other_than=old)
    wait_until(lambda: "stepped down" in old.log_text(), "the old leader stepping down", 10.0)
    assert Session(new).present([b"before", b"from-the-old-leader"]) == {b"before"}
    assert b"from-the-old-leader" not in saved_names(etcd_cluster)
    assert not Session(old).serves([b"before"])  # resumed, it stands by
    assert leader(etcd_cluster) is not None and leader(etcd_cluster)[0] == new.address


def test_a_leader_whose_key_was_taken_is_fenced_at_its_next_write(etcd_cluster: EtcdCluster,
                                                                   masters: list[ElectedMaster]) -> None:
    """The leader key replaced behind the leader's back (its lease still alive, so only the
    fence can tell): its next commit writes nothing, and it steps down."""
    first, epoch = leading(etcd_cluster, masters)
    Session(first).mkdirs([b"before"])

    async def replace_key() -> None:
        client = EtcdClient(etcd_cluster.urls)
        try:
            key = leader_key("default")
            ok, _, _ = await client.txn([create_revision_is(key, epoch)], [delete(key)])
            assert ok
            # Another holder at once (or the standby, if its campaign came first: fenced just the same).
            await client.txn([create_revision_is(key, 0)], [put(key, leader_value("127.0.0.1:1", "intruder"))])
        finally:
            await client.aclose()

    trio.run(replace_key)
    refused = False
    try:
        Session(first).mkdirs([b"fenced"])
    except* (OSError, MetadataError, *REFUSALS):  # the connection is closed instead of an answer
        refused = True
    assert refused
    wait_until(lambda: "stepped down" in first.log_text(), "the fenced leader stepping down", 10.0)
    assert "another master leads" in first.log_text()
    assert b"fenced" not in saved_names(etcd_cluster) and b"before" in saved_names(etcd_cluster)


@pytest.fixture
def default_masters(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[list[ElectedMaster]]:
    """Masters with the lease TTL operators run (no --lease-ttl)."""
    yield from run_masters(tmp_path, etcd_cluster, None)


def test_one_etcd_member_killed_changes_nothing(etcd_cluster: EtcdCluster,
                                                default_masters: list[ElectedMaster]) -> None:
    """etcd's own leader, the worst member to lose: an election inside etcd, and the
    master's first endpoint gone (the masters list the members in order). The leader keeps
    its epoch and its state: if etcd's election outlasts its deadline it pauses and resumes
    (its lease lives: etcd's new leader extends every lease), it never steps down."""
    first, epoch = leading(etcd_cluster, default_masters)
    standby = default_masters[1] if first is default_masters[0] else default_masters[0]
    Session(first).mkdirs([b"a"])
    victim = etcd_cluster.raft_leader()
    etcd_cluster.kill(victim)
    Session(first).mkdirs([b"b"])  # committed once the others elected a leader
    etcd_cluster.wait_healthy()
    Session(first).mkdirs([b"c"])
    assert leader(etcd_cluster) == (first.address, epoch)
    assert "stepped down" not in first.log_text() and "master leading" not in standby.log_text()
    assert first.log_text().count("master paused") == first.log_text().count("master resumed")
    assert Session(first).present([b"a", b"b", b"c"]) == {b"a", b"b", b"c"}
    assert Session(first).epoch() == epoch
    assert {b"a", b"b", b"c"} <= saved_names(etcd_cluster)


def test_quorum_lost_briefly_pauses_the_leader_and_it_resumes_at_the_same_epoch(
        etcd_cluster: EtcdCluster, default_masters: list[ElectedMaster]) -> None:
    """Quorum lost past the leader's deadline but for less than its pause's limit: the
    leader answers nothing meanwhile (a connection made then waits), then serves again at
    the same epoch with its state as it was, without a load; the standby never leads."""
    first, epoch = leading(etcd_cluster, default_masters)
    standby = default_masters[1] if first is default_masters[0] else default_masters[0]
    Session(first).mkdirs([b"kept"])
    # etcd's two followers frozen: its leader, left alone, stops leading (and stops expiring
    # leases) once it misses their heartbeats. (A frozen etcd leader would instead resume
    # still leading, and might revoke the lease it finds past expiry before a renewal
    # reaches it: a lease that did not survive, the case where the master steps down.)
    # A node connected before the pause sends a request during it: answered once resumed,
    # its connection kept.
    registered, pause_seen, answered = threading.Event(), threading.Event(), []

    async def during_the_pause(remote: RemoteMaster) -> None:
        async def beat() -> None:  # as a node does: a live node (its heartbeats wait out the pause too)
            while True:
                await remote.call(m.Heartbeat(0, 0))
                await trio.sleep(0.3)

        async with trio.open_nursery() as beats:
            beats.start_soon(beat)
            registered.set()
            await trio.to_thread.run_sync(pause_seen.wait, 30)
            await remote.call(m.MkDir(ROOT_INO, b"during", 0o755, 0, 0))
            answered.append(True)
            beats.cancel_scope.cancel()

    held = threading.Thread(target=trio.run, args=(Session(first, "n2", 30.0)._with, during_the_pause))
    held.start()
    assert registered.wait(15)
    followers = [i for i in range(3) if i != etcd_cluster.raft_leader()]
    for i in followers:
        etcd_cluster.stop(i)
    try:
        wait_until(lambda: "master paused" in first.log_text(), "the leader pausing", 10.0)
        paused = metrics(first)
        assert paused["kvfs_master_paused"] == 1 and paused["kvfs_master_epoch"] == epoch
    finally:
        pause_seen.set()
        for i in followers:
            etcd_cluster.cont(i)
    held.join(40)
    assert answered == [True]
    assert "may no longer lead" not in first.log_text()
    # Answered once resumed (a connection made during the pause waits for its end).
    wait_until(lambda: Session(first).serves([b"kept"]), "the leader serving again", 10.0)
    log = first.log_text()
    assert "master resumed (epoch %d)" % epoch in log and "stepped down" not in log
    assert "loaded" not in log.split("master paused")[1]  # its state was kept, not reloaded
    assert leader(etcd_cluster) == (first.address, epoch)
    assert "master leading" not in standby.log_text()
    resumed = metrics(first)
    assert resumed["kvfs_master_paused"] == 0 and resumed["kvfs_master_leader"] == 1
    Session(first).mkdirs([b"after"])
    assert Session(first).epoch() == epoch
    assert {b"kept", b"during", b"after"} <= saved_names(etcd_cluster)


def test_quorum_lost_the_leader_steps_down_and_one_serves_again_when_it_returns(
        etcd_cluster: EtcdCluster, masters: list[ElectedMaster]) -> None:
    """Lost for longer than the leader's deadline and its pause together (4 TTLs): it
    steps down; etcd keeps the lease alive meanwhile (no leader, no expiry), so the key
    lingers until the lease's TTL after quorum returns, then a master is elected."""
    first, _ = leading(etcd_cluster, masters)
    Session(first).mkdirs([b"kept"])
    etcd_cluster.stop(1)
    etcd_cluster.stop(2)
    try:
        wait_until(lambda: "master paused" in first.log_text(), "the leader pausing", TTL + 3.0)
        wait_until(lambda: "stepped down" in first.log_text(), "the leader stepping down", 3 * TTL + 3.0)
        assert not Session(first).serves([b"kept"])
    finally:
        etcd_cluster.cont(1)
        etcd_cluster.cont(2)
    etcd_cluster.wait_healthy()

    def someone_serves() -> bool:
        current = leader(etcd_cluster)
        return current is not None and any(
            master.address == current[0] and Session(master).serves([b"kept"]) for master in masters)

    wait_until(someone_serves, "a leader serving again", 20.0)


@pytest.mark.parametrize("flags, named", [(["--etcd", "https://h:1"], "--etcd"), (["--etcd", "h:x"], "--etcd"),
                                          (["--etcd", "h:1", "--lease-ttl", "1"], "--lease-ttl"),
                                          (["--etcd", "h:1", "--cluster", "a/b"], "--cluster"),
                                          (["--etcd", "h:1", "--listen", "0.0.0.0:0"], "--advertise")])
def test_bad_etcd_options_are_refused_at_start(flags: list[str], named: str) -> None:
    import subprocess
    import sys

    from conftest import tls_dir

    listen = [] if "--listen" in flags else ["--listen", "127.0.0.1:0"]
    done = subprocess.run([sys.executable, "-m", "kvfs", "master", *listen, "--no-metrics",
                           "--tls-dir", tls_dir("master", "master"), *flags], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0 and named in done.stderr, done.stderr
