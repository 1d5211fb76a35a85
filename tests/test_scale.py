"""The master's metadata at scale, in the pure service: work counted, never timed.

A listing page walks O(page) index slots wherever it starts; a node's death, its
registration and the forgetting of a long-dead node touch that node's files only
(and the kernel references a dead node held are found by a walk of the inode table),
in slices the daemon runs between requests; what the master keeps per file is
bounded (tracemalloc, deterministic for a given Python).
"""

from __future__ import annotations

import gc
import hashlib
import tracemalloc
from pathlib import Path

import pytest

from kvfs.clock import ManualClock
from kvfs.cluster.backlog import STEP_ITEMS
from kvfs.cluster.entries import COMPACT_MIN, Entries
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO, Directory, Inode, make_inode
from kvfs.cluster.objects import FileVersion
from kvfs.cluster.persist import MasterState
from kvfs.cluster.table import PAGE_SLOTS, NumberTable
from kvfs.policy import EvictionPolicy, LruPolicy, ReusePolicy, make_policy
from kvfs.wire import messages as m


def cluster(policy: EvictionPolicy | None = None, **settings: float) -> tuple[MetadataService, int, int]:
    service = MetadataService(ManualClock(), LruPolicy() if policy is None else policy, MasterSettings(cluster=True, **settings))
    nodes = []
    for name in ("a", "b"):
        node = service.handle(m.Register(name, f"{name}:1"), 0).node
        service.handle(m.FinishRegistration(), node)
        nodes.append(node)
    return service, nodes[0], nodes[1]


def checksum(name: bytes) -> int:
    """A chunk checksum as a node computes it: 64 bits of hash (an int of 3 digits, mostly)."""
    return int.from_bytes(hashlib.blake2b(name, digest_size=8).digest(), "little")


def store(service: MetadataService, parent: int, name: bytes, node: int, forget: bool = True) -> int:
    opened = service.handle(m.Create(parent, name, 0o644, 0, 0, node, True), node)
    # A node's Seal as the master decodes it: written after the create, its ctime equal to
    # its mtime but another int object.
    mtime = service.clock.wall_ns() + 1000
    service.handle(m.Seal(opened.version, 4096, mtime, [checksum(name)], int(str(mtime))), node)
    service.handle(m.Release(opened.version, True), node)
    if forget:  # the kernel forgets the inode, as it does for most of a large directory
        service.handle(m.Forget([opened.attr.ino]), node)
    return opened.attr.ino


def list_all(service: MetadataService, directory: int, node: int, page: int) -> list[bytes]:
    names: list[bytes] = []
    start = 0
    while True:
        entries = service.handle(m.ReadDir(directory, start, page), node).entries
        if not entries:
            return names
        names += [entry.name for entry in entries]
        start = entries[-1].next_id


def test_a_listing_walks_its_pages_not_the_directory() -> None:
    service, a, _ = cluster()
    directory = service.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), a).ino
    names = [b"f%06d" % i for i in range(20_000)]
    for name in names:
        store(service, directory, name, a)
    entries = service.ns.inodes[directory].children
    assert isinstance(entries, Entries)

    entries.steps = 0
    assert list_all(service, directory, a, 256) == names
    assert entries.steps == len(names)  # every slot once: no page rescans the ones before it

    # Remove most of the first half (tombstones) and some names are added meanwhile: still no
    # skip or repeat, and the walk stays within twice what it returns.
    for name in names[:9_000]:
        service.handle(m.Unlink(directory, name), a)
    added = [b"g%06d" % i for i in range(100)]
    for name in added:
        store(service, directory, name, a)
    entries.steps = 0
    listed = list_all(service, directory, a, 256)
    assert listed == names[9_000:] + added
    assert entries.steps <= 2 * len(listed) + COMPACT_MIN


def test_tombstones_are_compacted_once_they_dominate() -> None:
    entries = Entries()
    for i in range(1, 1001):
        entries.add(b"n%d" % i, 1000 + i, i)
    for i in range(1, 900):
        entries.remove(b"n%d" % i, i)
    # Compacted whenever removed ids outnumbered live ones: the arrays hold about the live entries.
    assert len(entries._ids) <= 2 * len(entries) + COMPACT_MIN
    assert entries.page(0, 5) == [(1000 + i, i) for i in range(900, 905)]
    assert entries.page(950, 1000) == [(1000 + i, i) for i in range(951, 1001)]


def test_a_nodes_death_touches_its_own_files_and_walks_the_inodes_in_slices() -> None:
    service, a, b = cluster()
    directory = service.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), a).ino
    service.handle(m.WatchNames(directory, 1 << 20), b)  # b keeps a copy: a's files must be pushed as hidden
    theirs = [store(service, directory, b"a%05d" % i, a, forget=False) for i in range(5 * STEP_ITEMS)]
    mine = [store(service, directory, b"b%05d" % i, b, forget=False) for i in range(3 * STEP_ITEMS)]
    service.take_notifications(b)
    service.expire_nodes()
    service.clock.advance(0.2)
    service.handle(m.Heartbeat(0, 0), b)
    service.registry.nodes[a].last_seen = -100.0  # a fell silent long ago

    steps = service.backlog.steps
    assert service.expire_nodes() == [a]
    assert len(service.backlog) > 0  # the rest waits for the daemon's slices
    while service.pending_work(0.0):  # one step per call: the smallest slice
        pass
    # Two jobs: hiding, a step per STEP_ITEMS of a's files and a last one (b's files, three
    # steps' worth, were not walked); the kernel references, a step per STEP_ITEMS numbers.
    assert service.backlog.steps - steps <= (len(theirs) // STEP_ITEMS + 2) + (service.ns.next_ino // STEP_ITEMS + 1)
    assert not service.ns.walking  # the walk is over: nothing listed for it any more
    hidden = [change for change in service.take_notifications(b) if change[3] is None]
    assert len(hidden) == len(theirs)  # each of a's files: "ask the master"
    assert not any(service.ns.inodes[ino].refs & (1 << a) for ino in theirs)
    assert all(service.ns.inodes[ino].refs & (1 << b) for ino in mine)
    assert service.handle(m.Lookup(directory, b"a00000"), b).attr is None  # hidden until a registers again

    # a comes back holding everything: its files are visible again, none was dropped.
    service.handle(m.Register("a", "a:1"), 0)
    held = [m.Held(v.version, v.size, True, False, 0, v.checksums) for v in service.objects.of_node(a)]
    assert service.handle(m.Report(held), a).dropped == []
    service.handle(m.FinishRegistration(), a)
    assert service.handle(m.Lookup(directory, b"a00000"), b).attr is not None
    assert len(list_all(service, directory, b, 4096)) == len(theirs) + len(mine)


def test_files_a_node_registers_again_without_are_hidden_at_once_and_go_in_slices() -> None:
    service, a, b = cluster()
    count = 3 * STEP_ITEMS
    for i in range(count):
        store(service, ROOT_INO, b"a%05d" % i, a)
    kept = service.ns.lookup(ROOT_INO, b"a00007")
    assert kept is not None
    # a restarts with one file left (the rest was only in its DRAM).
    assert service.handle(m.Register("a", "a:1"), 0).node == a
    version = service.objects.versions[kept.version]
    service.handle(m.Report([m.Held(version.version, version.size, True, True, 0, version.checksums)]), a)
    steps = service.backlog.steps
    service.handle(m.FinishRegistration(), a)
    assert service.backlog.steps - steps == 1 and len(service.backlog) == 1  # one slice now, the rest later
    assert service.ns.files > 1
    listed = list_all(service, ROOT_INO, b, 4096)
    assert listed == [b"a00007"]  # the others are hidden at once
    assert service.handle(m.Lookup(ROOT_INO, b"a00008"), b).attr is None
    assert service.handle(m.Lookup(ROOT_INO, b"a00007"), b).attr is not None
    while service.pending_work(0.0):
        pass
    assert service.ns.files == 1 and len(service.objects.versions) == 1
    assert sorted(service.handle(m.Heartbeat(0, 0), a).dropped) == []  # its own files: nothing to free
    assert len(service.handle(m.Heartbeat(0, 0), b).forget) == count - 1  # b's kernel forgets the names


def test_a_reference_taken_again_survives_the_slices_of_the_previous_incarnation() -> None:
    service, a, _ = cluster()
    inos = [store(service, ROOT_INO, b"f%05d" % i, a, forget=False) for i in range(3 * STEP_ITEMS)]
    service.handle(m.Register("a", "a:1"), 0)  # a restarts: its kernel references go, in slices
    held = [m.Held(v.version, v.size, True, False, 0, v.checksums) for v in service.objects.of_node(a)]
    service.handle(m.Report(held), a)
    service.handle(m.FinishRegistration(), a)
    assert len(service.backlog) == 1
    waiting = [i for i, ino in enumerate(inos) if service.ns.inodes[ino].refs & (1 << a)]
    assert waiting  # some are left for the next slices
    index = waiting[-1]
    last = inos[index]  # not reached by the first slice
    service.handle(m.Lookup(ROOT_INO, b"f%05d" % index), a)  # the new kernel looks it up
    while service.pending_work(0.0):
        pass
    assert service.ns.inodes[last].refs & (1 << a)  # still referenced: the new kernel holds it
    assert not any(service.ns.inodes[ino].refs & (1 << a) for ino in inos if ino != last)
    service.handle(m.Unlink(ROOT_INO, b"f%05d" % index), a)
    assert last in service.ns.inodes  # unlinked, but kept while the kernel references it


def test_a_node_down_again_midway_has_its_references_walked_anew() -> None:
    service, a, b = cluster()
    inos = [store(service, ROOT_INO, b"f%05d" % i, a, forget=False) for i in range(3 * STEP_ITEMS)]
    shared = inos[-1]
    service.handle(m.Lookup(ROOT_INO, b"f%05d" % (len(inos) - 1)), b)  # b's kernel holds one of them too
    service.handle(m.Register("a", "a:1"), 0)  # a restarts, holding its files: the walk begins
    held = [m.Held(v.version, v.size, True, False, 0, v.checksums) for v in service.objects.of_node(a)]
    service.handle(m.Report(held), a)
    service.handle(m.FinishRegistration(), a)
    assert len(service.backlog) == 1 and a in service.ns.walking
    first = inos[0]
    assert not service.ns.inodes[first].refs & (1 << a)  # (walked by the first slice)
    service.handle(m.Lookup(ROOT_INO, b"f00000"), a)  # the new kernel takes one the walk has passed...
    service.handle(m.Lookup(ROOT_INO, b"f%05d" % (len(inos) - 2)), a)  # ...and one it has not reached
    service.handle(m.Register("a", "a:1"), 0)  # then a restarts again: a new walk, from the start
    while service.pending_work(0.0):
        pass
    assert not service.ns.walking
    assert not any(service.ns.inodes[ino].refs & (1 << a) for ino in inos)
    assert service.ns.inodes[shared].refs == 1 << b  # b's reference is b's own


def test_a_dead_nodes_walk_ends_once_its_references_are_found() -> None:
    service, a, _ = cluster()
    low = store(service, ROOT_INO, b"low", a, forget=False)
    for i in range(4 * STEP_ITEMS):
        store(service, ROOT_INO, b"f%05d" % i, a)  # forgotten by a's kernel
    assert service.ns.held[a] == 1
    service.handle(m.Register("a", "a:1"), 0)  # a restarts: its one reference is in the first slice
    assert not service.ns.inodes[low].refs & (1 << a) and service.ns.held[a] == 0
    assert not service.ns.walking  # the walk ended there, not at the last number
    held = [m.Held(v.version, v.size, True, False, 0, v.checksums) for v in service.objects.of_node(a)]
    service.handle(m.Report(held), a)
    service.handle(m.FinishRegistration(), a)
    service.handle(m.Lookup(ROOT_INO, b"low"), a)
    assert service.ns.held[a] == 1
    service.handle(m.Forget([low]), a)
    assert service.ns.held[a] == 0
    service.handle(m.Register("a", "a:1"), 0)  # nothing referenced: no walk at all
    assert not service.ns.walking


def test_a_node_dead_past_its_time_is_forgotten_in_slices() -> None:
    service, a, b = cluster(forget_dead_after_s=60.0)
    directory = service.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), a).ino
    count = 3 * STEP_ITEMS + 10
    for i in range(count):
        store(service, directory, b"a%05d" % i, a)
    kept = store(service, directory, b"kept", b)
    service.expire_nodes()
    for _ in range(400):  # passes every 0.25 s while b heartbeats and a stays silent
        service.clock.advance(0.25)
        service.handle(m.Heartbeat(0, 0), b)
        service.expire_nodes()
        if "a" not in service.registry.by_name:
            break
    assert "a" not in service.registry.by_name and service.members.forgotten == 1
    assert service.ns.files > 1  # the names go in slices, not in the pass that forgot a
    calls = 0
    while service.pending_work(0.0):
        calls += 1
    # The forgetting, a step per STEP_ITEMS of a's files, and the walk for the kernel
    # references a held when it died (the directory), a step per STEP_ITEMS numbers.
    assert calls <= count // STEP_ITEMS + 1 + service.ns.next_ino // STEP_ITEMS + 1
    assert service.ns.files == 1 and service.ns.inodes[kept].linked
    assert list_all(service, directory, b, 4096) == [b"kept"]
    assert a not in service.objects.by_node
    forgets = service.registry.nodes[b].outbox_forget
    assert len(forgets) == count  # b's kernel is told to forget each name
    # The name registers again as a new node: the forgotten id is never reused.
    assert service.handle(m.Register("a", "a:2"), 0).node not in (a, b)


def test_files_past_their_publish_grace_are_forgotten_as_publishing() -> None:
    service, a, _ = cluster(publish_grace_s=30.0)
    for i in range(1000):
        store(service, ROOT_INO, b"f%04d" % i, a)
    assert len(service._unpublished) == 1000
    service.clock.advance(31)
    store(service, ROOT_INO, b"late", a)
    assert list(service._unpublished) == [service.ns.lookup(ROOT_INO, b"late").ino]  # type: ignore[union-attr]


def test_a_new_files_numbers_are_one_int_and_stay_unique(tmp_path: Path) -> None:
    service, a, _ = cluster()
    ino = store(service, ROOT_INO, b"first", a)
    inode = service.ns.inodes[ino]
    version = service.objects.versions[inode.version]
    # Inode number, first version id and entry id: one int object (32 B per file, not 96).
    assert inode.version is ino and version.version is ino and version.ino is ino and inode.entry_id is ino
    # Numbers taken apart (a rewrite's version, a rename's entry, a node's block) are never
    # handed out again: the next file is numbered past all of them, and shares again.
    service.handle(m.OpenWrite(ino, a, truncate=True), a)
    service.handle(m.Rename(ROOT_INO, b"first", ROOT_INO, b"moved"), a)
    block = service.handle(m.GrantNumbers(4), a)
    assert block.first_ino == block.first_version
    rewritten, renamed = service.ns.inodes[ino].version, service.ns.inodes[ino].entry_id
    assert rewritten > ino and renamed > ino and max(rewritten, renamed) < block.first_ino
    second = service.ns.inodes[store(service, ROOT_INO, b"second", a)]
    assert second.ino >= block.first_ino + 4
    assert second.version is second.ino and second.entry_id is second.ino
    now = service.clock.wall_ns()
    published = service.handle(m.Publish(ROOT_INO, b"third", a, block.first_ino, block.first_version, 0o644, 0, 0,
                                          4096, [7], now, now), a)
    third = service.ns.inodes[published.attr.ino]
    assert service.objects.versions[third.version].version is third.ino  # a published file's pair: one int
    # A restart loads them as one int again (they are saved as numbers, as before).
    state = MasterState(tmp_path / "state")
    state.save(service)
    state.close()
    restarted, _, _ = cluster()
    MasterState(tmp_path / "state").load(restarted)
    loaded = restarted.ns.inodes[second.ino]
    assert loaded.version is loaded.ino and loaded.entry_id is loaded.ino
    assert restarted.objects.versions[loaded.version].version is loaded.ino
    assert restarted.objects.versions[loaded.version].ino is loaded.ino


def test_compact_records_read_and_take_what_they_did() -> None:
    version = FileVersion(7, 3, 1, checksums=[0, 2**64 - 1, 5], on_disk=True)
    assert version.checksums == [0, 2**64 - 1, 5] and isinstance(version.checksums, list)
    assert (version.sealed, version.current, version.on_disk, version.held) == (False, True, True, False)
    version.held, version.on_disk = True, False
    assert (version.sealed, version.current, version.on_disk, version.held) == (False, True, False, True)
    version.checksums = []
    assert version.checksums == []

    inode = Inode(5, 0o100644, 0, 0, 1, 1, 1)
    assert inode.xattrs == {} and inode.meta[3] is None  # no dict until an attribute is set
    inode.set_xattr(b"user.a", b"1")
    assert inode.xattrs == {b"user.a": b"1"}
    assert inode.remove_xattr(b"user.a") == b"1" and inode.meta[3] is None
    assert inode.remove_xattr(b"user.a") is None
    directory = make_inode(6, 0o040755, 0, 0, 1, 1, 1, children={})  # as a saved state builds it
    assert isinstance(directory, Directory) and not hasattr(inode, "__dict__")
    assert directory.is_dir and len(directory.children) == 0 and directory.subdirs == 0  # type: ignore[arg-type]


def test_fields_kept_together_read_back_what_was_set() -> None:
    # A version's node, size and flags share one int; hits and open counts are another.
    version = FileVersion(9, 9, 300, size=2**63, checksums=[2**64 - 1], sealed=True, readers=2, writers=1, hits=5)
    assert (version.node, version.size, version.sealed, version.current) == (300, 2**63, True, True)
    assert (version.readers, version.writers, version.hits, version.in_use) == (2, 1, 5, True)
    version.node, version.size, version.on_disk = 4, 4096, True
    version.readers -= 2
    version.writers -= 1
    version.hits += 1
    assert (version.node, version.size, version.sealed, version.on_disk) == (4, 4096, True, True)
    assert (version.readers, version.writers, version.hits, version.in_use) == (0, 0, 6, False)
    version.readers = -1  # (a release past zero stays at zero, as before)
    assert version.readers == 0 and version.hits == 6
    assert version.checksums == [2**64 - 1] and version.last_access_ns == 0
    with pytest.raises(OverflowError):
        version.checksums = [2**64]
    with pytest.raises(ValueError):
        version.size = -1
    same = FileVersion(10, 10, 4, size=4096, sealed=True, on_disk=True)
    assert same._place is version._place  # one int object for equal places

    # An inode's mode, owner and attributes: one tuple shared by inodes without attributes.
    first, second = Inode(20, 0o100644, 7, 8, 1, 1, 1), Inode(21, 0o100644, 7, 8, 1, 1, 1)
    assert first.meta is second.meta
    first.set_xattr(b"user.k", b"v")
    assert (first.mode, first.uid, first.gid, first.xattrs) == (0o100644, 7, 8, {b"user.k": b"v"})
    assert second.xattrs == {} and first.meta is not second.meta
    first.mode, first.uid, first.gid = 0o100600, 70, 80
    assert (first.mode, first.uid, first.gid, first.xattrs) == (0o100600, 70, 80, {b"user.k": b"v"})
    first.remove_xattr(b"user.k")
    first.mode, first.uid, first.gid = 0o100644, 7, 8
    assert first.meta is second.meta

    # Times: the ns given, from 1970 on, the three in one int (tests/test_packed_times.py).
    now = 1_790_000_000_123_456_789
    inode = Inode(22, 0o100644, 0, 0, now, now, now)
    assert inode.times() == (now, now, now) and type(inode._times) is int
    inode.mtime_ns = inode.ctime_ns = now + 1
    assert inode.times() == (now, now + 1, now + 1)
    inode.atime_ns, inode.mtime_ns = 0, -1
    assert (inode.atime_ns, inode.mtime_ns, inode.ctime_ns) == (0, -1, now + 1)
    version.last_access = inode.access(now + 5)  # the inode's object, shared
    assert inode.atime_ns == version.last_access_ns == now + 5 and version.last_access is inode._times


def test_fields_read_in_one_call_are_those_the_properties_read() -> None:
    # `fields` (one read per request) agrees with the properties, after changes too.
    for node, size, sealed, current, on_disk in [(1, 4096, False, True, False), (7, 2**40 + 3, True, False, True),
                                                 (2**32 - 1, 2**64 - 1, True, True, True)]:
        version = FileVersion(5, 5, node, size=size, sealed=sealed, current=current, on_disk=on_disk)
        assert version.fields() == (version.node, version.size, version.sealed, version.current,
                                    version.on_disk) == (node, size, sealed, current, on_disk)
    version.on_disk, version.size = False, 12
    assert version.fields() == (2**32 - 1, 12, True, True, False)
    # A release takes one handle of its kind, never below none.
    version = FileVersion(6, 6, 1, readers=2, writers=1, hits=3)
    version.closed(True)
    version.closed(True)
    version.closed(False)
    assert (version.readers, version.writers, version.hits, version.in_use) == (1, 0, 3, True)

    # A seal's times: mtime as given; ctime never goes back.
    now = 1_790_000_000_123_456_789
    inode = Inode(23, 0o100644, 0, 0, now, now, now)
    inode.modified(now + 10, now + 10)
    assert inode.times() == (now, now + 10, now + 10)
    inode.ctime_ns = now + 50  # a chmod while the file was written
    inode.modified(now + 20, now + 20)
    assert inode.times() == (now, now + 20, now + 50)
    inode.modified(now + 50, now + 30)  # ctime stays later, mtime caught up with it
    assert inode.times() == (now, now + 50, now + 50)
    inode.modified(now + 60, now + 70)
    assert inode.times() == (now, now + 60, now + 70)
    # A directory's entries changed: mtime and ctime now.
    inode.entries_changed(now + 80)
    assert inode.times() == (now, now + 80, now + 80)

def test_a_number_table_frees_the_pages_of_numbers_gone() -> None:
    table: NumberTable[str] = NumberTable()
    reference: dict[int, str] = {}
    for number in range(1, 3 * PAGE_SLOTS):  # numbers only grow; the old ones go, as files are evicted
        table[number] = reference[number] = str(number)
        if number > PAGE_SLOTS // 2:
            gone = number - PAGE_SLOTS // 2
            assert table.pop(gone) == reference.pop(gone)
    assert table == reference and len(table) == len(reference) and list(table) == sorted(reference)
    assert list(table.values()) == [reference[n] for n in sorted(reference)]
    assert len(table._pages) <= 2  # the pages of the numbers gone went with their last number
    assert table.get(0) is None and table.get(-1) is None and -1 not in table and "1" not in table
    with pytest.raises(KeyError):
        table[5]
    with pytest.raises(KeyError):
        del table[5]
    with pytest.raises(ValueError):
        table[-1] = "x"


def test_the_reuse_history_and_the_resident_keys_share_one_bound() -> None:
    policy = ReusePolicy(bonus=100, history=10)
    for key in range(8):
        policy.insert(key, 1, 0.0)
        policy.identify(key, 1000 + key)
    for key in range(8):  # all evicted: their uses are remembered under their names
        policy.remove(key)
    assert len(policy._left) == 8 and len(policy) == 0
    for key in range(20, 26):  # six new ones: the oldest departures make room
        policy.insert(key, 1, 0.0)
    assert len(policy) == 6 and len(policy._left) == 4
    assert list(policy._left) == [1004, 1005, 1006, 1007]
    policy.identify(30, 1007)  # stored again under a remembered name: known as used once
    policy.insert(30, 1, 0.0)
    policy.insert(31, 1, 0.0)
    assert list(policy.candidates())[-1] == 30  # (class 2 outranks the newer one-off blocks)


FILES = 20_000
# What the service keeps per file (inode, version, entry, index, the policy's entries), names
# excluded (they are the caller's), with each policy and seals as a node sends them (see
# `store`: a 64-bit checksum); measured with this layout on Python 3.11: 420 B with LRU, 440 B
# with reuse (its record per key: the name's identity, the last use and the uses); 493 and
# 513 B before the inode's mode, owner and attributes became one shared tuple, a version's
# node, size and flags one shared int and its hits and open counts another, a one-chunk
# checksum the int itself and times offsets from a recent base; 577 and 597 B before a new
# file's inode number, first version id and entry id became one int and the policies' key maps
# pages of slots; 621 and 758 B before inodes and versions went into tables indexed by number
# and the reuse policy's maps and history entry into one record, 673 and 813 B before the seal
# kept one int for mtime and ctime, plain files lost their children and target slots and
# identities took 60 bits.
BYTES_PER_FILE = {"lru": 425, "reuse": 445}


@pytest.mark.skipif(not hasattr(tracemalloc, "start"), reason="no tracemalloc")
@pytest.mark.parametrize("policy", sorted(BYTES_PER_FILE))
def test_memory_per_file_is_bounded(policy: str) -> None:
    service, a, _ = cluster(policy=make_policy(policy))
    directory = service.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), a).ino
    names = [b"f%06d" % i for i in range(FILES)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for name in names:
            store(service, directory, name, a)
        service.clock.advance(31)  # past the publish grace
        store(service, directory, b"last", a)
        service.ns.dirty.clear()  # what the owner's save does
        service.objects.dirty.clear()
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    per_file = used / FILES
    assert per_file <= BYTES_PER_FILE[policy], f"{per_file:.0f} B per file with {policy}"
