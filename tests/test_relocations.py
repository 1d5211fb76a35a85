"""A rename's records to rewrite (kvfs.cluster.relocations): the master's work per request
and per step and every answer bounded whatever the subtree, each file's own node told with
its heartbeats, and what a restart loses derived again from the registration's report.
The real-process side (mounts, SSD indexes, a master restart) is in test_relocations_cluster."""

from __future__ import annotations

import msgspec
import pytest

from kvfs.clock import ManualClock
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.relocations import BEAT_IDS
from kvfs.wire import messages as m
from kvfs.wire.protocol import MAX_HEADER, FrameKind, HeaderDecoder, ProtocolError, encode_frame
from kvfs.policy import LruPolicy


def cluster(slice_items: int = 100) -> MetadataService:
    return MetadataService(ManualClock(), LruPolicy(), MasterSettings(cluster=True, relocate_slice=slice_items))


def join(master: MetadataService, name: str, held: list[m.Held] = ()) -> int:
    node = master.handle(m.Register(name, f"{name}:1"), 0).node
    for start in range(0, max(len(held), 1), 2000):
        master.handle(m.Report(list(held[start:start + 2000])), node)
    master.handle(m.FinishRegistration(), node)
    return node


def store_on_disk(master: MetadataService, node: int, parent: int, name: bytes) -> int:
    opened = master.handle(m.Create(parent, name, 0o644, 0, 0, node, True), node)
    master.handle(m.Seal(opened.version, 100, 1, [7]), node)
    master.handle(m.Release(opened.version, True), node)
    master.handle(m.Offloaded([opened.version]), node)
    return opened.version


def beat(master: MetadataService, node: int) -> m.Beat:
    return master.handle(m.Heartbeat(1 << 30, 0), node)


def delivered(master: MetadataService, node: int) -> list[int]:
    """Everything the node's heartbeats carry until its outbox is empty."""
    got: list[int] = []
    while True:
        relocated = beat(master, node).relocated
        if not relocated:
            return got
        assert len(relocated) <= BEAT_IDS
        got += relocated


def test_a_directory_rename_answers_at_once_and_each_node_gets_its_own_files_in_slices() -> None:
    master = cluster(slice_items=100)
    a, b = join(master, "a"), join(master, "b")
    top = master.handle(m.MkDir(ROOT_INO, b"model", 0o755, 0, 0), a).ino
    inner = master.handle(m.MkDir(top, b"layer", 0o755, 0, 0), a).ino
    mine: dict[int, set[int]] = {a: set(), b: set()}
    for i in range(1500):
        node = a if i % 3 else b
        mine[node].add(store_on_disk(master, node, inner if i % 2 else top, b"f%d" % i))
    master.handle(m.Create(top, b"dram-only", 0o644, 0, 0, a, True), a)  # not on SSD: no record to rewrite
    steps = master.backlog.steps
    done = master.handle(m.Rename(ROOT_INO, b"model", ROOT_INO, b"moved", False), a)
    assert done.relocated == []  # the caller's files too: in the background, not before the reply
    assert master.backlog.steps == steps + 1  # one step of the walk ran with the request
    master.backlog.drain()
    assert master.backlog.steps - steps >= 1500 // 100  # a slice of 100 entries per step
    assert master.relocations.walked == 1500 + 2  # every entry once (files, the subdirectory, dram-only)
    for node in (a, b):
        got = delivered(master, node)
        assert sorted(got) == sorted(mine[node])  # each node its own files, each once
    # The same rules as before for a file: the caller's own is in the answer, another node's
    # goes to that node.
    version_a = next(iter(mine[a]))
    file_ino = master.objects.versions[version_a].ino
    name = master.ns.inodes[file_ino].name
    parent = master.ns.inodes[file_ino].parent
    assert master.handle(m.Rename(parent, name, parent, b"renamed-by-a", False), a).relocated == [version_a]
    assert master.handle(m.Rename(parent, b"renamed-by-a", parent, b"renamed-by-b", False), b).relocated == []
    master.backlog.drain()
    assert delivered(master, a) == [version_a] and delivered(master, b) == []


def test_more_files_than_one_old_answer_held_rename_within_every_frame() -> None:
    """300K files on SSD: the list the answer used to carry (about 4.5 bytes a version) is over
    a frame header's 1 MiB; now the answer is a few bytes and each heartbeat within bounds."""
    master = cluster(slice_items=1024)
    a = join(master, "a")
    top = master.handle(m.MkDir(ROOT_INO, b"big", 0o755, 0, 0), a).ino
    count = 300_000
    versions: list[int] = []
    for start in range(0, count, 50_000):
        block = master.handle(m.GrantNumbers(50_000), a)
        for offset in range(50_000):
            ino, version = block.first_ino + offset, block.first_version + offset
            master.handle(m.Publish(top, b"k%07d.bin" % (start + offset), a, ino, version, 0o644, 0, 0, 100, [7],
                                    1, 1, sealed=True), a)
            versions.append(version)
        master.handle(m.Offloaded(versions[start:]), a)
    old_answer = msgspec.msgpack.encode(m.Done([], versions, []))
    assert len(old_answer) > MAX_HEADER
    done = master.handle(m.Rename(ROOT_INO, b"big", ROOT_INO, b"bigger", False), a)
    assert len(encode_frame(FrameKind.RESPONSE, 1, done)) < 1024
    master.backlog.drain()
    beats = 0
    got: list[int] = []
    while True:
        answer = beat(master, a)
        assert len(encode_frame(FrameKind.RESPONSE, 1, answer)) < MAX_HEADER
        if not answer.relocated:
            break
        beats += 1
        got += answer.relocated
    assert sorted(got) == versions and beats == -(-count // BEAT_IDS)


def record(path: list[bytes]) -> m.FileRecord:
    return m.FileRecord(path, 100, 0o100644, 0, 0, 1, {})


def test_a_registration_names_again_the_records_a_restart_left_stale() -> None:
    """What the master held in memory (walks, outboxes) is gone after a restart or a failover;
    the registration that follows reports every record on SSD with its path, and the stale
    ones are named again. So is a node that restarted before it rewrote them."""
    master = cluster()
    a = join(master, "a")
    top = master.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), a).ino
    moved = store_on_disk(master, a, top, b"x")
    kept = store_on_disk(master, a, ROOT_INO, b"y")
    master.handle(m.Rename(ROOT_INO, b"d", ROOT_INO, b"e", False), a)
    master.backlog.drain()
    assert master.relocations.pending(a) == 1
    # The node registers again (a new connection) before the heartbeat that would carry it.
    held = [m.Held(moved, 100, True, True, 0, [7], record([b"d", b"x"])),
            m.Held(kept, 100, True, True, 0, [7], record([b"y"]))]
    assert join(master, "a", held) == a
    assert delivered(master, a) == [moved]  # once: the outbox started again from the report
    held[0] = m.Held(moved, 100, True, True, 0, [7], record([b"e", b"x"]))  # rewritten
    join(master, "a", held)
    assert delivered(master, a) == [] and master.relocations.found_stale == 1


def test_a_node_down_at_the_rename_is_told_by_its_registration() -> None:
    master = cluster()
    a, b = join(master, "a"), join(master, "b")
    top = master.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), a).ino
    on_b = store_on_disk(master, b, top, b"x")
    for _ in range(20):  # b falls silent and is declared dead
        master.clock.advance(0.25)
        beat(master, a)
        master.expire_nodes()
    assert not master.registry.nodes[b].live
    master.handle(m.Rename(ROOT_INO, b"d", ROOT_INO, b"e", False), a)
    master.backlog.drain()
    assert master.relocations.pending(b) == 0  # nothing kept for a node that registers before it hears
    join(master, "b", [m.Held(on_b, 100, True, True, 0, [7], record([b"d", b"x"]))])
    assert delivered(master, b) == [on_b]


def test_a_forgotten_node_takes_its_outbox_with_it() -> None:
    master = cluster()
    a, b = join(master, "a"), join(master, "b")
    top = master.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), a).ino
    store_on_disk(master, b, top, b"x")
    master.handle(m.Rename(ROOT_INO, b"d", ROOT_INO, b"e", False), a)
    master.backlog.drain()
    assert master.relocations.pending(b) == 1
    for _ in range(20):  # b falls silent and is declared dead
        master.clock.advance(0.25)
        beat(master, a)
        master.expire_nodes()
    master.handle(m.RemoveNode("b"), a)
    master.pending_work(1.0)
    assert master.relocations.pending(b) == 0


@pytest.mark.parametrize("relocated", [[0], [-1], [None], ["7"], [1.5], [[1]], 7, list(range(1, (1 << 15) + 2))])
def test_a_heartbeat_answer_with_relocated_versions_out_of_range_is_refused(relocated: list) -> None:
    raw = msgspec.msgpack.encode({"dropped": [], "forget": [], "pushed": 0, "relocated": relocated})
    with pytest.raises(ProtocolError):
        HeaderDecoder(m.Beat).decode(raw)


def test_a_heartbeat_answer_with_relocated_versions_decodes() -> None:
    raw = msgspec.msgpack.encode(m.Beat([], [], 0, [1, 2**63]))
    assert HeaderDecoder(m.Beat).decode(raw).relocated == [1, 2**63]
    assert HeaderDecoder(m.Beat).decode(msgspec.msgpack.encode({"dropped": [], "forget": []})).relocated == []
