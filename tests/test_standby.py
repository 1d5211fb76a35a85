"""A hot standby (kvfs.net.follow) against a real 3-member etcd on loopback: the copy it
keeps by following a leader's commits equals what a fresh load of etcd gives, renames,
deletions and commits of several txns included; one cut off past a compaction loads
again; the leader's compaction loop drops old history; and with real masters, a standby
elected after kill -9 of the leader serves every file the leader created after the
standby started, having applied only the last changes at its election."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest
import trio

from conftest import wait_until
from etcd import ElectedMaster, EtcdCluster, state_keys
from master_view import saved_view
from test_master_ha import Session, leading
from kvfs.clock import SystemClock
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.daemons.leader import compact_forever
from kvfs.net.etcd import Compacted, EtcdClient, create_revision_is, leader_key, put
from kvfs.net.etcdstate import EtcdState
from kvfs.net.follow import Follower
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m

CLUSTER = "t"


def new_service() -> MetadataService:
    return MetadataService(SystemClock(), LruPolicy(), MasterSettings(cluster=True))


def derived_view(service: MetadataService) -> dict[str, Any]:
    """What a load derives rather than reads: listings in order, counts, the policy."""
    directories = {ino: ([(name, inode.ino) for name, inode, _ in service.ns.listing(inode, 0, 1 << 30)],
                         inode.subdirs)
                   for ino, inode in service.ns.inodes.items() if inode.is_dir}
    objects = service.objects
    return {"directories": directories, "files": service.ns.files, "sealed_bytes": objects.sealed_bytes,
            "retired": sorted(objects.retired), "evictable": sorted(service.policy.candidates()),
            "by_node": {node: sorted(v.version for v in objects.of_node(node)) for node in objects.by_node},
            "node_totals": {node: objects.totals(node) for node in objects.by_node},
            "dir_totals": {ino: held for ino, held in service.dir_totals.by_dir.items() if any(held)}}


class Leader:
    """A metadata service whose changes are committed to etcd as an elected leader's are."""

    def __init__(self, client: EtcdClient, epoch: int) -> None:
        self.service = new_service()
        self.state = EtcdState(client, CLUSTER)
        self.epoch = epoch
        self.node = self.service.handle(m.Register("a", "10.0.0.1:7000"), 0).node
        self.service.handle(m.Report([]), self.node)
        self.service.handle(m.FinishRegistration(), self.node)

    def call(self, request: Any) -> Any:
        return self.service.handle(request, self.node)

    def write(self, parent: int, name: bytes, size: int = 4096) -> int:
        opened = self.call(m.Create(parent, name, 0o644, 0, 0, self.node, True))
        self.call(m.Seal(opened.version, size, time.time_ns(), []))
        self.call(m.Release(opened.version, True))
        return opened.attr.ino

    async def commit(self) -> None:
        batch = self.state.take(self.service)
        if batch is not None:
            await self.state.commit(batch, self.epoch)


async def elect(client: EtcdClient) -> int:
    ok, epoch, _ = await client.txn([create_revision_is(leader_key(CLUSTER), 0)], [put(leader_key(CLUSTER), b"{}")])
    assert ok
    return epoch


async def until(condition: Any, what: str, timeout: float = 15.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.02)


async def loaded_follower(client: EtcdClient, nursery: trio.Nursery) -> Follower:
    """A standby following CLUSTER in NURSERY, once it has loaded the state."""
    follower = Follower(client, CLUSTER, new_service)
    nursery.start_soon(follower.run)
    await until(lambda: follower.service is not None, "the standby's load")
    return follower


def test_the_copy_equals_a_fresh_load_after_renames_deletions_and_big_commits(etcd_cluster: EtcdCluster) -> None:
    async def main() -> None:
        client = EtcdClient(etcd_cluster.urls)
        leader = Leader(client, await elect(client))
        d1 = leader.call(m.MkDir(ROOT_INO, b"d1", 0o755, 0, 0)).ino
        d2 = leader.call(m.MkDir(ROOT_INO, b"d2", 0o755, 0, 0)).ino
        for i in range(200):
            leader.write(d1, b"f%03d" % i)
        await leader.commit()
        async with trio.open_nursery() as nursery:
            follower = await loaded_follower(client, nursery)
            # It loaded the state as it was before the latest commit began, and replays that commit.
            assert follower.loaded_files == 0
            # One commit of several txns: renames across and within directories, a rename over
            # an existing file, unlinks, a directory made and removed, a file written again.
            leader.call(m.Rename(d1, b"f005", d2, b"g005"))
            leader.call(m.Rename(d1, b"f006", d1, b"f007"))
            leader.call(m.Unlink(d1, b"f008"))
            leader.call(m.MkDir(d2, b"gone", 0o755, 0, 0))
            leader.call(m.RmDir(d2, b"gone"))
            sub = leader.call(m.MkDir(d2, b"sub", 0o755, 0, 0)).ino
            leader.call(m.SetXattr(d2, b"user.k", b"v"))
            ino = leader.call(m.Lookup(d1, b"f009")).attr.ino
            opened = leader.call(m.OpenWrite(ino, leader.node, True))
            leader.call(m.Seal(opened.version, 8192, time.time_ns(), []))
            leader.call(m.Release(opened.version, True))
            for i in range(200, 400):
                leader.write(d1 if i % 2 else sub, b"f%03d" % i)
            tmp = leader.write(d2, b"h.tmp")
            leader.call(m.Rename(d2, b"h.tmp", d2, b"h"))
            deep = leader.call(m.MkDir(sub, b"deep", 0o755, 0, 0)).ino
            leader.write(deep, b"x")
            leader.call(m.Rename(d2, b"sub", d1, b"moved"))  # a directory moves with what it holds
            await leader.commit()
            assert leader.state.txns > 3
            leader.call(m.Rename(d1, b"moved", d2, b"back"))  # and moves again, losing a file below
            leader.call(m.Unlink(deep, b"x"))
            await leader.commit()
            for i in range(10):  # small commits, one after another
                leader.write(d2, b"s%d" % i)
                await leader.commit()
            await until(lambda: follower.revision >= leader.state.revision, "the standby following")
            assert follower.applied > 0 and follower.loads == 1
            nursery.cancel_scope.cancel()
        copy, applied = await follower.catch_up(leader.state.revision, 5.0)
        assert applied > 0  # the last commit waited for the next one, or the election
        fresh = new_service()
        await EtcdState(client, CLUSTER).load(fresh)
        assert saved_view(copy) == saved_view(fresh) == saved_view(leader.service)
        assert derived_view(copy) == derived_view(fresh)
        assert copy.ns.lookup(d2, b"h") is not None and copy.ns.inodes[tmp].name == b"h"
        assert copy.ns.lookup(d1, b"f006") is None and copy.ns.lookup(d1, b"f008") is None
        await client.aclose()

    trio.run(main)


def test_a_standby_cut_off_past_a_compaction_loads_again(etcd_cluster: EtcdCluster) -> None:
    async def main() -> None:
        client = EtcdClient(etcd_cluster.urls)
        leader = Leader(client, await elect(client))
        d = leader.call(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0)).ino
        for i in range(50):
            leader.write(d, b"a%d" % i)
        await leader.commit()
        async with trio.open_nursery() as nursery:
            follower = await loaded_follower(client, nursery)
            nursery.cancel_scope.cancel()  # cut off: it sees nothing of what follows
        seen = follower.revision
        for i in range(50):
            leader.write(d, b"b%d" % i)
            await leader.commit()
        await client.compact(leader.state.revision)
        with pytest.raises(Compacted):
            async for _ in client.watch(f"/kvfs/{CLUSTER}/".encode(), seen + 1):
                pass
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follower.run)
            await until(lambda: follower.loads == 2 and follower.service is not None, "a second load")
            nursery.cancel_scope.cancel()
        copy, _ = await follower.catch_up(leader.state.revision, 5.0)
        assert copy.ns.files == 100 and saved_view(copy) == saved_view(leader.service)
        await client.aclose()

    trio.run(main)


def test_the_compaction_loop_drops_the_history_before_its_previous_pass(etcd_cluster: EtcdCluster) -> None:
    async def main() -> None:
        client = EtcdClient(etcd_cluster.urls)
        _, first, _ = await client.txn([], [put(b"/c/k", b"1")])
        _, second, _ = await client.txn([], [put(b"/c/k", b"2")])
        passes: list[int] = []

        def revision() -> int:  # what the leader's last commit reached
            passes.append(second)
            return second

        async with trio.open_nursery() as nursery:
            nursery.start_soon(compact_forever, client, revision, 0.1)
            with trio.fail_after(15):
                while True:
                    try:
                        [page async for page in client.pages(b"/c/", revision=first)]
                    except Compacted:
                        break
                    await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
        assert len(passes) >= 2  # the first pass only notes the revision; the next compacts to it
        assert [page async for page in client.pages(b"/c/")] == [[(b"/c/k", b"2")]]
        await client.aclose()

    trio.run(main)


def metrics(master: ElectedMaster) -> dict[str, float]:
    found = re.search(r"metrics on http://\S+?:(\d+)/metrics", master.log_text())
    assert found, master.log_text()[-2000:]
    with urllib.request.urlopen(f"http://127.0.0.1:{found.group(1)}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {name: float(value) for name, value in re.findall(r"^(kvfs_master_\w+) (\S+)$", text, re.M)}


@pytest.fixture
def masters(tmp_path: Path, etcd_cluster: EtcdCluster) -> Iterator[list[ElectedMaster]]:
    started: list[ElectedMaster] = []
    try:
        for i in range(2):
            started.append(ElectedMaster(tmp_path / f"master{i}", etcd_cluster, lease_ttl=2,
                                         metrics_listen="127.0.0.1:0").start())
        yield started
    finally:
        for master in started:
            master.close()
        for master in started:
            assert "Traceback" not in master.log_text(), master.log_text()[-4000:]


def test_an_elected_standby_serves_what_the_leader_made_after_it_started_applying_only_the_last(
        etcd_cluster: EtcdCluster, masters: list[ElectedMaster]) -> None:
    first, epoch = leading(etcd_cluster, masters)
    standby = masters[1] if first is masters[0] else masters[0]
    wait_until(lambda: "standby: loaded" in standby.log_text(), "the standby's load")
    before = metrics(standby)
    assert before["kvfs_master_leader"] == 0 and before["kvfs_master_epoch"] == 0
    assert metrics(first)["kvfs_master_leader"] == 1 and metrics(first)["kvfs_master_epoch"] == epoch
    names = [b"d%03d" % i for i in range(300)]
    for part in range(0, len(names), 50):  # several commits, each acknowledged
        Session(first).mkdirs(names[part:part + 50])
    records = len(state_keys(etcd_cluster))
    # The standby applies each commit once the next begins: all but the last before the kill.
    wait_until(lambda: metrics(standby)["kvfs_master_standby_records_applied_total"] >= 300,
               "the standby following the leader's commits")

    first.kill()
    new, new_epoch = leading(etcd_cluster, masters, other_than=first)
    assert new is standby and new_epoch > epoch
    wait_until(lambda: Session(new).serves(names), "the new leader serving every name")
    after = metrics(new)
    assert after["kvfs_master_leader"] == 1 and after["kvfs_master_epoch"] == new_epoch
    assert 0 <= after["kvfs_master_takeover_records"] < records / 4  # caught up the tail, not a load
    assert "took over the standby's copy" in new.log_text()
    assert "nodes from etcd in" not in new.log_text()  # what a load (a cold takeover) says
