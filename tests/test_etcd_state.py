"""The master's state in a real etcd (kvfs.net.etcdstate): what a leader commits loads back
the same into a fresh service, batches over etcd's 128 operations a txn included, and a
commit fenced on a stale epoch writes nothing."""

from __future__ import annotations

import pytest
import trio

from etcd import EtcdCluster
from master_view import saved_view
from kvfs.clock import SystemClock
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.records import Change, Kind
from kvfs.net.etcd import EtcdClient, create_revision_is, delete, leader_key, put
from kvfs.net.etcdstate import EtcdState, Fenced, split
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m


def new_service() -> MetadataService:
    return MetadataService(SystemClock(), LruPolicy(), MasterSettings(cluster=True))


def test_split_puts_the_counters_first_and_respects_the_limits() -> None:
    changes = [Change(Kind.INODE, i, b"x" * 10) for i in range(300)] + [Change(Kind.COUNTERS, 0, b"c")]
    parts = split(changes, max_ops=128)
    assert [len(p) for p in parts] == [128, 128, 45]
    assert parts[0][0].kind is Kind.COUNTERS
    assert sorted(c.number for p in parts for c in p if c.kind is Kind.INODE) == list(range(300))
    assert all(len(p) <= 3 for p in split(changes, max_bytes=150))


def test_commits_load_back_and_a_stale_epoch_is_fenced(etcd_cluster: EtcdCluster) -> None:
    async def main() -> None:
        client = EtcdClient(etcd_cluster.urls)
        key = leader_key("t")
        try:
            ok, epoch, _ = await client.txn([create_revision_is(key, 0)], [put(key, b"{}")])
            assert ok
            service = new_service()
            state = EtcdState(client, "t")
            node = service.handle(m.Register("a", "10.0.0.1:7000"), 0).node
            service.handle(m.Report([]), node)
            service.handle(m.FinishRegistration(), node)
            for i in range(300):  # one batch of ~300 records: three txns
                attr = service.handle(m.MkDir(ROOT_INO, b"d%d" % i, 0o755, 0, 0), node)
                service.handle(m.SetXattr(attr.ino, b"user.k", b"\0\xff" * 3), node)
            batch = state.take(service)
            assert batch is not None and len(batch.changes) > 128 and state.take(service) is None
            await state.commit(batch, epoch)
            assert state.txns == len(split(batch.changes))
            service.handle(m.RmDir(ROOT_INO, b"d7"), node)  # a deletion
            await state.commit(state.take(service), epoch)  # type: ignore[arg-type]

            fresh = new_service()
            assert await EtcdState(client, "t").load(fresh) == service.ns.files
            assert saved_view(fresh) == saved_view(service)

            # Another master leads now: the old epoch's writes land nothing.
            await client.txn([], [delete(key)])
            await client.txn([create_revision_is(key, 0)], [put(key, b"{}")])
            service.handle(m.MkDir(ROOT_INO, b"stale", 0o755, 0, 0), node)
            with pytest.raises(Fenced):
                await state.commit(state.take(service), epoch)  # type: ignore[arg-type]
            again = new_service()
            await EtcdState(client, "t").load(again)
            assert b"stale" not in again.ns.inodes[ROOT_INO].children
            assert saved_view(again) == saved_view(fresh)
        finally:
            await client.aclose()

    trio.run(main)
