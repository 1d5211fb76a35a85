"""The master's state in a real etcd (kvfs.net.etcdstate): what a leader commits loads back
the same into a fresh service, batches over etcd's 128 operations a txn included, and a
commit fenced on a stale epoch writes nothing."""

from __future__ import annotations

import pytest
import trio
import trio.testing

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


def test_group_commit_releases_every_ticket_a_write_covered_and_none_before() -> None:
    from kvfs.net.commit import GroupCommit

    async def main() -> None:
        pending: list[int] = []  # changes made and not yet taken
        written: list[list[int]] = []
        gate = trio.Event()

        def take() -> list[int] | None:
            taken = pending[:]
            pending.clear()
            return taken or None

        async def write(batch: list[int]) -> None:
            await gate.wait()  # etcd is slow: everything handled meanwhile joins the next batch
            written.append(batch)

        group = GroupCommit(take, write)
        released: list[int] = []

        async def reply(ticket: int) -> None:
            await group.wait(ticket)
            released.append(ticket)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(group.run)
            pending.append(1)
            nursery.start_soon(reply, group.ticket())
            await trio.testing.wait_all_tasks_blocked()  # the first write is in flight
            for change in (2, 3, 4):
                pending.append(change)
                nursery.start_soon(reply, group.ticket())
            nursery.start_soon(reply, group.ticket())  # a read: no change of its own
            await trio.testing.wait_all_tasks_blocked()
            assert released == [] and written == []  # nothing leaves before its commit
            gate.set()
            await trio.testing.wait_all_tasks_blocked()
            assert written == [[1], [2, 3, 4]]
            assert sorted(released) == [1, 2, 3, 4, 5]
            assert group.commits == 2 and group.committed == 5
            nursery.start_soon(reply, group.ticket())  # nothing changed: released without a write
            await trio.testing.wait_all_tasks_blocked()
            assert released[-1] == 6 and group.commits == 2
            nursery.cancel_scope.cancel()

    trio.run(main)
