"""The master's cluster decisions, driven with plain requests and a manual clock: registration,
heartbeats and death, hidden files, leases across nodes, routing of drops, and its lmdb state."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from kvfs.clock import ManualClock
from kvfs.wire import messages as m
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.persist import MasterState
from kvfs.errors import MetadataError
from kvfs.policy import LruPolicy


class Cluster:
    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.master = MetadataService(clock, LruPolicy(), MasterSettings(cluster=True, dead_after_s=2.5))

    def join(self, name: str, held: list[m.Held] = ()) -> tuple[int, list[int]]:
        node = self.master.handle(m.Register(name, f"{name}:1"), 0).node
        dropped = self.master.handle(m.Report(list(held)), node).dropped
        dropped += self.master.handle(m.FinishRegistration(), node).dropped
        return node, dropped

    def store(self, node: int, name: bytes, size: int = 100, parent: int = ROOT_INO) -> m.Attr:
        opened = self.master.handle(m.Create(parent, name, 0o644, 0, 0, node, True), node)
        self.master.handle(m.Seal(opened.version, size, self.clock.wall_ns(), [11]), node)
        self.master.handle(m.Release(opened.version, True), node)
        return self.master.handle(m.GetAttr(opened.attr.ino), node)

    def lookup(self, node: int, name: bytes) -> m.Attr | None:
        return self.master.handle(m.Lookup(ROOT_INO, name), node).attr

    def beat(self, node: int) -> m.Beat:
        return self.master.handle(m.Heartbeat(1 << 30, 0), node)

    def silence(self, seconds: float, *alive: int) -> list[int]:
        """Time passes; only `alive` nodes heartbeat meanwhile."""
        dead: list[int] = []
        for _ in range(int(seconds * 4)):
            self.clock.advance(0.25)
            for node in alive:
                self.beat(node)
            dead += self.master.expire_nodes()
        return dead


@pytest.fixture
def cluster() -> Cluster:
    return Cluster(ManualClock())


def fails(call, code: int) -> None:
    with pytest.raises(MetadataError) as raised:
        call()
    assert raised.value.errno == code


def test_reads_are_directed_to_the_node_that_stores_the_bytes(cluster: Cluster) -> None:
    a, _ = cluster.join("a")
    b, _ = cluster.join("b")
    attr = cluster.store(a, b"x.bin")
    opened = cluster.master.handle(m.OpenRead(attr.ino), b)
    assert (opened.node, opened.address, opened.checksums) == (a, "a:1", [11])
    assert cluster.master.handle(m.OpenRead(attr.ino), a).address == ""  # local to the writer
    # The reader's lease keeps the file from eviction on its node.
    assert cluster.master.handle(m.Reclaim(a, 1 << 30), a).dropped == []
    cluster.master.handle(m.Release(opened.version, False), b)
    cluster.master.handle(m.Release(opened.version, False), a)
    assert cluster.master.handle(m.Reclaim(a, 1 << 30), a).dropped == [opened.version]


def test_drops_and_removed_names_reach_the_other_nodes_with_their_heartbeat(cluster: Cluster) -> None:
    a, _ = cluster.join("a")
    b, _ = cluster.join("b")
    attr = cluster.store(a, b"x.bin")
    assert cluster.master.handle(m.Unlink(ROOT_INO, b"x.bin"), b).dropped == []  # b does not store it
    beat = cluster.beat(a)
    assert beat.dropped == [attr.version] and beat.forget == [(ROOT_INO, b"x.bin", attr.ino)]
    assert cluster.beat(a) == m.Beat([], [])
    assert cluster.beat(b) == m.Beat([], [])  # its own kernel saw the unlink


def test_a_silent_node_is_declared_dead_within_three_seconds(cluster: Cluster) -> None:
    a, _ = cluster.join("a")
    b, _ = cluster.join("b")
    dram_only = cluster.store(a, b"dram.bin")
    on_ssd = cluster.store(a, b"ssd.bin")
    cluster.master.handle(m.Offloaded([on_ssd.version]), a)
    reader = cluster.master.handle(m.OpenRead(dram_only.ino), b)
    assert cluster.silence(2.0, a, b) == []
    assert cluster.silence(3.0, b) == [a]
    # Its files, in DRAM and on SSD alike, are hidden until it returns.
    assert cluster.lookup(b, b"dram.bin") is None and cluster.lookup(b, b"ssd.bin") is None
    assert cluster.master.handle(m.ReadDir(ROOT_INO, 0, 10), b).entries == []
    fails(lambda: cluster.master.handle(m.OpenRead(on_ssd.ino), b), errno.ENOENT)
    fails(lambda: cluster.beat(a), errno.ESTALE)  # a late heartbeat: register again
    cluster.master.handle(m.Release(reader.version, False), b)
    # It returns after a restart that lost its memory: only what it reports is kept.
    node, dropped = cluster.join("a", [m.Held(on_ssd.version, 100, True, True)])
    assert node == a and dropped == []
    assert cluster.lookup(b, b"ssd.bin").version == on_ssd.version
    assert cluster.lookup(b, b"dram.bin") is None


def test_a_name_taken_while_its_node_was_down_keeps_the_newer_file(cluster: Cluster) -> None:
    a, _ = cluster.join("a")
    b, _ = cluster.join("b")
    old = cluster.store(a, b"k.bin")
    cluster.master.handle(m.Offloaded([old.version]), a)
    cluster.silence(3.0, b)
    new = cluster.store(b, b"k.bin", size=200)  # exclusive create: the hidden file does not count
    _, dropped = cluster.join("a", [m.Held(old.version, 100, True, True)])
    assert dropped == [old.version]
    assert cluster.lookup(a, b"k.bin").version == new.version


def test_a_restarted_node_reports_what_it_holds_and_the_rest_goes(cluster: Cluster) -> None:
    a, _ = cluster.join("a")
    kept = cluster.store(a, b"kept.bin")
    lost = cluster.store(a, b"lost.bin")
    writing = cluster.master.handle(m.Create(ROOT_INO, b"w.tmp", 0o644, 0, 0, a, True), a)
    # Restart before the death was noticed: a new registration replaces the old incarnation.
    _, dropped = cluster.join("a", [m.Held(kept.version, 100, True, True),
                                    m.Held(writing.version, 5, True, False, mtime_ns=42, checksums=[3])])
    assert dropped == []
    assert cluster.lookup(a, b"kept.bin") is not None and cluster.lookup(a, b"lost.bin") is None
    sealed = cluster.lookup(a, b"w.tmp")  # sealed on the node while the master did not hear it
    assert sealed.sealed and sealed.size == 5 and sealed.mtime_ns == 42
    assert lost.version not in cluster.master.objects.versions
    # A version the master never knew, with its SSD record, comes back as a file.
    record = m.FileRecord([b"d", b"restored.bin"], 7, 0o100644, 0, 0, 5, {b"user.k": b"v"})
    _, dropped = cluster.join("a", [m.Held(kept.version, 100, True, True),
                                    m.Held(999, 7, True, True, checksums=[1], record=record)])
    restored = cluster.master.handle(m.Lookup(cluster.lookup(a, b"d").ino, b"restored.bin"), a).attr
    assert restored.version == 999 and restored.size == 7


def test_requests_need_a_registered_node(cluster: Cluster) -> None:
    fails(lambda: cluster.master.handle(m.Report([]), 5), errno.EPROTO)
    fails(lambda: cluster.master.handle(m.Heartbeat(1, 0), 5), errno.ESTALE)
    a, _ = cluster.join("a")
    info = cluster.master.handle(m.ClusterStatus(), 0)
    assert [(n.node, n.name, n.live) for n in info.nodes] == [(a, "a", True)]


def test_state_survives_a_restart_and_nodes_bring_their_files_back(cluster: Cluster, tmp_path: Path) -> None:
    state = MasterState(tmp_path / "state")
    master = cluster.master
    a, _ = cluster.join("a")
    state.save(master)
    d = master.handle(m.MkDir(ROOT_INO, b"dir", 0o755, 0, 0), a)
    state.save(master)
    files = {}
    for name in (b"one.bin", b"two.bin", b"gone.bin"):
        files[name] = cluster.store(a, name, parent=d.ino)
        state.save(master)
    master.handle(m.SetXattr(files[b"one.bin"].ino, b"user.model", b"llama"), a)
    master.handle(m.Rename(d.ino, b"two.bin", ROOT_INO, b"moved.bin"), a)
    master.handle(m.Unlink(d.ino, b"gone.bin"), a)
    state.save(master)
    before = master.handle(m.ReadDir(d.ino, 0, 100), a).entries
    state.close()

    restarted = MetadataService(cluster.clock, LruPolicy(), MasterSettings(cluster=True))
    state = MasterState(tmp_path / "state")
    assert state.load(restarted) == 2
    assert restarted.handle(m.Lookup(ROOT_INO, b"dir"), 0).attr.ino == d.ino
    assert restarted.handle(m.Lookup(ROOT_INO, b"moved.bin"), 0).attr is None  # hidden: node a not back yet
    node = restarted.handle(m.Register("a", "a:1"), 0).node
    assert node == a
    held = [m.Held(files[n].version, 100, True, False) for n in (b"one.bin", b"two.bin")]
    restarted.handle(m.Report(held), a)
    restarted.handle(m.FinishRegistration(), a)
    after = restarted.handle(m.ReadDir(d.ino, 0, 100), a).entries
    assert [(e.name, e.attr.ino, e.attr.size, e.next_id) for e in after] == \
        [(e.name, e.attr.ino, e.attr.size, e.next_id) for e in before]
    assert restarted.handle(m.GetXattr(files[b"one.bin"].ino, b"user.model"), a).value == b"llama"
    assert restarted.handle(m.Lookup(ROOT_INO, b"moved.bin"), a).attr.version == files[b"two.bin"].version
    # New inodes and versions never reuse old numbers.
    fresh = Cluster(cluster.clock)
    fresh.master = restarted
    attr = fresh.store(a, b"new.bin")
    assert attr.ino > max(f.ino for f in files.values()) and attr.version > files[b"gone.bin"].version
    state.close()


def test_symlinks_and_link_counts_survive_a_restart(cluster: Cluster, tmp_path: Path) -> None:
    state = MasterState(tmp_path / "state")
    master = cluster.master
    a, _ = cluster.join("a")
    d = master.handle(m.MkDir(ROOT_INO, b"dir", 0o755, 0, 0), a)
    master.handle(m.MkDir(d.ino, b"sub", 0o755, 0, 0), a)
    link = master.handle(m.Symlink(d.ino, b"latest", b"sub/block.bin", 7, 8), a)
    state.save(master)
    state.close()

    restarted = MetadataService(cluster.clock, LruPolicy(), MasterSettings(cluster=True))
    state = MasterState(tmp_path / "state")
    assert state.load(restarted) == 0  # directories and links are not files
    assert restarted.handle(m.ReadLink(link.ino), 0).target == b"sub/block.bin"
    assert restarted.handle(m.Lookup(d.ino, b"latest"), 0).attr == link
    assert restarted.handle(m.GetAttr(d.ino), 0).nlink == 3
    assert restarted.handle(m.GetAttr(ROOT_INO), 0).nlink == 3
    state.close()


def test_state_saved_before_symlinks_existed_still_loads(tmp_path: Path) -> None:
    """Inodes saved without a target field (the layout before symbolic links) load unchanged."""
    import lmdb
    import msgspec

    env = lmdb.open(str(tmp_path / "master.lmdb"), max_dbs=3, subdir=True)
    inodes, meta = env.open_db(b"inodes"), env.open_db(b"meta")
    with env.begin(write=True) as txn:
        # mode, uid, gid, atime, mtime, ctime, parent, name, entry_id, is_dir, version, xattrs
        root = [0o40755, 0, 0, 0, 0, 0, 0, b"", 0, True, 0, {}]
        old_dir = [0o40755, 0, 0, 1, 2, 3, ROOT_INO, b"old", 1, True, 0, {}]
        for ino, saved in ((ROOT_INO, root), (5, old_dir)):
            txn.put(ino.to_bytes(8, "big"), msgspec.msgpack.encode(saved), db=inodes)
        txn.put(b"meta", msgspec.msgpack.encode({"layout": 1, "next_ino": 6, "next_entry_id": 2,
                                                 "next_version": 1, "nodes": []}), db=meta)
    env.close()
    state = MasterState(tmp_path)
    restarted = MetadataService(ManualClock(), LruPolicy(), MasterSettings(cluster=True))
    state.load(restarted)
    attr = restarted.handle(m.Lookup(ROOT_INO, b"old"), 0).attr
    assert (attr.ino, attr.mode, attr.ctime_ns, attr.nlink) == (5, 0o40755, 3, 2)
    assert restarted.handle(m.GetAttr(ROOT_INO), 0).nlink == 3
    state.close()


def test_a_large_directory_is_watched_page_by_page(cluster: Cluster) -> None:
    a, _ = cluster.join("a")
    b, _ = cluster.join("b")
    directory = cluster.master.handle(m.MkDir(ROOT_INO, b"keys", 0o755, 0, 0), a)
    for i in range(10_000):
        cluster.master.handle(m.Create(directory.ino, b"k%05d" % i, 0o644, 0, 0, a, True), a)
    names, start_id, pages = [], 0, 0
    while True:
        page = cluster.master.handle(m.WatchNames(directory.ino, 1_000_000, start_id), b)
        assert page.complete
        names += page.names
        pages += 1
        if not page.next_id:
            break
        start_id = page.next_id
    assert pages == 3 and sorted(names) == [b"k%05d" % i for i in range(10_000)]
    cluster.master.handle(m.Create(directory.ino, b"new", 0o644, 0, 0, a, True), a)
    assert cluster.master.take_notifications(b) == [(directory.ino, b"new", True, None)]  # being written
    assert cluster.master.take_notifications(a) == []  # a does not watch it
    assert not cluster.master.handle(m.WatchNames(directory.ino, 5_000), a).complete  # over its limit


def test_a_seal_retried_after_a_re_registration_is_accepted(cluster: Cluster) -> None:
    a, _ = cluster.join("a")
    opened = cluster.master.handle(m.Create(ROOT_INO, b"w.bin", 0o644, 0, 0, a, True), a)
    # The node sealed it while the master was away: its registration says so first...
    cluster.join("a", [m.Held(opened.version, 5, True, False, mtime_ns=42, checksums=[3])])
    # ...then the seal it had in flight arrives: the same seal is no error, a different one is.
    attr = cluster.master.handle(m.Seal(opened.version, 5, 42, [3]), a)
    assert attr.sealed and attr.size == 5
    with pytest.raises(MetadataError):
        cluster.master.handle(m.Seal(opened.version, 6, 42, [4]), a)


def test_an_operator_removes_a_node_that_will_not_come_back(cluster: Cluster) -> None:
    a, _ = cluster.join("a")
    b, _ = cluster.join("b")
    on_ssd = cluster.store(a, b"k.bin")
    cluster.master.handle(m.Offloaded([on_ssd.version]), a)
    fails(lambda: cluster.master.handle(m.RemoveNode("a"), 0), errno.EBUSY)  # still up
    cluster.silence(3.0, b)
    removed = cluster.master.handle(m.RemoveNode("a"), 0)
    assert removed.entries == [(ROOT_INO, b"k.bin", on_ssd.ino)] and removed.freed_bytes == 100
    assert cluster.beat(b).forget == [(ROOT_INO, b"k.bin", on_ssd.ino)]
    assert cluster.master.handle(m.ReadDir(ROOT_INO, 0, 10), b).entries == []
    assert cluster.master.objects.versions == {}
    assert [n.name for n in cluster.master.handle(m.ClusterStatus(), 0).nodes] == ["b"]
    fails(lambda: cluster.master.handle(m.RemoveNode("a"), 0), errno.ENOENT)
    again, dropped = cluster.join("a", [m.Held(on_ssd.version, 100, True, True)])  # it came back after all
    assert again != a and dropped == [on_ssd.version]  # a new node; its old file was given up


def test_a_watched_directory_carries_the_entries_nodes_may_answer_lookups_with(cluster: Cluster) -> None:
    a, _ = cluster.join("a")
    b, _ = cluster.join("b")
    directory = cluster.master.handle(m.MkDir(ROOT_INO, b"keys", 0o755, 0, 0), a)
    stored = cluster.store(a, b"k.bin", parent=directory.ino)
    cluster.master.handle(m.MkDir(directory.ino, b"sub", 0o755, 0, 0), a)
    page = cluster.master.handle(m.WatchNames(directory.ino, 1000), b)
    entries = dict(zip(page.names, page.entries))
    assert entries[b"sub"] is None  # directories: ask the master
    entry = entries[b"k.bin"]
    assert (entry.attr.ino, entry.attr.version, entry.attr.size) == (stored.ino, stored.version, 100)
    assert (entry.node, entry.address, entry.checksums) == (a, "a:1", [11])  # as Lookup answers b
    assert entry == cluster.master.handle(m.Lookup(directory.ino, b"k.bin"), b)
    # A new version: b asks the master while it is written, and gets the sealed one pushed.
    opened = cluster.master.handle(m.OpenWrite(stored.ino, a, truncate=True), a)
    assert cluster.master.take_notifications(b) == [(directory.ino, b"k.bin", True, None)]
    cluster.master.handle(m.Seal(opened.version, 7, cluster.clock.wall_ns(), [12]), a)
    [(_, name, present, pushed)] = cluster.master.take_notifications(b)
    assert (name, present, pushed.attr.version, pushed.attr.size, pushed.checksums) == (
        b"k.bin", True, opened.version, 7, [12])
    cluster.master.handle(m.SetAttr(stored.ino, 0o600, None, None, None, None), b)
    assert cluster.master.take_notifications(b)[0][3].attr.mode & 0o777 == 0o600
    cluster.master.handle(m.Release(opened.version, True), a)
    cluster.master.handle(m.Offloaded([opened.version]), a)  # on a's SSD: hidden while a is down
    # The node that stores it dies: its file is hidden, and the copy must ask the master.
    assert cluster.silence(3, b) == [a]
    assert cluster.master.take_notifications(b) == [(directory.ino, b"k.bin", True, None)]
    assert cluster.master.handle(m.Lookup(directory.ino, b"k.bin"), b).attr is None


def test_pages_and_pushes_of_large_entries_fit_a_frame(cluster: Cluster) -> None:
    from kvfs.wire.protocol import MAX_HEADER
    from kvfs.net.rpc import push_batches
    import msgspec

    a, _ = cluster.join("a")
    b, _ = cluster.join("b")
    directory = cluster.master.handle(m.MkDir(ROOT_INO, b"big", 0o755, 0, 0), a)
    cluster.master.handle(m.WatchNames(directory.ino, 100_000), b)
    for i in range(3000):  # 2 GiB files in 4 MiB chunks: 512 checksums each
        opened = cluster.master.handle(m.Create(directory.ino, b"%064x" % i, 0o644, 0, 0, a, True), a)
        cluster.master.handle(m.Seal(opened.version, 2 << 30, 1, list(range(1 << 40, (1 << 40) + 512))), a)
    changes = cluster.master.take_notifications(b)
    batches = push_batches(changes)
    assert sum(map(len, batches)) == len(changes) and len(batches) > 1
    assert max(len(msgspec.msgpack.encode(m.NameChanges(batch))) for batch in batches) < MAX_HEADER
    names, start_id = [], 0
    while True:
        page = cluster.master.handle(m.WatchNames(directory.ino, 100_000, start_id), b)
        assert len(msgspec.msgpack.encode(page)) < MAX_HEADER
        names += page.names
        if not page.next_id:
            break
        start_id = page.next_id
    assert sorted(names) == [b"%064x" % i for i in range(3000)]
