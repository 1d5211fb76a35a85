"""Liveness judged by a master that may itself stall, with a manual clock: a gap in the
master's own expiry passes convicts nobody, a node that is really silent still dies, and
a node declared dead keeps, when it registers again, every file nobody superseded."""

from __future__ import annotations

from kvfs.clock import ManualClock
from kvfs.cluster.master import MasterSettings, MetadataService, stall_gap
from kvfs.policy import LruPolicy
from kvfs.cluster.namespace import ROOT_INO
from kvfs.wire import messages as m

from tests.test_master_cluster import Cluster


def passes(cluster: Cluster, seconds: float, *beating: int) -> list[int]:
    """The master runs for `seconds`; only `beating` nodes heartbeat meanwhile."""
    return cluster.silence(seconds, *beating)


def stall(cluster: Cluster, seconds: float) -> list[int]:
    """The master stops (SIGSTOP, a slow save): no pass, no request, for `seconds`; then one pass."""
    cluster.clock.advance(seconds)
    return cluster.master.expire_nodes()


def test_a_stall_of_the_master_convicts_no_node() -> None:
    cluster = Cluster(ManualClock())
    a, _ = cluster.join("a")
    b, _ = cluster.join("b")
    files = {name: cluster.store(a if i % 2 else b, name) for i, name in enumerate([b"k0", b"k1", b"k2", b"k3"])}
    assert passes(cluster, 1.0, a, b) == []
    assert stall(cluster, 5.0) == []  # the first pass after the stall: a fresh grace for all
    assert cluster.master.liveness.stalls == 1 and cluster.master.liveness.last_stall_s == 5.0
    # The heartbeats queued in the sockets during the stall are read now.
    cluster.beat(a)
    cluster.beat(b)
    assert passes(cluster, 5.0, a, b) == []
    for name, attr in files.items():
        assert cluster.lookup(a, name).version == attr.version
        assert cluster.master.handle(m.OpenRead(attr.ino), b).version == attr.version


def test_a_silent_node_still_dies_after_the_grace_that_follows_a_stall() -> None:
    cluster = Cluster(ManualClock())
    a, _ = cluster.join("a")
    b, _ = cluster.join("b")
    assert passes(cluster, 1.0, a, b) == []
    assert stall(cluster, 4.0) == []
    # a never speaks again: it dies 2.5 s (dead_after_s) after the master resumed, not before.
    assert passes(cluster, 2.5, b) == []
    assert passes(cluster, 0.5, b) == [a]
    assert [n.live for n in cluster.master.handle(m.ClusterStatus(), 0).nodes] == [False, True]


def test_passes_at_their_interval_are_no_stall() -> None:
    cluster = Cluster(ManualClock())
    a, _ = cluster.join("a")
    assert passes(cluster, 3.0) == [a]  # silent from the start: dead within 2.75 s
    assert cluster.master.liveness.stalls == 0


def test_a_node_declared_dead_keeps_on_return_what_nobody_superseded() -> None:
    cluster = Cluster(ManualClock())
    a, _ = cluster.join("a")
    b, _ = cluster.join("b")
    kept = cluster.store(a, b"kept.bin")  # only in a's DRAM
    taken = cluster.store(a, b"taken.bin")
    writing = cluster.master.handle(m.Create(ROOT_INO, b"w.tmp", 0o644, 0, 0, a, True), a)
    assert passes(cluster, 3.0, b) == [a]  # a partition, say: a lives on, holding its files
    assert cluster.lookup(b, b"kept.bin") is None  # hidden meanwhile
    newer = cluster.store(b, b"taken.bin", size=200)  # the name is taken by a newer file
    _, dropped = cluster.join("a", [m.Held(kept.version, 100, True, False),
                                    m.Held(taken.version, 100, True, False),
                                    m.Held(writing.version, 5, True, False, mtime_ns=42, checksums=[3])])
    assert dropped == [taken.version]
    assert cluster.lookup(b, b"kept.bin").version == kept.version
    assert cluster.master.handle(m.OpenRead(kept.ino), b).node == a
    assert cluster.lookup(b, b"taken.bin").version == newer.version
    sealed = cluster.lookup(b, b"w.tmp")  # sealed on a while it was declared dead
    assert sealed.version == writing.version and sealed.sealed and sealed.size == 5


def test_the_stall_gap_stays_between_the_pass_interval_and_the_deadline() -> None:
    assert stall_gap(MasterSettings()) == 1.0
    assert stall_gap(MasterSettings(dead_after_s=1.8)) == 0.9  # a stall just under it leaves half the deadline
    assert stall_gap(MasterSettings(dead_after_s=0.4)) == 0.75  # never under three passes: late ones are no stall


def test_a_node_dead_for_longer_than_the_limit_is_forgotten_with_its_files() -> None:
    """Dead names are garbage-collected: a node dead past forget_dead_after_s is removed as
    by `kvfs remove-node` (its hidden files leave the namespace, its name is free); one that
    comes back in time keeps everything."""
    cluster = Cluster(ManualClock())
    cluster.master.members.forget_dead_after_s = 100.0
    a, _ = cluster.join("a")
    b, _ = cluster.join("b")
    gone = cluster.store(a, b"a.bin")
    kept = cluster.store(b, b"b.bin")
    assert passes(cluster, 5.0, b) == [a]  # a stops: declared dead, its file hidden
    assert passes(cluster, 90.0, b) == []
    assert "a" in cluster.master.registry.by_name  # dead 95 s: still known, may come back
    passes(cluster, 10.0, b)
    assert "a" not in cluster.master.registry.by_name and cluster.master.members.forgotten == 1
    assert all(version.node != a for version in cluster.master.objects.versions.values())
    assert cluster.lookup(b, b"b.bin").version == kept.version
    assert cluster.lookup(b, b"a.bin") is None and gone.ino not in cluster.master.ns.inodes
    cluster.join("a")  # the name is free: a machine may join under it again, with nothing of the old one's
    assert cluster.lookup(b, b"a.bin") is None


def test_a_restarted_master_counts_a_dead_nodes_time_from_its_own_start(tmp_path) -> None:
    """After a restart every known node is heard from at the load: a monotonic clock that
    started long ago (a machine up for weeks) forgets nobody at once."""
    clock = ManualClock()
    clock.advance(30 * 86400.0)  # the machine has been up for 30 days
    service = MetadataService(clock, LruPolicy(), MasterSettings(cluster=True))
    service.load([], [], 2, 1, 1, [(1, "a", "10.0.0.1:7401")])
    service.expire_nodes()
    assert "a" in service.registry.by_name
    clock.advance(7 * 86400.0 + 1)
    service.expire_nodes()
    assert "a" not in service.registry.by_name
