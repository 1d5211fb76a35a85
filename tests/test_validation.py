"""Requests with fields no kernel or correct node produces are refused before anything is
applied: in the pure service (what the embedded master calls), when a frame is decoded, and by
a live `kvfs master`, whose state stays saved and equal to what it holds in memory."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Iterator

import msgspec
import pytest
import trio

from conftest import UNEXPECTED, Cluster, load_tls
from kvfs.clock import ManualClock
from kvfs.cluster.embedded import EmbeddedMaster
from kvfs.cluster.master import XATTRS_MAX_BYTES, MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.persist import MasterState
from kvfs.cluster.validate import check_request
from kvfs.errors import MetadataError
from kvfs.net.rpc import MasterUnavailable, RemoteMaster, _ANY_REQUEST
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m
from kvfs.wire.protocol import HeaderDecoder, ProtocolError, encode_frame, FrameKind, PREFIX_SIZE
from master_view import reloaded_view, saved_view

U64 = 2**64


class Master:
    """The service with its lmdb state, saved after every request as `kvfs master` does."""

    def __init__(self, directory: Path, cluster: bool = True) -> None:
        self.clock = ManualClock()
        self.service = MetadataService(self.clock, LruPolicy(), MasterSettings(cluster=cluster))
        self.state = MasterState(directory, map_size=64 << 20)
        self.node = 1
        if cluster:
            self.node = self.call(m.Register("a", "a:1"), 0).node
            self.call(m.Report([]))
            self.call(m.FinishRegistration())

    def call(self, request: m.Request, caller: int | None = None) -> object:
        try:
            return self.service.handle(request, self.node if caller is None else caller)
        finally:
            self.state.save(self.service)

    def refuses(self, request: m.Request, code: int) -> MetadataError:
        before = saved_view(self.service)
        with pytest.raises(MetadataError) as raised:
            self.call(request)
        assert raised.value.errno == code, raised.value
        assert saved_view(self.service) == before, f"{request!r} changed the state before it was refused"
        return raised.value

    def reloads_equal(self) -> None:
        assert not self.service.ns.dirty and not self.service.objects.dirty
        assert reloaded_view(self.service, self.state) == saved_view(self.service)


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    started = Master(tmp_path / "state")
    yield started
    started.state.close()


def record(path: list[bytes], **fields: object) -> m.FileRecord:
    values: dict = dict(size=7, mode=stat.S_IFREG | 0o644, uid=0, gid=0, mtime_ns=5, xattrs={})
    values.update(fields)
    return m.FileRecord(path, **values)


# Issue 16, item 2: a version id outside 0..2^64-1 bricked the master's saves --------------


@pytest.mark.parametrize("version", [-1, U64, 2**70, 0])
def test_a_version_id_out_of_range_is_refused_and_saving_goes_on(master: Master, version: int) -> None:
    master.refuses(m.Restore(version, master.node, record([b"r.bin"]), [1]), errno.EINVAL)
    master.refuses(m.Report([m.Held(version, 7, True, True, 5, [1], record([b"h.bin"]))]), errno.EINVAL)
    # Every later request is applied and saved; a restart finds it.
    attr = master.call(m.MkDir(ROOT_INO, b"after", 0o755, 0, 0))
    assert master.service.handle(m.Lookup(ROOT_INO, b"after"), master.node).attr.ino == attr.ino
    master.reloads_equal()


def test_a_version_id_out_of_range_is_refused_by_every_request(master: Master) -> None:
    for request in (m.GetVersion(-1), m.GetRecord(U64), m.Lost(-5), m.Release(U64, True),
                    m.Seal(-1, 1, 1, [1]), m.Offloaded([1, -1]), m.Forget([U64]), m.OpenRead(U64),
                    m.GetAttr(-1), m.Lookup(-1, b"a"), m.Reclaim(1, U64), m.Reclaim(-1, 1)):
        master.refuses(request, errno.EINVAL)
    master.reloads_equal()


def test_a_live_master_refuses_a_version_out_of_range_and_keeps_its_state(tmp_path: Path) -> None:
    """The attack of item 2 against `kvfs master`: a Restore with version -1 (msgpack carries
    nothing above 2^64 - 1). Decoding refuses it: that connection is closed with the reason
    logged; the master saves every later change, and has them after a restart."""
    cluster = Cluster(tmp_path)
    host, port = cluster.master.address.rsplit(":", 1)

    async def attack_then_work() -> None:
        async with trio.open_nursery() as nursery:
            attacker = await RemoteMaster.connect(host, int(port), load_tls("n0"), nursery)
            with pytest.raises(MasterUnavailable):
                with trio.fail_after(10):
                    await attacker.call(m.Restore(-1, 1, record([b"evil.bin"]), [1]))
            client = await RemoteMaster.connect(host, int(port), load_tls("n1"), nursery)
            node = (await client.call(m.Register("n1", "127.0.0.1:1"))).node
            await client.call(m.Report([]))
            await client.call(m.FinishRegistration())
            await client.call(m.MkDir(ROOT_INO, b"saved", 0o755, 0, 0))
            assert node >= 1
            await client.aclose()
            nursery.cancel_scope.cancel()

    async def look_up(name: bytes) -> m.Entry:
        async with trio.open_nursery() as nursery:
            client = await RemoteMaster.connect(host, int(port), load_tls("n1"), nursery)
            entry = await client.call(m.Lookup(ROOT_INO, name))
            await client.aclose()
            nursery.cancel_scope.cancel()
        return entry

    try:
        trio.run(attack_then_work)
        cluster.master.stop()
        cluster.master.start(port=int(port))
        assert trio.run(look_up, b"saved").attr is not None
        assert trio.run(look_up, b"evil.bin").attr is None
        log = cluster.master.log_text()
        assert "invalid header" in log and "$.version" in log
        assert not [line for line in log.splitlines() if UNEXPECTED.search(line)], log[-3000:]
    finally:
        cluster.close()


# Issue 16, item 3: names and attributes no kernel accepts ---------------------------------

BAD_NAMES = [(b"", errno.EINVAL), (b"a/b", errno.EINVAL), (b"a\0b", errno.EINVAL), (b".", errno.EINVAL),
             (b"..", errno.EINVAL), (b"x" * 256, errno.ENAMETOOLONG), (b"x" * 10_000, errno.ENAMETOOLONG)]


@pytest.mark.parametrize("name, code", BAD_NAMES)
def test_names_no_kernel_accepts_are_refused(master: Master, name: bytes, code: int) -> None:
    d = master.call(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0))
    master.refuses(m.MkDir(d.ino, name, 0o755, 0, 0), code)
    master.refuses(m.Create(d.ino, name, 0o644, 0, 0, master.node, True), code)
    master.refuses(m.Symlink(d.ino, name, b"target", 0, 0), code)
    master.refuses(m.Rename(ROOT_INO, b"d", d.ino, name), code)
    master.refuses(m.Restore(99, master.node, record([b"ok", name]), [1]), code)
    master.refuses(m.Report([m.Held(98, 7, True, True, 5, [1], record([name]))]), code)
    assert [e.name for e in master.call(m.ReadDir(ROOT_INO, 0, 100)).entries] == [b"d"]
    master.reloads_equal()


def test_lookups_of_dot_names_still_resolve(master: Master) -> None:
    d = master.call(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0))
    assert master.call(m.Lookup(d.ino, b".")).attr.ino == d.ino
    assert master.call(m.Lookup(d.ino, b"..")).attr.ino == ROOT_INO
    master.refuses(m.Lookup(d.ino, b"a/b"), errno.EINVAL)
    master.refuses(m.Lookup(d.ino, b"x" * 256), errno.ENAMETOOLONG)


@pytest.mark.parametrize("request_, code", [
    (m.MkDir(ROOT_INO, b"u", 0o755, 2**32, 0), errno.EINVAL),
    (m.MkDir(ROOT_INO, b"g", 0o755, 0, -1), errno.EINVAL),
    (m.MkDir(ROOT_INO, b"m", 0o1000000, 0, 0), errno.EINVAL),
    (m.Create(ROOT_INO, b"m", -1, 0, 0, 1, True), errno.EINVAL),
    (m.SetAttr(ROOT_INO, uid=2**32), errno.EINVAL),
    (m.SetAttr(ROOT_INO, gid=U64), errno.EINVAL),
    (m.SetAttr(ROOT_INO, mode=0o200000), errno.EINVAL),
    (m.SetAttr(ROOT_INO, mtime_ns=U64 - 1), errno.EINVAL),
    (m.SetAttr(ROOT_INO, atime_ns=-(2**63) - 1), errno.EINVAL),
    (m.SetAttr(ROOT_INO, mtime_ns=10**30), errno.EINVAL),
    (m.Symlink(ROOT_INO, b"l", b"", 0, 0), errno.ENOENT),
    (m.Symlink(ROOT_INO, b"l", b"t" * 4096, 0, 0), errno.ENAMETOOLONG),
    (m.Symlink(ROOT_INO, b"l", b"a\0b", 0, 0), errno.EINVAL),
    (m.SetXattr(ROOT_INO, b"user." + b"x" * 251, b"v"), errno.ERANGE),
    (m.SetXattr(ROOT_INO, b"user.k", bytes(65537)), errno.E2BIG),
    (m.SetXattr(ROOT_INO, b"trusted.k", b"v"), errno.ENOTSUP),
    (m.SetXattr(ROOT_INO, b"user.k\0", b"v"), errno.ENOTSUP),
    (m.GetXattr(ROOT_INO, b"user." + bytes(300)), errno.ERANGE),
    (m.Forget(list(range(m.MAX_IDS + 1))), errno.E2BIG),
    (m.Offloaded([1] * (m.MAX_IDS + 1)), errno.E2BIG),
    (m.Unwatch([1] * (m.MAX_IDS + 1)), errno.E2BIG),
    (m.Seal(1, 1, 1, [1] * (m.MAX_CHUNKS + 1)), errno.E2BIG),
    (m.Seal(1, 1 << 62, 1, [1]), errno.EFBIG),
    (m.Seal(1, 1, 1, [U64]), errno.EINVAL),
    (m.Seal(1, 1, 1, [1], ctime_ns=U64), errno.EINVAL),
    (m.Report([], [(1, True, -1)]), errno.EINVAL),
    (m.Report([m.Held(5, 1, True, True)] * (m.MAX_HELD + 1)), errno.E2BIG),
    (m.Register("a\nWARNING forged", "x:1"), errno.EINVAL),
    (m.Register("", "x:1"), errno.EINVAL),
    (m.Register("n" * 256, "x:1"), errno.E2BIG),
    (m.Heartbeat(U64, 0), errno.EINVAL),
    (m.Heartbeat(1 << 60, 0), errno.EINVAL),
    (m.Heartbeat(1, 0, activity=m.Activity(read_bytes=-1)), errno.EINVAL),
    (m.Reclaim(1, 1, "tape"), errno.EINVAL),  # type: ignore[arg-type]
    (m.WatchNames(ROOT_INO, -1), errno.EINVAL),
    (m.Restore(9, 1, record([b"r"], mode=stat.S_IFDIR | 0o755), [1]), errno.EINVAL),
    (m.Restore(9, 1, record([b"r"], mode=stat.S_IFLNK | 0o777), [1]), errno.EINVAL),
    (m.Restore(9, 1, record([]), [1]), errno.EINVAL),
    (m.Restore(9, 1, record([b"r"], uid=2**32), [1]), errno.EINVAL),
    (m.Restore(9, 1, record([b"r"], mtime_ns=U64 - 1), [1]), errno.EINVAL),
    (m.Restore(9, 1, record([b"r"], size=1 << 60), [1]), errno.EFBIG),
    (m.Restore(9, 1, record([b"r"], xattrs={b"security.x": b"v"}), [1]), errno.ENOTSUP),
    (m.Restore(9, 1, record([b"d"] * (m.MAX_PATH_DEPTH + 1)), [1]), errno.E2BIG),
    (m.Restore(9, 12345, record([b"r"]), [1]), errno.EINVAL),  # no such node
    (m.Create(ROOT_INO, b"c", 0o644, 0, 0, 12345, True), errno.EINVAL),
    (m.Lookup(ROOT_INO, "text"), errno.EINVAL),  # type: ignore[arg-type]
    (m.GetAttr(True), errno.EINVAL),
    (m.GetAttr(1.5), errno.EINVAL),  # type: ignore[arg-type]
])
def test_fields_out_of_range_are_refused_with_their_errno(master: Master, request_: m.Request, code: int) -> None:
    master.refuses(request_, code)
    master.reloads_equal()


def test_a_refusal_names_the_field(master: Master) -> None:
    error = master.refuses(m.SetAttr(ROOT_INO, uid=2**32), errno.EINVAL)
    assert "SetAttr" in str(error) and "uid" in str(error)
    error = master.refuses(m.Restore(U64 + 1, 1, record([b"r"]), [1]), errno.EINVAL)
    assert "$.version" in str(error)
    error = master.refuses(m.Seal(1, 1, 1, [1, 2, U64]), errno.EINVAL)
    assert "$.checksums[2]" in str(error)


def test_a_file_holds_a_bounded_amount_of_attributes(master: Master) -> None:
    attr = master.call(m.MkDir(ROOT_INO, b"x", 0o755, 0, 0))
    value = bytes(60_000)
    count = 0
    with pytest.raises(MetadataError) as raised:
        while count < 100:
            master.call(m.SetXattr(attr.ino, b"user.%d" % count, value))
            count += 1
    assert raised.value.errno == errno.ENOSPC and count == XATTRS_MAX_BYTES // 60_000
    master.call(m.SetXattr(attr.ino, b"user.0", b"smaller"))  # replacing one still works
    master.reloads_equal()


def test_requests_not_requests_are_refused() -> None:
    for thing in (None, m.Attr(1, 0, 0, 0, 0, 0, 0, 0, 0), "Lookup"):
        with pytest.raises(MetadataError) as raised:
            check_request(thing)
        assert raised.value.errno == errno.EINVAL


# The embedded master (one node, in-process) validates too --------------------------------


def test_the_embedded_master_refuses_what_decoding_would() -> None:
    master = EmbeddedMaster(MetadataService(ManualClock(), LruPolicy()))

    async def calls() -> None:
        for request, code in ((m.MkDir(ROOT_INO, b"a/b", 0o755, 0, 0), errno.EINVAL),
                              (m.SetAttr(ROOT_INO, uid=2**40), errno.EINVAL),
                              (m.Restore(U64, 1, record([b"r"]), [1]), errno.EINVAL),
                              (m.Create(ROOT_INO, b"x" * 300, 0o644, 0, 0, 1, True), errno.ENAMETOOLONG)):
            with pytest.raises(MetadataError) as raised:
                await master.call(request)
            assert raised.value.errno == code
        assert (await master.call(m.MkDir(ROOT_INO, b"ok", 0o755, 0, 0))).ino > ROOT_INO

    trio.run(calls)


# On the wire: decoding refuses what the structs bound --------------------------------------


@pytest.mark.parametrize("request_", [
    m.Restore(-1, 1, record([b"r"]), [1]), m.Report([m.Held(-1, 1, True, True)]), m.GetAttr(-1),
    m.MkDir(ROOT_INO, b"d", 0o755, 2**32, 0), m.SetAttr(1, mode=0o200000), m.Forget([0] * (m.MAX_IDS + 1)),
    m.Seal(1, 1, 1, [1] * (m.MAX_CHUNKS + 1)), m.SetXattr(1, b"user." + bytes(251), b""),
    m.Register("n" * 256, ""), m.Reclaim(1, 1, "tape"),  # type: ignore[arg-type]
])
def test_decoding_refuses_fields_out_of_range(request_: m.Request) -> None:
    # (a header of more than 1 MiB is refused before this: some bounds hold in-process only)
    with pytest.raises(ProtocolError, match="invalid header"):
        HeaderDecoder(_ANY_REQUEST).decode(msgspec.msgpack.encode(request_))


def test_every_valid_request_still_decodes() -> None:
    for request in (m.Restore(U64 - 1, U64 - 1, record([b"r"], uid=2**32 - 1, gid=2**32 - 1), [U64 - 1]),
                    m.SetAttr(1, mode=0o177777, atime_ns=-(2**63), mtime_ns=2**63 - 1),
                    m.Heartbeat(1 << 50, 1 << 50, activity=m.Activity(storage_error="e" * 1000))):
        frame = encode_frame(FrameKind.REQUEST, 1, request)
        assert HeaderDecoder(_ANY_REQUEST).decode(frame[PREFIX_SIZE:]) == request
        check_request(request)


# A request is validated before it is applied ------------------------------------------------


def test_a_refused_rename_leaves_a_hidden_file_of_the_target_name(tmp_path: Path) -> None:
    """A rename over a name whose file is hidden (its node is down) used to remove that file
    before its checks; refused, it must leave everything as it was."""
    master = Master(tmp_path / "state")
    other = master.call(m.Register("b", "b:1"), 0).node
    master.call(m.Report([]), other)
    master.call(m.FinishRegistration(), other)
    d = master.call(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0))
    sub = master.call(m.MkDir(d.ino, b"sub", 0o755, 0, 0))
    opened = master.call(m.Create(sub.ino, b"hidden", 0o644, 0, 0, other, True), other)
    master.call(m.Seal(opened.version, 3, 1, [1]), other)
    master.call(m.Release(opened.version, True), other)
    for _ in range(40):  # 10 s of expiry passes without a heartbeat of b's: b is declared dead
        master.clock.advance(0.25)
        master.service.expire_nodes()
    master.state.save(master.service)
    assert master.call(m.Lookup(sub.ino, b"hidden")).attr is None  # its file is hidden
    master.refuses(m.Rename(ROOT_INO, b"d", sub.ino, b"hidden"), errno.EINVAL)  # into itself
    assert opened.version in master.service.objects.versions
    master.reloads_equal()
    master.state.close()


# Through a mount: what a user can ask for is refused with an errno, the daemon carries on ------


def test_times_out_of_range_through_a_mount(kvfs_dir: Path) -> None:
    path = kvfs_dir / "f"
    path.write_bytes(b"x")
    os.utime(path, ns=(-(10**18), -(10**18)))  # 1938: before the epoch is a time like any other
    assert path.stat().st_mtime_ns == -(10**18)
    year_2300 = 10_413_792_000 * 10**9  # past a signed 64-bit count of nanoseconds
    with pytest.raises(OSError) as raised:
        os.utime(path, ns=(year_2300, year_2300))
    assert raised.value.errno == errno.EINVAL
    assert path.stat().st_mtime_ns == -(10**18) and path.read_bytes() == b"x"
    with pytest.raises(OSError) as raised:
        os.mkdir(kvfs_dir / ("x" * 256))
    assert raised.value.errno == errno.ENAMETOOLONG
    assert sorted(os.listdir(kvfs_dir)) == ["f"]


def test_times_out_of_range_through_a_cluster_node_keep_its_connection(cluster: Cluster) -> None:
    """Times are bounded by the service, not at decoding: the node gets EINVAL back and keeps
    its connection to the master."""
    node = cluster.add_node("64M")
    path = node.path / "f"
    path.write_bytes(b"x")
    year_2300 = 10_413_792_000 * 10**9
    with pytest.raises(OSError) as raised:
        os.utime(path, ns=(year_2300, year_2300))
    assert raised.value.errno == errno.EINVAL
    (node.path / "after").mkdir()
    assert sorted(os.listdir(node.path)) == ["after", "f"]
    log = cluster.master.log_text()
    assert "closing connection" not in log and "disconnected" not in log, log[-3000:]


def test_a_refused_open_by_create_takes_no_kernel_reference(tmp_path: Path) -> None:
    """A create of a name another node is writing fails (EBUSY): the caller's kernel gets no
    inode, so the master must not count a reference from it (the inode could never go)."""
    master = Master(tmp_path / "state")
    other = master.call(m.Register("b", "b:1"), 0).node
    master.call(m.Report([]), other)
    master.call(m.FinishRegistration(), other)
    opened = master.call(m.Create(ROOT_INO, b"f", 0o644, 0, 0, other, True), other)
    master.refuses(m.Create(ROOT_INO, b"f", 0o644, 0, 0, master.node, False), errno.EBUSY)
    assert not master.service.ns.inodes[opened.attr.ino].refs & (1 << master.node)
    master.reloads_equal()
    master.state.close()



def test_a_time_the_wire_cannot_carry_is_einval_on_a_cluster_node(cluster: Cluster) -> None:
    """A time past 2**64-1 ns cannot even be encoded: the node's client refuses it with EINVAL
    before sending a byte, so its connection to the master stays in step and serves on."""
    node = cluster.add_node("64M")
    path = node.path / "f.bin"
    path.write_bytes(b"x")
    with pytest.raises(OSError) as refused:
        os.utime(path, ns=(2**70, 2**70))
    assert refused.value.errno == errno.EINVAL
    os.utime(path, ns=(10**18, 10**18))
    assert os.stat(path).st_mtime_ns == 10**18
    assert node.new_errors() == []
