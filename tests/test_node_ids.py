"""Node ids are never handed out twice. With the node of the highest id removed, a master
restarted after kill -9 (its state in lmdb) and a standby elected after kill -9 of the
leader (the state in etcd, loaded by a standby started after the removal) give a new
node a fresh id, not the removed one's; a saved high-water mark out of bounds is refused
at the load, and state saved before the mark existed loads with the mark derived from
the nodes, as it was then. A hot standby applying the leader's commits reserves the ids
the leader handed out, and a removal that a restart cut short is finished by the
restarted master."""

from __future__ import annotations

import errno
import time
from pathlib import Path
from typing import Any, Iterator

import msgspec
import pytest
import trio

from conftest import MasterDaemon, load_tls, wait_until
from etcd import ElectedMaster, EtcdCluster
from test_master_ha import FAILOVER_S, TTL, leading, run_masters
from test_standby import CLUSTER, elect, loaded_follower, until
from kvfs.clock import ManualClock
from kvfs.cluster.backlog import STEP_ITEMS
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.persist import COUNTERS_KEY, MasterState
from kvfs.cluster.registry import NODE_ID_MAX
from kvfs.errors import MetadataError
from kvfs.net.etcd import EtcdClient
from kvfs.net.etcdstate import EtcdState
from kvfs.net.rpc import RemoteMaster
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m

SETTINGS = MasterSettings(cluster=True)
# A node whose connection closed is declared dead within dead_after plus one expiry pass
# (docs/cluster.md); a loaded machine runs the master's loop late, so a few times that.
DECLARED_DEAD_S = 4 * (SETTINGS.dead_after_s + SETTINGS.expire_interval_s)
HANDOVER_S = 3 * FAILOVER_S  # the bound the design promises, a few times over, for the same reason


async def _session(address: str, tls: Any, work: Any) -> Any:
    async with trio.open_nursery() as nursery:
        host, port = address.rsplit(":", 1)
        remote = await RemoteMaster.connect(host, int(port), tls, nursery, request_timeout_s=10.0)
        try:
            return await work(remote)
        finally:
            await remote.aclose()


def register(address: str, name: str, *directories: bytes) -> int:
    """Registers node NAME (holding nothing), makes DIRECTORIES and disconnects; its id."""
    async def work(remote: RemoteMaster) -> int:
        node = (await remote.call(m.Register(name, "127.0.0.1:0"))).node
        await remote.call(m.Report([]))
        await remote.call(m.FinishRegistration())
        for directory in directories:
            await remote.call(m.MkDir(ROOT_INO, directory, 0o755, 0, 0))
        return node

    return trio.run(_session, address, load_tls(name, "node"), work)


def remove(address: str, name: str) -> None:
    """`kvfs remove-node NAME` as an admin, once the master has declared the node dead."""
    async def work(remote: RemoteMaster) -> bool:
        try:
            await remote.call(m.RemoveNode(name))
        except MetadataError as error:
            if error.errno != errno.EBUSY:  # still up: not declared dead yet
                raise
            return False
        return True

    wait_until(lambda: trio.run(_session, address, load_tls("operator", "admin"), work),
               f"node {name} declared dead and removed", DECLARED_DEAD_S)


def serving_register(address: str, name: str, timeout: float) -> int:
    """`register`, retried until the master answers (a new leader starting to serve)."""
    found: list[int] = []

    def attempt() -> bool:
        try:
            found.append(register(address, name))
        except* (OSError, EOFError, MetadataError, trio.BrokenResourceError):  # not serving yet
            pass
        return bool(found)

    wait_until(attempt, f"{name} registered", timeout)
    return found[0]


def test_a_removed_nodes_id_is_not_reused_after_the_master_is_killed(tmp_path: Path) -> None:
    master = MasterDaemon(tmp_path)
    master.start()
    try:
        first, second = register(master.address, "n1"), register(master.address, "n2")
        assert second > first
        remove(master.address, "n2")
        master.kill()
        master.start(port=master.port)
        assert register(master.address, "n1") == first  # a known name keeps its id
        third = register(master.address, "n3")
        assert third > second, f"n3 got id {third}, which removed n2 had"
        master.kill()  # once more: the mark is saved with the new node too
        master.start(port=master.port)
        assert register(master.address, "n4") > third
    finally:
        master.stop()


@pytest.fixture
def masters(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[list[ElectedMaster]]:
    """Two masters elected in etcd (as tests/test_master_ha.py starts them)."""
    yield from run_masters(tmp_path, etcd_cluster, TTL)


def test_a_removed_nodes_id_is_not_reused_after_a_failover(etcd_cluster: EtcdCluster,
                                                          masters: list[ElectedMaster]) -> None:
    leader, _ = leading(etcd_cluster, masters)
    first, second = register(leader.address, "n1"), register(leader.address, "n2")
    assert second > first
    remove(leader.address, "n2")
    register(leader.address, "n1", b"after")  # a commit after the removal's
    standby = next(master for master in masters if master is not leader)
    standby.kill()  # started again: its copy is loaded from etcd after the removal, not followed through it
    standby.start()
    leader.kill()
    killed_at = time.monotonic()
    # (how fast is tests/test_master_ha.py's to check: here a loaded machine may take longer)
    new, _ = leading(etcd_cluster, masters, HANDOVER_S, other_than=leader)
    third = serving_register(new.address, "n3", HANDOVER_S - (time.monotonic() - killed_at))
    assert third > second, f"n3 got id {third}, which removed n2 had"


@pytest.fixture
def saved(tmp_path: Path) -> Iterator[Path]:
    """A data directory where nodes a (id 1) and b (id 2) registered and b was removed."""
    clock = ManualClock()
    service = MetadataService(clock, LruPolicy(), SETTINGS)
    for name in ("a", "b"):
        node = service.handle(m.Register(name, f"10.0.0.{len(name)}:1"), 0).node
        service.handle(m.Report([]), node)
        service.handle(m.FinishRegistration(), node)
    assert node == 2
    while service.registry.is_live(node):  # expiry passes with no heartbeat
        clock.advance(SETTINGS.expire_interval_s)
        service.expire_nodes()
    service.handle(m.RemoveNode("b"), 0)
    state = MasterState(tmp_path)
    state.save(service)
    state.close()
    yield tmp_path


def loaded(directory: Path) -> MetadataService:
    service = MetadataService(ManualClock(), LruPolicy(), SETTINGS)
    state = MasterState(directory)
    try:
        state.load(service)
    finally:
        state.close()
    return service


def rewrite_counters(directory: Path, fields: list[int]) -> None:
    state = MasterState(directory)
    with state.env.begin(write=True) as txn:
        txn.put(COUNTERS_KEY, msgspec.msgpack.encode(fields), db=state._meta)
    state.close()


def test_the_mark_loads_and_state_saved_without_it_derives_it(saved: Path) -> None:
    assert loaded(saved).registry.next_id == 3
    counters = msgspec.msgpack.decode(_counters(saved))
    rewrite_counters(saved, counters[:4])  # as saved before the mark existed
    assert loaded(saved).registry.next_id == 2  # derived from the nodes left, as it was then


def test_a_mark_out_of_bounds_is_refused_at_the_load(saved: Path) -> None:
    counters = msgspec.msgpack.decode(_counters(saved))
    for bad in (NODE_ID_MAX + 2, -1):
        rewrite_counters(saved, [*counters[:4], bad])
        with pytest.raises(MetadataError, match="counters record"):
            loaded(saved)
    rewrite_counters(saved, [*counters[:4], 1])  # below the ids of known nodes: those count
    assert loaded(saved).registry.next_id == 2


def _counters(directory: Path) -> bytes:
    state = MasterState(directory)
    with state.env.begin() as txn:
        value = txn.get(COUNTERS_KEY, db=state._meta)
    state.close()
    assert value is not None
    return bytes(value)


def test_a_removal_cut_short_by_a_restart_is_finished_after_it(tmp_path: Path) -> None:
    """`kvfs remove-node` forgets a node's files in slices; the rest of a master killed between
    them are forgotten by the restarted one (before, they stayed hidden for good, or went to
    a new node that was given the removed one's id)."""
    files = STEP_ITEMS + 76  # the first slice goes with the answer: 76 left
    clock = ManualClock()
    service = MetadataService(clock, LruPolicy(), SETTINGS)
    nodes = {}
    for name in ("a", "b"):
        nodes[name] = service.handle(m.Register(name, "10.0.0.1:1"), 0).node
        service.handle(m.Report([]), nodes[name])
        service.handle(m.FinishRegistration(), nodes[name])
    b = nodes["b"]
    for i in range(files):
        opened = service.handle(m.Create(ROOT_INO, b"f%d" % i, 0o644, 0, 0, b, True), b)
        service.handle(m.Seal(opened.version, 10, clock.wall_ns(), []), b)
        service.handle(m.Release(opened.version, True), b)
        service.handle(m.Offloaded([opened.version]), b)  # on its SSD: kept, hidden, while it is down
    while service.registry.is_live(b):  # expiry passes; only a heartbeats
        clock.advance(SETTINGS.expire_interval_s)
        service.handle(m.Heartbeat(0, 0, 0, 0), nodes["a"])
        service.expire_nodes()
    assert service.handle(m.RemoveNode("b"), 0).files == files
    state = MasterState(tmp_path)
    state.save(service)  # the master is killed here: the next slices never run
    state.close()

    restarted = loaded(tmp_path)
    assert len(restarted.objects.of_node(b)) == files - STEP_ITEMS
    c = restarted.handle(m.Register("c", "10.0.0.3:1"), 0).node
    assert c != b and restarted.objects.of_node(c) == []
    restarted.expire_nodes()  # the first pass queues the rest; it goes in slices between requests
    while restarted.pending_work(1.0):
        pass
    assert restarted.objects.of_node(b) == [] and restarted.objects.versions == {}
    assert not restarted.ns.inodes[ROOT_INO].children  # the names are free
    assert restarted.members.forgetting == set()
    restarted.expire_nodes()
    assert len(restarted.backlog) == 0  # nothing queued again


def join(service: MetadataService, name: str) -> int:
    node = service.handle(m.Register(name, "10.0.0.1:1"), 0).node
    service.handle(m.Report([]), node)
    service.handle(m.FinishRegistration(), node)
    return node


def test_a_standby_following_the_leader_reserves_the_ids_it_handed_out(etcd_cluster: EtcdCluster) -> None:
    """A node registered and removed between two commits leaves no record of its own, only
    the saved mark: a standby applying the leader's commits hands its id to nobody."""
    async def main() -> None:
        client = EtcdClient(etcd_cluster.urls)
        epoch = await elect(client)
        clock = ManualClock()
        leader, state = MetadataService(clock, LruPolicy(), SETTINGS), EtcdState(client, CLUSTER)

        async def commit() -> None:
            batch = state.take(leader)
            if batch is not None:
                await state.commit(batch, epoch)

        join(leader, "a")
        await commit()
        async with trio.open_nursery() as nursery:
            follower = await loaded_follower(client, nursery)
            b = join(leader, "b")
            while leader.registry.is_live(b):  # expiry passes with no heartbeat
                clock.advance(SETTINGS.expire_interval_s)
                leader.expire_nodes()
            leader.handle(m.RemoveNode("b"), 0)
            leader.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), 1)
            await commit()
            await until(lambda: follower.revision >= state.revision, "the standby following")
            nursery.cancel_scope.cancel()
        copy, _ = await follower.catch_up(state.revision, 5.0)
        assert "b" not in copy.registry.by_name and copy.ns.lookup(ROOT_INO, b"d") is not None
        assert join(copy, "c") == b + 1
        await client.aclose()

    trio.run(main)
