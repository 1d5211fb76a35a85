"""An inode's three times packed in one object (kvfs.cluster.times): every time, inside the
packed range or out of it, reads back as the same ns count, through the real service, its
lmdb state, a record saved before the packing and a real cluster mount."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import msgspec

from conftest import Cluster
from kvfs.clock import ManualClock
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO, Inode
from kvfs.cluster.objects import FileVersion
from kvfs.cluster.persist import MasterState
from kvfs.cluster.records import SavedInode, decode_inode, encode_inode
from kvfs.cluster.times import BASE_NS, FIELD_MASK, Times, pack, unpack
from kvfs.cluster.validate import TIME_MAX, TIME_MIN
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m

NOW = 1_790_000_000_123_456_789
# ns since 1970: the ends of the narrow form (60-bit offsets from BASE_NS), just past them,
# 1970 and before it, and the ends of what a request may carry (a signed 64-bit count).
EDGES = [NOW, BASE_NS, BASE_NS - 1, BASE_NS + FIELD_MASK, BASE_NS + FIELD_MASK + 1, 0, 1, -1,
         -1_500_000_000_123_456_789, TIME_MIN, TIME_MAX]


def forms(times: Times) -> str:
    if type(times) is tuple:
        return "tuple"
    return "narrow" if times >= 0 else "wide"


def test_the_three_forms_and_their_edges() -> None:
    for atime in EDGES:
        for mtime in EDGES:
            for ctime in EDGES[:3] + EDGES[5:]:
                inode = Inode(2, 0o100644, 0, 0, atime, mtime, ctime)
                assert inode.times() == (atime, mtime, ctime)
                assert (inode.atime_ns, inode.mtime_ns, inode.ctime_ns) == (atime, mtime, ctime)
                narrow = all(0 <= t - BASE_NS <= FIELD_MASK for t in (atime, mtime, ctime))
                assert forms(inode._times) == ("narrow" if narrow else "wide")
    assert sys.getsizeof(pack(NOW - BASE_NS, NOW - BASE_NS + 1, NOW - BASE_NS + 2)) <= 48
    assert sys.getsizeof(pack(-BASE_NS, TIME_MAX - BASE_NS, TIME_MIN - BASE_NS)) <= 64
    # Past a signed 64-bit count (only a saved state could hold one): a tuple, still exact.
    for far in (TIME_MAX + 1, TIME_MIN - 1, 10**30, -(10**30)):
        inode = Inode(3, 0o100644, 0, 0, far, NOW, far)
        assert forms(inode._times) == "tuple" and inode.times() == (far, NOW, far)
        assert unpack(pack(far - BASE_NS, 0, -1)) == (far - BASE_NS, 0, -1)


def test_each_setter_changes_its_time_only_across_the_forms() -> None:
    inode = Inode(2, 0o100644, 0, 0, NOW, NOW, NOW)
    for value in EDGES + [TIME_MAX + 1, NOW]:
        inode.atime_ns = value
        assert inode.times() == (value, NOW, NOW)
    for value in EDGES + [TIME_MIN - 1, NOW + 1]:
        inode.mtime_ns = value
        assert inode.times() == (NOW, value, NOW)
    for value in EDGES + [10**25, NOW + 2]:
        inode.ctime_ns = value
        assert inode.times() == (NOW, NOW + 1, value)
    inode.modified(0, NOW + 1)  # ctime never goes back; mtime as given, in 1970
    assert inode.times() == (NOW, 0, NOW + 2) and forms(inode._times) == "wide"
    inode.modified(NOW + 5, NOW + 6)
    assert inode.times() == (NOW, NOW + 5, NOW + 6) and forms(inode._times) == "narrow"
    inode.entries_changed(TIME_MAX)
    assert inode.times() == (NOW, TIME_MAX, TIME_MAX)
    # A read: the version keeps the inode's object as it is then, and its atime only.
    version = FileVersion(2, 2, 1)
    for value in (NOW + 9, 0, -1, TIME_MIN, NOW + 10):
        version.last_access = inode.access(value)
        assert version.last_access is inode._times and version.last_access_ns == inode.atime_ns == value
        inode.mtime_ns = NOW  # later changes leave the version's atime alone
        assert version.last_access_ns == value and inode.times() == (value, NOW, TIME_MAX)
    for value in (1, -1, BASE_NS, BASE_NS - 1, BASE_NS + FIELD_MASK + 1, TIME_MIN, TIME_MAX):
        assert FileVersion(3, 3, 1, last_access_ns=value).last_access_ns == value  # (0: never read)


def test_records_saved_before_the_packing_load_exact_and_save_the_same() -> None:
    encode = msgspec.msgpack.Encoder().encode
    for atime, mtime, ctime in [(0, 0, NOW), (-1, TIME_MIN, TIME_MAX), (NOW, BASE_NS - 1, NOW),
                                (BASE_NS + FIELD_MASK + 1, NOW, NOW + 1), (2**64 - 1, 1, NOW)]:
        saved = encode(SavedInode(0o100644, 5, 6, atime, mtime, ctime, ROOT_INO, b"f", 9, False, 9, {}))
        inode = decode_inode(9, saved)
        assert inode.times() == (atime, mtime, ctime)
        assert encode_inode(inode) == saved  # the record is what it was, byte for byte


def service(clock: ManualClock) -> tuple[MetadataService, int, int]:
    svc = MetadataService(clock, LruPolicy(), MasterSettings(cluster=True))
    node = svc.handle(m.Register("a", "a:1"), 0).node
    svc.handle(m.FinishRegistration(), node)
    directory = svc.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), node).ino
    return svc, node, directory


def test_times_through_the_service_save_and_load_exact(tmp_path: Path) -> None:
    """Each edge as atime, as mtime and as the clock's ctime (mtime != ctime), set through
    requests, then saved to lmdb and loaded into a fresh service."""
    clock = ManualClock(NOW)
    svc, node, directory = service(clock)
    expected: dict[int, tuple[int, int, int]] = {}
    for i, edge in enumerate(EDGES):
        opened = svc.handle(m.Create(directory, b"f%d" % i, 0o644, 0, 0, node, True), node)
        svc.handle(m.Seal(opened.version, 4096, edge, [1], release=True), node)  # a node's mtime
        mtime = EDGES[(i + 3) % len(EDGES)]
        clock._wall_ns = EDGES[(i + 7) % len(EDGES)]  # the master's clock makes the ctime
        attr = svc.handle(m.SetAttr(opened.attr.ino, atime_ns=edge, mtime_ns=mtime), node)
        expected[attr.ino] = (edge, mtime, clock.wall_ns())
        assert (attr.atime_ns, attr.mtime_ns, attr.ctime_ns) == expected[attr.ino]
        opened = svc.handle(m.OpenRead(attr.ino), node)  # a read moves atime, in memory only
        info = svc.handle(m.GetVersion(opened.version), node)
        assert info.last_access_ns == clock.wall_ns() == svc.handle(m.GetAttr(attr.ino), node).atime_ns
        attr = svc.handle(m.SetAttr(attr.ino, atime_ns=edge), node)  # back, and saved
        assert (attr.atime_ns, attr.mtime_ns, attr.ctime_ns) == expected[attr.ino]
    state = MasterState(tmp_path / "state")
    try:
        assert state.save(svc)
        fresh = MetadataService(clock, LruPolicy(), svc.settings)
        state.load(fresh)
    finally:
        state.close()
    assert {ino: fresh.ns.inodes[ino].times() for ino in expected} == expected


def test_edge_times_through_a_cluster_mount_and_the_master_state(tmp_path: Path) -> None:
    """`touch -d @0` and other times far from now set through a node's mount read back exact,
    and so does the state the real master saved on its way down."""
    cluster = Cluster(tmp_path)
    try:
        root = cluster.add_node("64M").path
        (root / "zero").write_bytes(b"0")
        subprocess.run(["touch", "-d", "@0", str(root / "zero")], check=True)
        cases = {"zero": (0, 0), "before": (1_000_000_000, 1_600_000_000_987_654_321),
                 "edge": (BASE_NS + FIELD_MASK, BASE_NS + FIELD_MASK + 1),
                 "far": (TIME_MAX - 807, 7_258_118_400 * 10**9)}  # (the kernel's: µs granularity)
        for name, (atime, mtime) in cases.items():
            if name != "zero":
                (root / name).write_bytes(name.encode())
                os.utime(root / name, ns=(atime, mtime))
            st = os.stat(root / name)
            assert (st.st_atime_ns, st.st_mtime_ns) == (atime, mtime), name
            assert st.st_ctime_ns > 1_700_000_000 * 10**9  # the master's clock, now
        cluster.master.stop()  # saves its state
        fresh = MetadataService(ManualClock(), LruPolicy(), MasterSettings(cluster=True))
        state = MasterState(cluster.master.data)
        try:
            state.load(fresh)
        finally:
            state.close()
        for name, (atime, mtime) in cases.items():
            inode = fresh.ns.existing(ROOT_INO, name.encode())
            assert inode.times()[:2] == (atime, mtime), name
    finally:
        errors = cluster.close()
    assert not errors, "kvfs logged unexpected errors:\n" + "\n".join(errors)
