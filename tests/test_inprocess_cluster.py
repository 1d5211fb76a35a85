"""A master and two nodes in one process: one MetadataService shared through in-process
clients that each speak for their node, chunks moved between the nodes' stores by an
in-memory transport, heartbeats and the master's expiry passes as tasks, all under trio's
MockClock (tests/inprocess.py). What needs seconds of real time between processes (a node
declared dead, a stalled master, the seal wait, the peer budget, prefetch lifetimes) runs
here in virtual time; each test ends with the consistency check across the master and
both nodes.
"""

from __future__ import annotations

import errno
import os
import random
import stat
from pathlib import Path

import pyfuse3
import pytest
import trio

from kvfs.cluster.master import MasterSettings
from kvfs.cluster.namespace import ROOT_INO
from kvfs.errors import MetadataError
from kvfs.wire import messages as m
from kvfs.node.membership import HEARTBEAT_S
from kvfs.node.prefetch import PAUSE_S, TTL_S, WINDOW
from kvfs.node.service import PEER_BUDGET_S, SEAL_WAIT_S
from inprocess import (CHUNK, ROOT, Cluster, Link, check_consistency, content, lookup, read_file, run_cluster,
                       write_file)

DEAD_AFTER_S = MasterSettings().dead_after_s


def version_of(cluster: Cluster, ino: int) -> int:
    return cluster.service.ns.inodes[ino].version


def test_a_file_written_on_one_node_is_read_on_the_other_and_rewritten_there(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        assert (a.node_id, b.node_id) == (1, 2)  # each client speaks for its own node
        data = content(1, 3 * CHUNK + 5)
        ino = await write_file(a, b"block.tmp", data, rename_to=b"block")
        first = version_of(cluster, ino)
        assert await lookup(b, b"block") == ino
        assert await read_file(b, ino) == data
        assert b.node.reader_opens["peer"] == 1 and first not in b.store  # read from A's store, kept nowhere
        assert b.transport is not None and first in b.transport.versions_fetched()
        # B writes a new version: A's old one goes (dropped with A's next heartbeat).
        info = await b.ops.open(ino, os.O_WRONLY | os.O_TRUNC, ROOT)
        await b.ops.write(info.fh, 0, b"new")
        await b.ops.release(info.fh)
        assert await read_file(a, ino) == b"new"
        assert version_of(cluster, ino) in b.store
        await trio.sleep(1)
        assert first not in a.store

    run_cluster(tmp_path, scenario)


def test_a_reader_on_one_node_keeps_the_version_it_opened_while_the_other_node_rewrites_it(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        old, new = content(20, 3 * CHUNK), content(21, 2 * CHUNK)
        ino = await write_file(a, b"shared", old)
        first = version_of(cluster, ino)
        reader = await b.ops.open(await lookup(b, b"shared"), os.O_RDONLY, ROOT)
        writer = await a.ops.open(ino, os.O_WRONLY | os.O_TRUNC, ROOT)  # copy-on-write: a new version
        await a.ops.write(writer.fh, 0, new)
        await a.ops.release(writer.fh)
        assert version_of(cluster, ino) != first and first in a.store  # retired, kept for B's reader
        assert bytes(await b.ops.read(reader.fh, 0, len(old))) == old  # the bytes it opened
        await b.ops.release(reader.fh)
        await trio.sleep(1)  # the drop reaches A with its heartbeat
        assert first not in a.store
        assert await read_file(b, ino) == new
        assert ino in b.kernel.invalidated_attrs  # B's kernel re-reads the size of the new version

    run_cluster(tmp_path, scenario)


def test_a_node_that_stops_heartbeating_is_declared_dead_after_dead_after_and_comes_back(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        ino = await write_file(b, b"on-b", content(2, CHUNK))
        b.heartbeating = False
        last_seen = cluster.service.registry.nodes[b.node_id].last_seen
        while cluster.is_live(b):
            await trio.sleep(0.05)
        (declared, dead), = cluster.declared_dead
        assert dead == b.node_id and cluster.is_live(a)
        assert DEAD_AFTER_S < declared - last_seen <= DEAD_AFTER_S + cluster.service.settings.expire_interval_s
        assert await lookup(a, b"on-b") == 0  # its files are hidden while it is down...
        b.heartbeating = True
        while not cluster.is_live(b):
            await trio.sleep(0.05)
        assert b.rejoined == 1  # ...and back once it registered again (ESTALE, then Register)
        assert await lookup(a, b"on-b") == ino
        assert await read_file(a, ino) == content(2, CHUNK)

    run_cluster(tmp_path, scenario)


def test_a_dead_owners_file_is_absent_to_the_kernels_retry_before_the_push_arrives(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        ino = await write_file(a, b"owned", content(5, CHUNK))
        await write_file(a, b"other", content(6, CHUNK))
        assert await lookup(b, b"other") and await lookup(b, b"owned") == ino  # the second copies the root
        assert b.node.dircache is not None and ROOT_INO in b.node.dircache
        cluster.pushing = trio.Event()  # the master's push of the death reaches b late
        a.heartbeating = False
        while cluster.is_live(a):
            await trio.sleep(0.05)
        with pytest.raises(pyfuse3.FUSEError) as failed:  # the kernel's inode is gone: it looks the name up again
            await b.ops.open(ino, os.O_RDONLY, ROOT)
        assert failed.value.errno == errno.ESTALE
        assert await lookup(b, b"owned") == 0  # and gets ENOENT, not the gone inode from b's copy
        cluster.pushing.set()
        a.heartbeating = True
        while not cluster.is_live(a):
            await trio.sleep(0.05)
        assert await lookup(b, b"owned") == ino and await read_file(b, ino) == content(5, CHUNK)

    run_cluster(tmp_path, scenario)


def test_a_master_stall_longer_than_dead_after_convicts_nobody(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        await trio.sleep(1)  # the master's expiry passes are running
        # No heartbeat answered, no expiry pass; then a pass before the queued heartbeats.
        await cluster.stall(2 * DEAD_AFTER_S, expire_first=True)
        await trio.sleep(DEAD_AFTER_S)
        assert cluster.declared_dead == [] and cluster.is_live(a) and cluster.is_live(b)
        assert cluster.service.liveness.stalls == 1
        # The judge still judges: a node silent for dead_after of the master's own time dies.
        a.heartbeating = False
        await trio.sleep(DEAD_AFTER_S + 1)
        assert [node for _, node in cluster.declared_dead] == [a.node_id] and cluster.is_live(b)
        a.heartbeating = True
        await trio.sleep(1)
        assert cluster.is_live(a)

    run_cluster(tmp_path, scenario)


def test_an_open_waits_for_the_writers_seal_on_another_node_up_to_the_seal_wait(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        data = content(3, 2 * CHUNK)
        for name, closes_after in ((b"quick", SEAL_WAIT_S / 2), (b"slow", SEAL_WAIT_S * 2)):
            info, entry = await a.ops.create(ROOT_INO, name, stat.S_IFREG | 0o644, os.O_CREAT, ROOT)
            await a.ops.write(info.fh, 0, data)
            started = trio.current_time()

            async def close_later() -> None:
                await trio.sleep(closes_after)
                await a.ops.release(info.fh)  # the RELEASE that seals it

            async with trio.open_nursery() as nursery:
                nursery.start_soon(close_later)
                assert await lookup(b, name) == entry.st_ino
                reader = await b.ops.open(entry.st_ino, os.O_RDONLY, ROOT)
                waited = trio.current_time() - started
                got = bytes(await b.ops.read(reader.fh, 0, len(data)))
                await b.ops.release(reader.fh)
            if name == b"quick":  # sealed within the wait: the whole file
                assert closes_after <= waited < SEAL_WAIT_S and got == data
            else:  # written for longer: it reads as empty (close-to-open), after the whole wait
                assert SEAL_WAIT_S <= waited < closes_after and got == b""
                assert await read_file(b, entry.st_ino) == data  # once sealed, all of it

    run_cluster(tmp_path, scenario)


def test_a_writer_on_another_node_waits_for_the_seal_then_copies_the_bytes_or_gets_ebusy(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        data = content(12, 2 * CHUNK + 9)
        for name, closes_after in ((b"quick", SEAL_WAIT_S / 2), (b"slow", SEAL_WAIT_S * 2)):
            info, entry = await a.ops.create(ROOT_INO, name, stat.S_IFREG | 0o644, os.O_CREAT, ROOT)
            await a.ops.write(info.fh, 0, data)
            started = trio.current_time()

            async def close_later() -> None:
                await trio.sleep(closes_after)
                await a.ops.release(info.fh)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(close_later)
                assert await lookup(b, name) == entry.st_ino
                if name == b"quick":  # sealed within the wait: B writes a new version of A's bytes
                    writer = await b.ops.open(entry.st_ino, os.O_WRONLY, ROOT)
                    assert closes_after <= trio.current_time() - started < SEAL_WAIT_S
                    await b.ops.write(writer.fh, 0, b"B")
                    await b.ops.release(writer.fh)
                else:  # still written there after the wait: busy
                    with pytest.raises(pyfuse3.FUSEError) as failed:
                        await b.ops.open(entry.st_ino, os.O_WRONLY, ROOT)
                    assert failed.value.errno == errno.EBUSY
                    assert SEAL_WAIT_S <= trio.current_time() - started < closes_after
            expected = b"B" + data[1:] if name == b"quick" else data
            assert await read_file(a, entry.st_ino) == expected

    run_cluster(tmp_path, scenario)


def test_an_open_of_a_silent_owners_file_fails_with_eio_within_the_peer_budget(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        data = content(4, 2 * CHUNK)
        ino = await write_file(a, b"owned", data)
        cluster.network.freeze(a.address)  # its peer server sends nothing (its master link lives)
        started = trio.current_time()
        with pytest.raises(pyfuse3.FUSEError) as failed:
            await b.ops.open(await lookup(b, b"owned"), os.O_RDONLY, ROOT)
        assert failed.value.errno == errno.EIO  # slow is not absent: never ENOENT
        assert PEER_BUDGET_S <= trio.current_time() - started < PEER_BUDGET_S + 0.5
        cluster.network.thaw(a.address)
        assert await read_file(b, ino) == data

    run_cluster(tmp_path, scenario)


def test_a_prefetch_started_by_a_lookup_is_claimed_within_its_ttl_and_dropped_after(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        names = (b"f", b"g", b"h")
        files = {name: await write_file(a, name, content(index, 2 * CHUNK)) for index, name in enumerate(names)}
        fetched = {name: version_of(cluster, ino) for name, ino in files.items()}
        assert b.transport is not None and b.node.prefetches is not None
        prefetches, transport = b.node.prefetches, b.transport

        def fetches(name: bytes) -> int:
            return transport.versions_fetched().count(fetched[name])

        assert await lookup(b, b"f") == files[b"f"]  # starts fetching f
        await trio.sleep(TTL_S / 2)
        assert await read_file(b, files[b"f"]) == content(0, 2 * CHUNK)
        assert prefetches.claimed == 1 and fetches(b"f") == 1  # the open adopted it
        assert await lookup(b, b"g") == files[b"g"]
        await trio.sleep(TTL_S + 0.5)  # g is not opened in time: the next lookup drops it
        assert await lookup(b, b"h") == files[b"h"]
        assert prefetches.wasted == 1 and prefetches.started == 3
        assert await read_file(b, files[b"g"]) == content(1, 2 * CHUNK)
        assert await read_file(b, files[b"h"]) == content(2, 2 * CHUNK)
        assert (fetches(b"g"), fetches(b"h"), prefetches.claimed) == (2, 1, 2)

    run_cluster(tmp_path, scenario)


def test_a_file_rewritten_between_the_lookup_and_the_open_is_read_new_and_its_old_prefetch_not_adopted(
        tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        ino = await write_file(a, b"f", content(7, 2 * CHUNK))
        old = version_of(cluster, ino)
        assert b.transport is not None and b.node.prefetches is not None
        prefetches, transport = b.node.prefetches, b.transport
        assert await lookup(b, b"f") == ino and prefetches.started == 1  # fetching the old version
        info = await a.ops.open(ino, os.O_WRONLY | os.O_TRUNC, ROOT)  # rewritten on A, same size
        for start in range(0, 2 * CHUNK, CHUNK):
            await a.ops.write(info.fh, start, content(8, 2 * CHUNK)[start:start + CHUNK])
        await a.ops.release(info.fh)
        assert version_of(cluster, ino) != old
        assert await read_file(b, ino) == content(8, 2 * CHUNK)  # the kernel's entry is the old one: open by inode
        assert prefetches.claimed == 0 and transport.versions_fetched().count(version_of(cluster, ino)) == 1
        await trio.sleep(TTL_S + 0.5)
        assert await lookup(b, b"f") == ino  # a lookup after the TTL drops the old prefetch
        assert prefetches.wasted == 1

    run_cluster(tmp_path, scenario)


def test_names_looked_up_and_never_opened_shut_the_prefetch_gate_for_its_pause(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        names = [f"n{index}".encode() for index in range(WINDOW + 3)]
        inos = [await write_file(a, name, content(index, 100)) for index, name in enumerate(names)]
        assert b.node.prefetches is not None
        prefetches = b.node.prefetches
        for name in names[:WINDOW]:  # `ls -l`: each name looked up, none opened within TTL_S
            assert await lookup(b, name)
            await trio.sleep(TTL_S + 0.1)
        assert (prefetches.started, prefetches.wasted, prefetches.gate.pauses) == (WINDOW, WINDOW - 1, 0)
        assert await lookup(b, names[WINDOW])  # drops the last one: all of the window unclaimed
        assert (prefetches.started, prefetches.gate.pauses) == (WINDOW, 1)  # shut: this one not fetched
        await trio.sleep(PAUSE_S - 0.5)
        assert await lookup(b, names[WINDOW + 1]) and prefetches.started == WINDOW  # still shut
        await trio.sleep(0.5)
        assert await lookup(b, names[WINDOW + 2]) and prefetches.started == WINDOW + 1  # open again
        assert await read_file(b, inos[-1]) == content(WINDOW + 2, 100)
        assert prefetches.claimed == 1

    run_cluster(tmp_path, scenario)


def test_pressure_on_one_node_evicts_its_own_oldest_files_and_the_other_node_forgets_their_names(
        tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        theirs = {name: await write_file(b, name, content(9, 4 * CHUNK)) for name in (b"b0", b"b1")}
        names = [f"a{index}".encode() for index in range(8)]
        for index, name in enumerate(names[:4]):  # A's tier full of its own files
            await write_file(a, name, content(index, 4 * CHUNK))
            assert await lookup(b, name) != 0  # B's kernel references them (and B copies the directory)
        for index, name in enumerate(names[4:], 4):
            await write_file(a, name, content(index, 4 * CHUNK))
        assert a.node.evicted_files == 4 and b.node.evicted_files == 0
        await trio.sleep(1)  # the next heartbeats bring B the names to forget
        assert sorted(b.kernel.invalidated_entries) == sorted((ROOT_INO, name) for name in names[:4])
        answered = b.node.dircache.answered if b.node.dircache is not None else 0
        assert [await lookup(b, name) == 0 for name in names] == [True] * 4 + [False] * 4
        assert b.node.dircache is not None and b.node.dircache.answered == answered + 4  # from B's own copy
        for name, ino in theirs.items():
            assert await read_file(a, ino) == content(9, 4 * CHUNK), name

    run_cluster(tmp_path, scenario)


def test_the_consistency_check_finds_an_orphan_and_a_disagreement(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        ino = await write_file(a, b"file", content(5, CHUNK))
        orphan = 10_000
        a.store.create(orphan)
        await a.store.write(orphan, 0, b"o" * 100)
        a.store.seal(orphan, 100)
        with pytest.raises(AssertionError, match=f"stores version {orphan}, which the master does not place"):
            check_consistency(cluster.service, cluster.members)
        a.store.drop(orphan)
        version = cluster.service.objects.versions[version_of(cluster, ino)]
        version.size += 1
        with pytest.raises(AssertionError, match="size or checksums differ from the master's"):
            check_consistency(cluster.service, cluster.members)
        version.size -= 1
        check_consistency(cluster.service, cluster.members)

    run_cluster(tmp_path, scenario)


def test_a_dead_nodes_readers_no_longer_pin_the_owners_files(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        pinned = await write_file(a, b"pinned", content(6, 8 * CHUNK))
        reader = await b.ops.open(await lookup(b, b"pinned"), os.O_RDONLY, ROOT)  # B reads it
        await write_file(a, b"other", content(7, 8 * CHUNK))  # A's tier is full
        await write_file(a, b"more", content(8, 4 * CHUNK))  # room made: not from the file B reads
        assert await lookup(a, b"pinned") == pinned and await lookup(a, b"other") == 0
        b.heartbeating = False
        while cluster.is_live(b):
            await trio.sleep(0.05)
        await write_file(a, b"last", content(9, 8 * CHUNK))  # B's read went with B: evictable now
        assert await lookup(a, b"pinned") == 0
        b.heartbeating = True
        while not cluster.is_live(b):
            await trio.sleep(0.05)
        await b.ops.release(reader.fh)  # its reference died with the old registration: nothing to release

    run_cluster(tmp_path, scenario)


def test_a_node_cut_off_from_the_master_serves_its_files_and_reports_what_it_sealed_meanwhile(
        tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        link = a.link
        assert isinstance(link, Link)
        kept = await write_file(a, b"kept", content(10, CHUNK))
        info, entry = await a.ops.create(ROOT_INO, b"late", stat.S_IFREG | 0o644, os.O_CREAT, ROOT)
        await a.ops.write(info.fh, 0, content(11, 2 * CHUNK))
        link.cut()
        assert await read_file(a, kept) == content(10, CHUNK)  # from its own tier, without the master
        assert a.node.degraded_reads == 1
        await a.ops.release(info.fh)  # sealed here; the master cannot hear of it (after --master-wait)
        assert list(a.node.membership.unreported_seals) == [version_of(cluster, entry.st_ino)]
        assert not cluster.is_live(a)  # declared dead meanwhile: its files are hidden from B
        assert await lookup(b, b"kept") == 0
        await link.restore(a)  # registers again, reporting the seal
        assert a.node.membership.unreported_seals == {} and cluster.is_live(a)
        assert await read_file(b, await lookup(b, b"late")) == content(11, 2 * CHUNK)
        assert await read_file(b, await lookup(b, b"kept")) == content(10, CHUNK)

    run_cluster(tmp_path, scenario)


def test_a_request_the_wire_cannot_carry_fails_with_einval_and_changes_nothing(tmp_path: Path) -> None:
    async def scenario(cluster: Cluster) -> None:
        a, _ = cluster.members
        assert a.client is not None
        inodes = len(cluster.service.ns.inodes)
        with pytest.raises(MetadataError) as refused:  # an inode past 64 bits: never sent
            await a.client.call(m.MkDir(2**64, b"d", 0o755, 0, 0))
        assert refused.value.errno == errno.EINVAL and "cannot carry" in str(refused.value)
        with pytest.raises(pyfuse3.FUSEError) as failed:  # a mode the protocol bounds: its errno through FUSE
            await a.ops.mkdir(ROOT_INO, b"d", 0o1000000, ROOT)
        assert failed.value.errno == errno.EINVAL
        assert len(cluster.service.ns.inodes) == inodes

    run_cluster(tmp_path, scenario)


@pytest.mark.parametrize("seed", range(1, 9))
def test_random_writes_rewrites_reads_and_removals_on_both_nodes_stay_consistent(tmp_path: Path, seed: int) -> None:
    """A seeded sequence of the kernel's requests on either node, a heartbeat apart, the
    tiers under pressure (evictions), with longer pauses: every file found has the bytes
    last published under its name, and the check holds after every pause."""
    rng = random.Random(seed)
    names = [f"k{index}".encode() for index in range(12)]

    async def scenario(cluster: Cluster) -> None:
        published: dict[bytes, int] = {}  # name -> seed of the bytes last published under it
        for step in range(150):
            for member in cluster.members:  # the kernels keep no entry of a removed file for long
                member.kernel.drop_caches()
            # A heartbeat apart: the master's pushes are in, and so are the drops it queued for
            # each node (see the next test for a write that comes sooner).
            await trio.sleep(HEARTBEAT_S * 1.1)
            member = rng.choice(cluster.members)
            name = rng.choice(names)
            action = rng.random()
            if action < 0.45:
                published[name] = step
                await write_file(member, name + b".tmp", content(step, rng.randint(1, 6 * CHUNK)),
                                 rename_to=name)
            elif action < 0.8:
                ino = await lookup(member, name)
                if ino == 0:  # never written, removed, or evicted (whole) for room
                    published.pop(name, None)
                    continue
                assert name in published, name
                data = await read_file(member, ino)
                assert data == content(published[name], len(data)) and data, (step, name)
            elif action < 0.9:
                if await lookup(member, name):
                    await member.ops.unlink(ROOT_INO, name, ROOT)
                published.pop(name, None)
            else:
                await trio.sleep(rng.uniform(0, 2))
                check_consistency(cluster.service, cluster.members)
        assert sum(member.node.evicted_files for member in cluster.members) > 0  # the tiers were full

    run_cluster(tmp_path, scenario)


def test_a_write_gets_the_room_of_files_another_node_removed_before_the_next_heartbeat(tmp_path: Path) -> None:
    refused: list[int] = []

    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        names = [f"f{index}".encode() for index in range(4)]
        for index, name in enumerate(names):  # A's tier full
            await write_file(a, name, content(index, 4 * CHUNK))
        for name in names:  # B removes them all: A's copies are garbage now
            assert await lookup(b, name)
            await b.ops.unlink(ROOT_INO, name, ROOT)
        b.kernel.drop_caches()
        try:
            await write_file(a, b"next", content(5, 4 * CHUNK))  # within the same heartbeat period
        except pyfuse3.FUSEError as error:
            refused.append(error.errno)

    run_cluster(tmp_path, scenario)
    # The Reclaim of A's write brings the versions B's unlinks released (not its next heartbeat).
    assert refused == [], f"the write failed: {[errno.errorcode[code] for code in refused]}"


def test_a_stall_before_the_masters_first_expiry_pass_convicts_nobody(tmp_path: Path) -> None:
    convicted: list[int] = []

    async def scenario(cluster: Cluster) -> None:
        # The nodes registered, no expiry pass ran yet: the service's start is the last "pass".
        await cluster.stall(2 * DEAD_AFTER_S, expire_first=True)
        convicted.extend(node for _, node in cluster.declared_dead)

    run_cluster(tmp_path, scenario)
    assert convicted == [], f"declared dead: nodes {convicted}"


def test_a_directorys_attributes_from_a_change_answer_the_kernel_within_its_timeout_from_the_answer(
        tmp_path: Path) -> None:
    """The attributes a mkdir's answer carried for its parent answer the kernel's getattr of
    the parent once, seconds later (beyond the 1 s of kvfs.node.dircache.OwnChanges), valid for
    what is left of the attribute timeout counted from the answer; another node's change there
    shows at the next getattr the kernel sends after that. A directory removed by another node
    is not answered from what this node kept of it."""

    async def scenario(cluster: Cluster) -> None:
        a, b = cluster.members
        timeout = a.ops.entry_timeout
        d = (await a.ops.mkdir(ROOT_INO, b"d", 0o755, ROOT)).st_ino
        await a.ops.mkdir(d, b"e", 0o755, ROOT)  # the kernel drops d's attributes; the answer has them
        made = trio.current_time()
        await b.ops.mkdir(d, b"f", 0o755, ROOT)  # another node's change: d gains a link
        await trio.sleep(timeout / 2)
        kept = await a.ops.getattr(d, ROOT)
        assert kept.st_nlink == 3  # as the mkdir's answer had it: b's change not shown yet
        assert kept.attr_timeout == pytest.approx(timeout - (trio.current_time() - made))
        assert (await a.ops.getattr(d, ROOT)).st_nlink == 4  # the kernel's next getattr asks the master

        g = (await a.ops.mkdir(d, b"g", 0o755, ROOT)).st_ino
        await write_file(a, b"x.tmp", content(1, 100), parent=g, rename_to=b"x")
        await a.ops.rename(g, b"x", d, b"x", 0, ROOT)  # its answer: g's attributes, empty again
        kept = cluster.service.handle(m.GetAttr(g), a.node_id).ctime_ns
        await trio.sleep(2)
        await b.ops.rmdir(d, b"g", ROOT)
        await trio.sleep(HEARTBEAT_S * 2)  # the removal pushed to a
        removed = cluster.service.handle(m.GetAttr(g), a.node_id).ctime_ns  # (a's kernel still holds g)
        assert removed != kept
        assert (await a.ops.getattr(g, ROOT)).st_ctime_ns == removed  # the master's, not what a kept

    run_cluster(tmp_path, scenario)
