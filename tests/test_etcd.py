"""kvfs.net.etcd against a real 3-member etcd on loopback: reads, pages, leases, fenced
txns, and failover to the next endpoint when a member is killed or frozen."""

from __future__ import annotations

import pytest
import trio

from kvfs.net import etcd
from kvfs.net.etcd import EtcdClient, EtcdError, create_revision_is, delete, find_leader, leader_key, put


def run(function, *args):  # type: ignore[no-untyped-def]
    return trio.run(function, *args)


def test_parse_endpoints() -> None:
    assert etcd.parse_endpoints("http://a:1,b:2") == ["http://a:1", "http://b:2"]
    assert etcd.parse_endpoints("etcd://10.0.0.1:2379, 10.0.0.2:2379") == [
        "http://10.0.0.1:2379", "http://10.0.0.2:2379"]
    for bad in ("", "https://a:1", "a", "a:x", "a:70000"):
        with pytest.raises(ValueError):
            etcd.parse_endpoints(bad)


def test_prefix_end() -> None:
    assert etcd.prefix_end(b"/kvfs/a/") == b"/kvfs/a0"
    assert etcd.prefix_end(b"a\xff") == b"b"
    assert etcd.prefix_end(b"\xff") == b"\0"


def test_get_put_pages_and_fenced_txn(etcd_cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        client = EtcdClient(etcd_cluster.urls)
        try:
            assert await client.get(b"/t/missing") is None
            ok, revision, _ = await client.txn([create_revision_is(b"/t/leader", 0)], [put(b"/t/leader", b"me")])
            assert ok and revision > 0
            value, epoch = await client.get(b"/t/leader")  # type: ignore[misc]
            assert value == b"me" and epoch == revision
            # A second campaign fails: the key exists.
            ok, _, _ = await client.txn([create_revision_is(b"/t/leader", 0)], [put(b"/t/leader", b"other")])
            assert not ok
            # 300 keys in pages of 64 (one snapshot), in key order, binary values intact.
            for start in range(0, 300, 100):
                ok, _, _ = await client.txn([create_revision_is(b"/t/leader", epoch)],
                                            [put(b"/t/k/%05d" % i, bytes([i % 256, 0, 255])) for i in
                                             range(start, start + 100)])
                assert ok
            seen = [(k, v) async for k, v in client.get_prefix(b"/t/k/", limit=64)]
            assert seen == [(b"/t/k/%05d" % i, bytes([i % 256, 0, 255])) for i in range(300)]
            # History before a compaction is gone; the present is intact; compacting again is fine.
            ok, now, _ = await client.txn([], [put(b"/t/k/00000", b"new")])
            await client.compact(now)
            await client.compact(now - 1)
            found = await client.get(b"/t/k/00000")
            assert found is not None and found[0] == b"new"
            with pytest.raises(EtcdError, match="compacted"):
                await client._call("/v3/kv/range", {"key": "L3Qvay8wMDAwMA==", "revision": str(now - 1)})
            # A write fenced on a stale epoch lands nothing.
            await client.txn([], [delete(b"/t/leader")])
            await client.txn([create_revision_is(b"/t/leader", 0)], [put(b"/t/leader", b"new")])
            ok, _, _ = await client.txn([create_revision_is(b"/t/leader", epoch)], [put(b"/t/k/stale", b"x")])
            assert not ok and await client.get(b"/t/k/stale") is None
        finally:
            await client.aclose()

    run(main)


def test_lease_keepalive_expiry_and_leader(etcd_cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        client = EtcdClient(etcd_cluster.urls)
        try:
            lease = await client.grant(2)
            assert await client.keepalive(lease) > 0
            key = leader_key("c1")
            ok, revision, _ = await client.txn([create_revision_is(key, 0)],
                                               [put(key, etcd.leader_value("127.0.0.1:9", "master"), lease)])
            assert ok
            assert await find_leader(client, "c1") == ("127.0.0.1:9", revision)
            await client.revoke(lease)
            assert await find_leader(client, "c1") is None  # the lease held the key
            assert await client.keepalive(lease) == 0
            await client.revoke(lease)  # already gone: not an error
            # A lease not kept alive expires, and the key goes with it (bounded poll).
            short = await client.grant(1)
            await client.txn([], [put(key, etcd.leader_value("127.0.0.1:10", "m2"), short)])
            with trio.fail_after(10):
                while await find_leader(client, "c1") is not None:
                    await trio.sleep(0.1)
        finally:
            await client.aclose()

    run(main)


def test_failover_to_next_endpoint(etcd_cluster) -> None:  # type: ignore[no-untyped-def]
    async def main(first_down: str) -> None:
        client = EtcdClient(etcd_cluster.urls, timeout_s=1.0)
        try:
            ok, _, _ = await client.txn([], [put(b"/t/" + first_down.encode(), b"1")])
            assert ok
            found = await client.get(b"/t/" + first_down.encode())
            assert found is not None and found[0] == b"1"
            assert client.failovers >= 1  # the first endpoint did not answer
        finally:
            await client.aclose()

    etcd_cluster.kill(0)
    etcd_cluster.wait_healthy()  # the others elect a raft leader if it was theirs
    trio.run(main, "killed")
    etcd_cluster.restart(0)
    etcd_cluster.wait_healthy()
    etcd_cluster.stop(0)
    etcd_cluster.wait_healthy()
    try:
        trio.run(main, "frozen")
    finally:
        etcd_cluster.cont(0)


def test_no_endpoint_answers_names_each(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from etcd import free_ports

    ports = free_ports(2)
    client = EtcdClient([f"http://127.0.0.1:{p}" for p in ports], timeout_s=0.5)
    with pytest.raises(EtcdError) as caught:
        run(client.get, b"x")
    for port in ports:
        assert f"127.0.0.1:{port}" in str(caught.value)


def test_a_member_restarted_under_idle_connections_answers_at_once(etcd_cluster) -> None:  # type: ignore[no-untyped-def]
    """The client's idle connection to a restarted member is dead: the call goes on a new one
    to the same member, not to the next endpoint and not as an error."""
    client = EtcdClient(etcd_cluster.urls[:1])

    async def get() -> None:
        await client.txn([], [put(b"/t/r", b"1")])

    trio.run(get)
    etcd_cluster.kill(0)
    etcd_cluster.restart(0)
    etcd_cluster.wait_healthy()
    trio.run(get)
    assert client.failovers == 0
    trio.run(client.aclose)


def test_watch_streams_puts_and_deletes_in_order_and_says_when_compacted(etcd_cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        # The first endpoint has nothing listening: the watch is taken by the next one.
        client = EtcdClient(["http://127.0.0.1:1", *etcd_cluster.urls])
        try:
            _, first, _ = await client.txn([], [put(b"/w/a", b"1"), put(b"/w/b", b"2" * 100_000)])
            _, second, _ = await client.txn([], [delete(b"/w/a"), put(b"/x", b"elsewhere")])
            seen: list[etcd.Event] = []
            with trio.fail_after(10):
                async for events in client.watch(b"/w/", first):
                    seen.extend(events)
                    if seen and seen[-1].revision >= second:
                        break
            assert seen == [etcd.Event(b"/w/a", b"1", first), etcd.Event(b"/w/b", b"2" * 100_000, first),
                            etcd.Event(b"/w/a", None, second)]
            assert [entry async for entry in client.get_prefix(b"/w/")] == [(b"/w/b", b"2" * 100_000)]
            await client.compact(second)
            with pytest.raises(etcd.Compacted) as compacted:
                async for _ in client.watch(b"/w/", first):
                    pass
            assert compacted.value.revision == second
            with pytest.raises(etcd.Compacted):
                [page async for page in client.pages(b"/w/", revision=first)]
        finally:
            await client.aclose()

    run(main)
