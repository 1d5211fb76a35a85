"""What one request or one slice of the master's work touches, counted, never timed.

The master answers every node from one loop: a request that walks every file (or every
file of a node) stops all the others meanwhile. Here the pure service's inodes and
versions are counted as they are read, so that the tests state the bounds as work: a
registration's request touches about what the node reported, `kvfs status` no version
and no inode, `kvfs du` the top-level directories only. The running totals those
answers read are checked against a full recount after random work (a differential check).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any

from kvfs.clock import ManualClock
from kvfs.cluster.backlog import STEP_ITEMS
from kvfs.cluster.master import ORPHAN_WALK_MAX, RECLAIM_WALK_MAX, MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.objects import COMPACT_STEP
from kvfs.cluster.persist import MasterState
from kvfs.cluster.totals import count_nodes
from kvfs.cluster.usage import walk_tops
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m
from kvfs.wire.protocol import FrameKind, encode_frame


class Counted(MutableMapping):
    """A mapping that counts the items read through it (lookups, tests, iteration)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.touched = 0

    def __getitem__(self, key: Any) -> Any:
        self.touched += 1
        return self.inner[key]

    def get(self, key: Any, default: Any = None) -> Any:
        self.touched += 1
        return self.inner.get(key, default)

    def __contains__(self, key: object) -> bool:
        self.touched += 1
        return key in self.inner

    def __setitem__(self, key: Any, value: Any) -> None:
        self.inner[key] = value

    def __delitem__(self, key: Any) -> None:
        del self.inner[key]

    def __iter__(self) -> Iterator[Any]:
        for key in self.inner:
            self.touched += 1
            yield key

    def values(self) -> Any:
        return [self[key] for key in list(self.inner)]

    def scan(self, start: int, end: int, slots: int) -> Any:
        found, after = self.inner.scan(start, end, slots)
        self.touched += len(found)
        return found, after

    def items(self) -> Any:
        return [(key, self[key]) for key in list(self.inner)]

    def __len__(self) -> int:
        return len(self.inner)


def counted(service: MetadataService) -> tuple[Counted, Counted]:
    """Counts reads of the service's versions and inodes from now on."""
    versions = Counted(service.objects.versions)
    inodes = Counted(service.ns.inodes)
    service.objects.versions = versions  # type: ignore[assignment]
    service.ns.inodes = inodes  # type: ignore[assignment]
    return versions, inodes


SLICE = 8 * STEP_ITEMS  # items one slice of removal may touch: each file's inode and version a few times


def cluster(**settings: float) -> MetadataService:
    return MetadataService(ManualClock(), LruPolicy(), MasterSettings(cluster=True, **settings))


def join(service: MetadataService, name: str, held: list[m.Held] = ()) -> int:  # type: ignore[assignment]
    node = service.handle(m.Register(name, f"{name}:1"), 0).node
    for start in range(0, len(held), 2000):
        service.handle(m.Report(held[start:start + 2000]), node)
    service.handle(m.FinishRegistration(), node)
    return node


def store(service: MetadataService, parent: int, name: bytes, node: int, size: int = 4096) -> int:
    opened = service.handle(m.Create(parent, name, 0o644, 0, 0, node, True), node)
    service.handle(m.Seal(opened.version, size, service.clock.wall_ns(), [1], release=True), node)
    service.handle(m.Forget([opened.attr.ino]), node)
    return opened.version


def held(service: MetadataService, version_id: int) -> m.Held:
    version = service.objects.versions[version_id]
    return m.Held(version.version, version.size, version.sealed, version.on_disk, 0, version.checksums)


def test_a_registration_touches_what_the_node_reported_not_what_it_stored() -> None:
    service = cluster()
    a, b = join(service, "a"), join(service, "b")
    directory = service.handle(m.MkDir(ROOT_INO, b"model", 0o755, 0, 0), a).ino
    files = 48 * STEP_ITEMS
    versions_a = [store(service, directory, b"a%06d" % i, a) for i in range(files)]
    store(service, directory, b"theirs", b)
    kept = versions_a[::400]  # a restarts with a few files left (the rest was only in its DRAM)

    service.handle(m.Register("a", "a:1"), 0)
    versions, inodes = counted(service)
    service.handle(m.Report([held(service, v) for v in kept]), a)
    assert versions.touched <= 2 * len(kept)
    versions.touched = inodes.touched = 0
    service.handle(m.FinishRegistration(), a)
    # The count check (the reported ones), then the first slice of the removal: never all of a's files.
    assert versions.touched <= len(kept) + SLICE < files // 4
    assert inodes.touched <= SLICE

    # The files a lacks are hidden at once; those it reported, and those it writes now, are not.
    assert service.handle(m.Lookup(directory, b"a%06d" % (files - 1)), b).attr is None
    assert service.handle(m.Lookup(directory, b"a%06d" % 400), b).attr is not None
    store(service, directory, b"new", a)
    assert service.handle(m.Lookup(directory, b"new"), b).attr is not None
    touched: list[int] = []
    while True:
        versions.touched = inodes.touched = 0
        left = service.pending_work(0.0)  # one step per call
        assert inodes.touched <= SLICE
        touched.append(versions.touched)
        if not left:
            break
    assert len(touched) <= files // STEP_ITEMS + 2
    # Each slice touches its own files, and a few ids of the node's id array per file forgotten
    # (its compaction, once forgotten ids outnumber live ones, goes with the forgets: never
    # the whole array in one slice).
    assert max(touched) <= SLICE + COMPACT_STEP * STEP_ITEMS
    listed = service.handle(m.ReadDir(directory, 0, 10_000), b).entries
    assert sorted(entry.name for entry in listed) == sorted(
        [b"a%06d" % i for i in range(0, files, 400)] + [b"theirs", b"new"])
    assert service.registry.nodes[a].kept is None  # reconciled: nothing of a's is hidden any more


def test_forgetting_a_dead_node_touches_a_slice_per_pass_even_with_half_its_ids_forgotten() -> None:
    service = cluster(forget_dead_after_s=60.0)
    a, b = join(service, "a"), join(service, "b")
    directory = service.handle(m.MkDir(ROOT_INO, b"model", 0o755, 0, 0), a).ino
    files = 48 * STEP_ITEMS
    stored = [store(service, directory, b"a%06d" % i, a) for i in range(files)]
    join(service, "a", [held(service, v) for v in stored[::2]])  # restarted with half of them
    service.backlog.drain()
    versions, inodes = counted(service)
    bound = SLICE + COMPACT_STEP * STEP_ITEMS  # a slice's files, and the compaction's share per forget
    passes = []
    for _ in range(400):  # a falls silent for good; b heartbeats; the expiry passes every 0.25 s
        service.clock.advance(0.25)
        service.handle(m.Heartbeat(0, 0), b)
        versions.touched = inodes.touched = 0
        service.expire_nodes()
        passes.append(versions.touched)
        assert inodes.touched <= SLICE
        if "a" not in service.registry.by_name:
            break
    assert "a" not in service.registry.by_name
    # The pass that forgot a: one slice of its files, not its id array (half of which was
    # forgotten ids, compacted once they outnumber the live ones).
    assert max(passes) <= bound
    slices = 0
    while True:
        versions.touched = inodes.touched = 0
        left = service.pending_work(0.0)
        assert versions.touched <= bound and inodes.touched <= SLICE
        slices += 1
        if not left:
            break
    assert slices <= files // STEP_ITEMS + 2
    assert service.ns.files == 0 and a not in service.objects.by_node


def test_a_reclaim_walks_the_nodes_files_on_its_tier_not_the_others() -> None:
    service = cluster(publish_grace_s=0.0)
    a, b = join(service, "a"), join(service, "b")
    directory = service.handle(m.MkDir(ROOT_INO, b"model", 0o755, 0, 0), a).ino
    files = 8 * STEP_ITEMS
    on_a = [store(service, directory, b"a%06d" % i, a) for i in range(files)]
    service.handle(m.Offloaded(on_a[:-20]), a)  # a's copies went to SSD, but for its 20 newest
    [store(service, directory, b"b%02d" % i, b) for i in range(20)]  # b's: the newest files of all
    versions, inodes = counted(service)

    # b's DRAM: the policy's order of b's files only, not past a's (older, all before them).
    removed = service.handle(m.Reclaim(b, 3 * 4096, "dram"), b)
    assert [name for _, name, _ in removed.entries] == [b"b00", b"b01", b"b02"]
    assert inodes.touched <= 3 * 16 and versions.touched <= 3 * 16
    # a's DRAM: its 20 DRAM-only files, oldest first, not past the thousands on its SSD.
    inodes.touched = versions.touched = 0
    removed = service.handle(m.Reclaim(a, 2 * 4096, "dram"), a)
    assert [name for _, name, _ in removed.entries] == [b"a%06d" % i for i in (files - 20, files - 19)]
    assert inodes.touched <= 2 * 16 and versions.touched <= 2 * 16
    # a's SSD: its oldest file on SSD, and a's copies that move to SSD now follow.
    service.handle(m.Offloaded(on_a[-18:]), a)
    inodes.touched = versions.touched = 0
    removed = service.handle(m.Reclaim(a, 4096, "disk"), a)
    assert [name for _, name, _ in removed.entries] == [b"a%06d" % 0]
    assert inodes.touched <= 16 and versions.touched <= 16
    assert service.handle(m.Reclaim(a, 4096, "dram"), a).entries == []  # none left only in DRAM


def test_a_reclaim_among_open_files_looks_at_a_bounded_number() -> None:
    service = cluster(publish_grace_s=0.0)
    a = join(service, "a")
    files = RECLAIM_WALK_MAX + 2 * STEP_ITEMS
    stored = [store(service, ROOT_INO, b"k%06d" % i, a) for i in range(files)]
    for version in stored:  # every file being read; the last one read is closed again
        service.handle(m.OpenRead(service.objects.versions[version].ino), a)
    service.handle(m.Release(stored[-1], False), a)
    versions, inodes = counted(service)
    assert service.handle(m.Reclaim(a, 4096, "dram"), a).entries == []  # (it asks again as files close)
    assert inodes.touched <= RECLAIM_WALK_MAX + 16 and versions.touched <= RECLAIM_WALK_MAX + 16


def test_collecting_orphans_looks_at_a_bounded_share_of_the_temp_files_each_time() -> None:
    service = cluster(temp_grace_s=60.0)
    a = join(service, "a")
    files = 5 * ORPHAN_WALK_MAX
    for i in range(files):  # a writer that never renames: temp files pile up, a few of them orphans
        opened = service.handle(m.Create(ROOT_INO, b"k%05d.tmp" % i, 0o644, 0, 0, a, True), a)
        if i % 50 == 0:
            service.handle(m.Seal(opened.version, 4096, service.clock.wall_ns(), [1], release=True), a)
    versions, inodes = counted(service)
    assert service.handle(m.CollectOrphans(), a).entries == []  # none past the grace yet
    assert inodes.touched <= ORPHAN_WALK_MAX and versions.touched <= ORPHAN_WALK_MAX
    service.clock.advance(61)
    collected: list[bytes] = []
    for _ in range(files // ORPHAN_WALK_MAX):  # each call goes on where the last one stopped
        inodes.touched = versions.touched = 0
        collected += [name for _, name, _ in service.handle(m.CollectOrphans(), a).entries]
        assert inodes.touched <= 3 * ORPHAN_WALK_MAX and versions.touched <= 3 * ORPHAN_WALK_MAX
    assert sorted(collected) == [b"k%05d.tmp" % i for i in range(0, files, 50)]
    assert service.handle(m.CollectOrphans(), a).entries == []


def test_removing_a_node_answers_with_its_count_and_its_files_go_in_slices() -> None:
    service = cluster()
    a, b = join(service, "a"), join(service, "b")
    directory = service.handle(m.MkDir(ROOT_INO, b"model", 0o755, 0, 0), a).ino
    files = 16 * STEP_ITEMS
    for i in range(files):
        store(service, directory, b"a%06d" % i, a, size=100)
    kept = store(service, directory, b"theirs", b)
    for _ in range(40):  # a falls silent; b heartbeats; the expiry passes every 0.25 s
        service.clock.advance(0.25)
        service.handle(m.Heartbeat(0, 0), b)
        service.expire_nodes()
        if not service.registry.nodes[a].live:
            break
    assert not service.registry.nodes[a].live
    service.backlog.drain()  # (its files hidden from b's copies)
    versions, inodes = counted(service)
    removed = service.handle(m.RemoveNode("a"), 0)
    assert versions.touched <= SLICE + COMPACT_STEP * STEP_ITEMS and inodes.touched <= SLICE
    assert removed.files == files and removed.freed_bytes == 100 * files
    assert len(removed.entries) == STEP_ITEMS  # (the first slice's; the rest follow)
    assert "a" not in service.registry.by_name
    while True:
        versions.touched = inodes.touched = 0
        left = service.pending_work(0.0)
        assert versions.touched <= SLICE + COMPACT_STEP * STEP_ITEMS and inodes.touched <= SLICE
        if not left:
            break
    assert [entry.name for entry in service.handle(m.ReadDir(directory, 0, 100), b).entries] == [b"theirs"]
    assert list(service.objects.versions) == [kept] and a not in service.objects.by_node
    forgotten: list[bytes] = []
    while True:  # b's kernel forgets every name of a's, over heartbeats
        beat = service.handle(m.Heartbeat(0, 0), b)
        if not beat.forget:
            break
        forgotten += [name for _, name, _ in beat.forget]
    assert sorted(forgotten) == [b"a%06d" % i for i in range(files)]


def test_a_registration_again_midway_stops_the_previous_removal() -> None:
    service = cluster()
    a, b = join(service, "a"), join(service, "b")
    stored = [store(service, ROOT_INO, b"f%05d" % i, a) for i in range(4 * STEP_ITEMS)]
    join(service, "a", [held(service, v) for v in stored[:10]])  # a forgot most of its files...
    assert len(service.backlog) == 1
    last = stored[-1]  # (not reached by the first slice)
    # ...and restarts again before the removal is through, this time reporting the last one too.
    join(service, "a", [held(service, v) for v in stored[:10] + [last]])
    service.backlog.drain()
    assert sorted(service.objects.versions) == sorted(stored[:10] + [last])
    assert service.handle(m.Lookup(ROOT_INO, b"f%05d" % (len(stored) - 1)), b).attr is not None


def test_status_and_usage_read_running_totals_not_the_files() -> None:
    service = cluster()
    a, b = join(service, "a"), join(service, "b")
    tops = [service.handle(m.MkDir(ROOT_INO, b"m%d" % t, 0o755, 0, 0), a).ino for t in range(3)]
    deep = service.handle(m.MkDir(tops[2], b"layer", 0o755, 0, 0), a).ino
    for i in range(3000):
        parent = (tops[0], tops[1], deep, ROOT_INO)[i % 4]
        store(service, parent, b"k%05d" % i, (a, b)[i % 2], size=100 + i)
    versions, inodes = counted(service)
    status = service.handle(m.ClusterStatus(), 0)
    assert versions.touched == 0 and inodes.touched == 0
    assert sum(node.files for node in status.nodes) == 3000
    assert sum(node.bytes for node in status.nodes) == sum(100 + i for i in range(3000))
    usage = service.handle(m.DirUsage(files=True), 0)
    assert versions.touched == 0 and inodes.touched <= len(tops) + 1
    assert {row.name: row.files for row in usage.dirs} == {"m0": 750, "m1": 750, "m2": 750, "/": 750}


def rows(service: MetadataService) -> dict[str, tuple[int, ...]]:
    return {row.name: (row.files, row.bytes, row.hits, row.ssd_bytes, row.dram_only_bytes)
            for row in service.handle(m.DirUsage(files=True), 0).dirs if row.files}


def recounted(service: MetadataService) -> dict[str, tuple[int, ...]]:
    return {top: tuple(held) for top, held in walk_tops(service.ns, service.objects).items()}


def nodes(service: MetadataService) -> dict[int, tuple[int, ...]]:
    return {n.node: (n.files, n.dram_only_files, n.ssd_files, n.bytes)
            for n in service.handle(m.ClusterStatus(), 0).nodes if n.files}


class Workload:
    """Random requests of every kind that changes what the totals count."""

    def __init__(self, service: MetadataService, rng: random.Random) -> None:
        self.service, self.rng = service, rng
        self.nodes = [join(service, name) for name in ("a", "b", "c")]
        self.dirs = [ROOT_INO]

    def call(self, request: m.Request, node: int) -> Any:
        try:
            return self.service.handle(request, node)
        except Exception as error:  # refusals (ENOENT, EEXIST, ENOTEMPTY...) are part of the mix
            assert getattr(error, "errno", None), error
            return None

    def live(self) -> list[int]:
        return [n for n in self.nodes if self.service.registry.is_live(n)]

    def pick_file(self) -> tuple[int, bytes, int] | None:
        for _ in range(10):
            parent = self.rng.choice(self.dirs)
            inode = self.service.ns.inodes.get(parent)
            if inode is None or not inode.linked or not inode.children:
                continue
            name = self.rng.choice(list(inode.children))
            child = self.service.ns.inodes[inode.children.get(name)]
            if child.is_file:
                return parent, name, child.ino
        return None

    def step(self) -> None:
        rng, service = self.rng, self.service
        live = self.live()
        if not live:
            self.reregister(rng.choice(self.nodes))
            return
        node = rng.choice(live)
        action = rng.random()
        if action < 0.3:
            parent = rng.choice(self.dirs)
            opened = self.call(m.Create(parent, b"f%d" % rng.randrange(200), 0o644, 0, 0, node, False), node)
            if opened is not None and rng.random() < 0.85:
                self.call(m.Seal(opened.version, rng.randrange(1, 5000), service.clock.wall_ns(), [1],
                                 release=True), node)
        elif action < 0.38:
            parent = rng.choice(self.dirs)
            made = self.call(m.MkDir(parent, b"d%d" % rng.randrange(20), 0o755, 0, 0), node)
            if made is not None:
                self.dirs.append(made.ino)
        elif action < 0.48:
            picked = self.pick_file()
            if picked is not None:
                self.call(m.Unlink(picked[0], picked[1]), node)
        elif action < 0.6:  # a file, or a directory with everything below it, moves anywhere
            source = rng.choice(self.dirs)
            inode = service.ns.inodes.get(source)
            if inode is not None and inode.children:
                name = rng.choice(list(inode.children))
                self.call(m.Rename(source, name, rng.choice(self.dirs), b"r%d" % rng.randrange(50)), node)
        elif action < 0.66:
            parent = rng.choice(self.dirs)
            inode = service.ns.inodes.get(parent)
            if inode is not None and inode.linked and parent != ROOT_INO:
                self.call(m.RmDir(inode.parent, inode.name), node)
        elif action < 0.76:
            picked = self.pick_file()
            if picked is not None:
                opened = self.call(m.OpenRead(picked[2]), node)
                if opened is not None:
                    self.call(m.Release(opened.version, False), node)
        elif action < 0.84:  # rewritten in place (a new version, copying the old bytes)
            picked = self.pick_file()
            if picked is not None:
                opened = self.call(m.OpenWrite(picked[2], node, rng.random() < 0.5), node)
                if opened is not None:
                    self.call(m.Seal(opened.version, rng.randrange(1, 5000), service.clock.wall_ns(), [2],
                                     release=True), node)
        elif action < 0.92:
            mine = [v.version for v in service.objects.of_node(node)]
            if mine:
                self.call(m.Offloaded(rng.sample(mine, min(3, len(mine)))), node)
        elif action < 0.97:
            self.reregister(node)
        else:
            self.call(m.Lost(rng.choice(list(service.objects.versions) or [1])), node)
        if rng.random() < 0.3:
            service.pending_work(0.0)

    def reregister(self, node: int) -> None:
        """The node restarts holding a random part of what it had (sealed on its SSD or not)."""
        service, rng = self.service, self.rng
        name = service.registry.nodes[node].name
        theirs = service.objects.of_node(node)
        report = [m.Held(v.version, v.size or 1, True, v.on_disk or rng.random() < 0.3, 0, v.checksums)
                  for v in theirs if rng.random() < 0.7]
        join(service, name, report)


def test_running_totals_match_a_full_recount_after_random_work(tmp_path: Path) -> None:
    for seed in range(6):
        service = cluster()
        workload = Workload(service, random.Random(seed))
        for i in range(1500):
            workload.step()
            if i % 100 == 0:
                assert rows(service) == recounted(service), (seed, i)
                assert nodes(service) == {node: tuple(counts) for node, counts in count_nodes(service.objects).items()
                                          if counts[0]}, (seed, i)
        service.backlog.drain()
        assert rows(service) == recounted(service), seed
        assert nodes(service) == {node: tuple(c) for node, c in count_nodes(service.objects).items() if c[0]}
        # A restart: the totals are counted once from the saved state, and match too.
        state = MasterState(tmp_path / f"state-{seed}")
        state.save(service)
        state.close()
        restarted = cluster()
        state = MasterState(tmp_path / f"state-{seed}")
        state.load(restarted)
        state.close()
        assert rows(restarted) == recounted(restarted), seed
        unread = {top: counts[:2] + counts[3:] for top, counts in recounted(service).items()}
        assert {top: counts[:2] + counts[3:] for top, counts in rows(restarted).items()} == unread  # (hits: not saved)
        assert nodes(restarted) == nodes(service), seed


def test_a_mass_removal_reaches_the_other_nodes_over_heartbeats_that_each_fit_a_frame() -> None:
    service = cluster()
    a, b = join(service, "a"), join(service, "b")
    count = 6000
    names = [b"%05d-" % i + b"x" * 240 for i in range(count)]  # long names: 1.5 MB of them in all
    stored = [store(service, ROOT_INO, name, a) for name in names]
    join(service, "a", [held(service, stored[0])])  # a restarts with one file left
    service.backlog.drain()
    forgotten: list[bytes] = []
    beats = 0
    while True:
        beat = service.handle(m.Heartbeat(0, 0), b)
        encode_frame(FrameKind.RESPONSE, 1, beat)  # (raises ProtocolError past the header's limit)
        if not beat.forget:
            break
        forgotten += [name for _, name, _ in beat.forget]
        beats += 1
    assert forgotten == names[1:] and beats >= 2


def test_the_heap_is_frozen_every_freeze_every_numbers_even_at_a_steady_count_of_files() -> None:
    """The daemon's expiry pass freezes the heap (so that the cyclic collector's full passes
    walk only what was made since) once FREEZE_EVERY inode and version numbers were handed
    out: files written and evicted at a steady count freeze it as often as growth does. The
    young generations are collected first: a cycle that died in flight is freed, not frozen."""
    import gc
    import weakref

    from kvfs.daemons.heap import FREEZE_EVERY, freeze_due, keep_heap_out_of_full_collections

    assert freeze_due(0, -1, False) and not freeze_due(FREEZE_EVERY - 1, 0, False)
    assert freeze_due(FREEZE_EVERY, 0, False) and freeze_due(1, 0, True)  # (a slow full pass since)

    class Cycle:
        pass

    service = cluster()
    node = join(service, "a")
    directory = service.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), node).ino
    try:
        dead = Cycle()
        dead.itself = dead  # type: ignore[attr-defined]
        died = weakref.ref(dead)
        del dead
        frozen_at = keep_heap_out_of_full_collections(service, -1)
        assert died() is None
        made = lambda: service.ns.next_ino + service.objects.next_version  # noqa: E731
        assert frozen_at == made()
        freezes = 0
        for _ in range(FREEZE_EVERY):  # (a file takes an inode number and a version number)
            version = store(service, directory, b"f", node)
            service.handle(m.Unlink(directory, b"f"), node)
            assert version not in service.objects.versions and service.ns.files == 0  # (a steady count: none)
            before = frozen_at
            frozen_at = keep_heap_out_of_full_collections(service, frozen_at)
            freezes += frozen_at != before
            assert made() - frozen_at < FREEZE_EVERY  # frozen by then (or earlier: a slow full pass)
        assert freezes >= 2
    finally:
        gc.unfreeze()
