"""The in-process test layer: a node's whole stack without a mount, sockets or real seconds.

One node: `KvfsOperations` (the FUSE adapter, its handlers called as the kernel would call
them) -> `Node` -> `TieredStore` over a real DRAM tier and a real SSD tier in tmp_path,
the master embedded. A cluster: one `MetadataService` shared by several such nodes through
in-process clients that each speak for their node (kvfs.cluster.embedded), name changes
pushed to them, their heartbeats and the master's expiry passes running as tasks, and
chunks moved between their stores by an in-memory peer transport.

Everything runs under trio's MockClock, so heartbeat deadlines, seal waits, peer budgets,
prefetch lifetimes and backpressure timeouts pass in virtual time. Each run ends with
`check_consistency`: the master's namespace against every node's store, SSD index and
DRAM accounting.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Iterator

import pytest
import trio
import trio.testing

from kvfs.checksum import chunk_checksum
from kvfs.cluster.embedded import EmbeddedCluster, EmbeddedMaster, EmbeddedMember, MasterClient
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.registry import LOCAL_NODE
from kvfs.config import MountConfig
from kvfs.disk.engine import AlignedIo, ThreadEngine
from kvfs.disk.probe import probe_io_uring
from kvfs.disk.tier import SsdTier
from kvfs.errors import StorageError
from kvfs.fuse.operations import KvfsOperations
from kvfs.net.rpc import MasterUnavailable
from kvfs.net.transport import PEER_SILENCE_S
from kvfs.node.membership import HEARTBEAT_S
from kvfs.node.service import Node
from kvfs.policy import make_policy
from kvfs.store.audit import audit
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.dram import DramTier
from kvfs.store.tiered import TieredStore, TierSettings
from kvfs.wire import messages as m

CHUNK = 64 << 10
DRAM = 16 * CHUNK  # 1 MiB
DISK = 64 * CHUNK  # 4 MiB
READ_BUFFERS = 32  # more than the prefetcher's reserve (16) plus a file
# While an io_uring request is in the kernel, the clock jumps to the next timer only once every
# task has been blocked this long in real time (`virtual_time`); otherwise it jumps at once.
AUTOJUMP_S = 0.2


def content(seed: int, size: int) -> bytes:
    prefix = f"v{seed}:".encode()
    return (prefix * (size // len(prefix) + 1))[:size]


async def until(condition: Callable[[], bool], within_s: float) -> None:
    """A bounded poll in the store's (virtual) time, in 20 steps."""
    deadline = trio.current_time() + within_s
    while not condition():
        assert trio.current_time() < deadline, "the condition did not come true in time"
        await trio.sleep(within_s / 20)


@pytest.fixture(params=["threads", "io_uring"])
def engine_kind(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "io_uring":
        reason = probe_io_uring(tmp_path)
        if reason is not None:
            pytest.skip(f"io_uring: {reason}")
    return request.param


def make_engine(kind: str) -> AlignedIo:
    if kind == "threads":
        return ThreadEngine()
    from kvfs.disk.engine import UringEngine
    return UringEngine()


def fail_ssd_writes(store: TieredStore) -> Callable[[], None]:
    """Makes the SSD's segment refuse writes (EBADF: opened read-only); returns the repair."""
    assert store.ssd is not None
    segments = store.ssd.segments
    writable = segments.fds[0]
    segments.fds[0] = os.open(store.ssd.directory / "segments" / "segment-00000.dat", os.O_RDONLY)

    def repair() -> None:
        os.close(segments.fds[0])
        segments.fds[0] = writable
    return repair


@contextlib.contextmanager
def virtual_time() -> Iterator[trio.testing.MockClock]:
    """A MockClock that jumps to the next timer as soon as every task waits, but not past
    I/O in flight outside the event loop: never while a worker thread runs (an SSD request
    of the threads engine, an index update), and only after AUTOJUMP_S of real idleness
    while an io_uring request is in the kernel (whose rare retry paths sleep on a timer).
    While the context lasts, `trio.to_thread.run_sync` and the io_uring engine's requests
    are counted."""
    from kvfs.disk.engine import UringEngine

    clock = trio.testing.MockClock(autojump_threshold=0)
    in_flight = {"threads": 0, "kernel": 0}

    def counted(kind: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            in_flight[kind] += 1
            clock.autojump_threshold = math.inf if in_flight["threads"] else AUTOJUMP_S
            try:
                return await call(*args, **kwargs)
            finally:
                in_flight[kind] -= 1
                clock.autojump_threshold = (math.inf if in_flight["threads"] else
                                            AUTOJUMP_S if in_flight["kernel"] else 0)
        return wrapper

    run_sync, submit = trio.to_thread.run_sync, UringEngine._submit
    trio.to_thread.run_sync = counted("threads", run_sync)  # type: ignore[assignment]
    UringEngine._submit = counted("kernel", submit)  # type: ignore[method-assign]
    try:
        yield clock
    finally:
        trio.to_thread.run_sync = run_sync  # type: ignore[assignment]
        UringEngine._submit = submit  # type: ignore[method-assign]


def run_virtual(main: Callable[[], Awaitable[None]]) -> None:
    """Runs `main` in virtual time (`virtual_time`)."""
    with virtual_time() as clock:
        trio.run(main, clock=clock)


class TrioClock:
    """`kvfs.clock.Clock` read from trio's clock (a MockClock in these tests)."""

    def wall_ns(self) -> int:
        return 1_700_000_000 * 10**9 + int(trio.current_time() * 1e9)

    def monotonic(self) -> float:
        return trio.current_time()


@dataclass(frozen=True)
class Context:
    """The caller a request comes from: what handlers read of pyfuse3.RequestContext (whose
    fields only the kernel's request can set)."""

    uid: int = 0
    gid: int = 0
    pid: int = 1
    umask: int = 0o022


ROOT = Context()


@dataclass(frozen=True)
class Fields:
    """Which attributes a SETATTR changes (pyfuse3.SetattrFields, likewise set by the kernel only)."""

    update_size: bool = False
    update_mode: bool = False
    update_uid: bool = False
    update_gid: bool = False
    update_atime: bool = False
    update_mtime: bool = False


class Kernel:
    """What a node's daemon tells the kernel behind its back, recorded: names to drop from
    its dentry cache (only those it references, as the daemon does), attributes to re-read.
    It also keeps the inodes the harness's requests got entries for, to forget them all as
    a kernel dropping its caches does (`drop_caches`)."""

    def __init__(self) -> None:
        self.operations: KvfsOperations | None = None
        self.invalidated_entries: list[tuple[int, bytes]] = []
        self.invalidated_attrs: list[int] = []
        self.referenced: set[int] = set()

    def drop_caches(self) -> None:
        """FORGET of every inode referenced through the harness (echo 2 > drop_caches, with no
        file open): unlinked or replaced files the kernel still showed can go now."""
        assert self.operations is not None
        self.operations.forget([(ino, 1 << 30) for ino in self.referenced])
        self.referenced.clear()

    def forget_entries(self, entries: list[tuple[int, bytes, int]]) -> None:
        assert self.operations is not None
        self.invalidated_entries += [(parent, name) for parent, name, ino in entries
                                     if self.operations.lookups.known(ino)]

    async def invalidate_attrs(self, ino: int) -> None:
        self.invalidated_attrs.append(ino)


# Moving chunks between nodes ------------------------------------------------------------


class PeerNetwork:
    """The nodes' peer servers, by address: whose store serves which address, and which
    owners are frozen (alive, but sending nothing, as under SIGSTOP)."""

    def __init__(self) -> None:
        self.stores: dict[str, TieredStore] = {}
        self._thawed: dict[str, trio.Event] = {}

    def freeze(self, address: str) -> None:
        self._thawed.setdefault(address, trio.Event())

    def thaw(self, address: str) -> None:
        event = self._thawed.pop(address, None)
        if event is not None:
            event.set()

    async def wait_thawed(self, address: str) -> bool:
        """False if the owner stayed silent for PEER_SILENCE_S (the transport's limit)."""
        event = self._thawed.get(address)
        if event is None:
            return True
        with trio.move_on_after(PEER_SILENCE_S):
            await event.wait()
            return True
        return False


class InMemoryTransport:
    """A node's `kvfs.net.transport.Transport` reading chunks straight from the owner's store
    (its `serve_chunks`, what the peer server sends from), with the TCP transport's errnos:
    ENOENT when nobody serves the address or the owner lacks the version, EIO when the owner
    stays silent for PEER_SILENCE_S or a chunk fails its checksum."""

    kind = "memory"

    def __init__(self, network: PeerNetwork) -> None:
        self.network = network
        self.fetched_bytes = 0
        self.fetches: list[tuple[str, int, int, int]] = []  # (address, version, first chunk, count)

    async def fetch(self, address: str, version: int, first: int, targets: list[memoryview], lengths: list[int],
                    checksums: list[int], on_chunk: Callable[[int], None],
                    on_answer: Callable[[], None] = lambda: None) -> None:
        self.fetches.append((address, version, first, len(targets)))
        owner = self.network.stores.get(address)
        if owner is None:
            raise StorageError(errno.ENOENT, f"version {version}: peer {address} is unreachable (nobody there)")
        if not await self.network.wait_thawed(address):
            raise StorageError(errno.EIO, f"version {version}: peer {address} went silent for "
                                          f"{PEER_SILENCE_S:g} s")
        answered = False

        async def send(index: int, data: memoryview | bytes) -> None:
            nonlocal answered
            if not answered:
                answered = True
                on_answer()
            target = targets[index - first]
            if len(data) != lengths[index - first]:
                raise StorageError(errno.EIO, f"version {version}: chunk {index} is {len(data)} bytes, "
                                              f"not {lengths[index - first]}")
            target[:len(data)] = data
            if chunk_checksum(target[:len(data)]) != checksums[index]:
                raise StorageError(errno.EIO, f"version {version}: chunk {index} from {address} fails its checksum")
            self.fetched_bytes += len(data)
            on_chunk(index)

        await owner.serve_chunks(version, first, len(targets), send)

    def versions_fetched(self) -> list[int]:
        return [version for _, version, first, _ in self.fetches if first == 0]


# A node under test ------------------------------------------------------------------------


@dataclass(eq=False)
class Member:
    """One node: its FUSE handlers, file service and store, and what its kernel was told."""

    name: str
    address: str
    ops: KvfsOperations
    node: Node
    store: TieredStore
    link: MasterClient
    kernel: Kernel
    transport: InMemoryTransport | None = None
    client: MasterClient | None = None  # the registered client under `link` (a cluster node)
    heartbeating: bool = True
    rejoined: int = 0  # registrations after the master declared it dead

    @property
    def node_id(self) -> int:
        return self.node.node_id

    async def join(self) -> None:
        """Registers the node through its client, as a link does on every new connection."""
        assert self.client is not None, "a node with an embedded master does not register"
        await self.node.membership.join(self.client, self.name, self.address)


def build_member(name: str, link: MasterClient, store: TieredStore, mountpoint: Path,
                 transport: InMemoryTransport | None = None, address: str = "",
                 unsealed_per_user: int = 0, client: MasterClient | None = None) -> Member:
    """A node's parts wired as kvfs.daemons.node wires them."""
    kernel = Kernel()
    node = Node(link, store, TrioClock(), forget_entries=kernel.forget_entries, transport=transport,
                invalidate_attrs=kernel.invalidate_attrs if transport is not None else None,
                unsealed_per_user=unsealed_per_user)
    ops = KvfsOperations(node, MountConfig(str(mountpoint), 16 << 20))
    kernel.operations = ops
    return Member(name, address, ops, node, store, link, kernel, transport, client)


# The kernel's requests ---------------------------------------------------------------------


async def write_file(member: Member, name: bytes, data: bytes, parent: int = ROOT_INO, ctx: Context = ROOT,
                     rename_to: bytes | None = None) -> int:
    """open(O_CREAT|O_EXCL), write() in chunk-sized requests, close() (RELEASE), and a
    rename to publish it when `rename_to` is given; returns the inode."""
    ops = member.ops
    info, entry = await ops.create(parent, name, stat.S_IFREG | 0o666, os.O_WRONLY | os.O_CREAT | os.O_EXCL, ctx)
    member.kernel.referenced.add(entry.st_ino)
    try:
        for start in range(0, len(data), CHUNK):
            assert await ops.write(info.fh, start, data[start:start + CHUNK]) == len(data[start:start + CHUNK])
    finally:  # close() after a failed write too
        await ops.release(info.fh)
    if rename_to is not None:
        await ops.rename(parent, name, parent, rename_to, 0, ctx)
    return entry.st_ino


async def read_file(member: Member, ino: int, ctx: Context = ROOT) -> bytes:
    """open(O_RDONLY), read() to the end in chunk-sized requests, close()."""
    ops = member.ops
    info = await ops.open(ino, os.O_RDONLY, ctx)
    try:
        data = b""
        while True:
            piece = bytes(await ops.read(info.fh, len(data), CHUNK))
            data += piece
            if len(piece) < CHUNK:
                return data
    finally:
        await ops.release(info.fh)


async def version_of(member: Member, ino: int) -> int:
    """The version a file's name shows now (GETATTR)."""
    return (await member.node.getattr(ino)).version


async def lookup(member: Member, name: bytes, parent: int = ROOT_INO, ctx: Context = ROOT) -> int:
    """The inode a LOOKUP finds, 0 for a negative entry."""
    ino = (await member.ops.lookup(parent, name, ctx)).st_ino
    if ino:
        member.kernel.referenced.add(ino)
    return ino


# The consistency check ---------------------------------------------------------------------


def path_of(service: MetadataService, ino: int) -> list[bytes]:
    """A linked inode's path from the root, as an SSD index record names it."""
    path = []
    inode = service.ns.inodes[ino]
    while inode.ino != ROOT_INO:
        path.append(inode.name)
        inode = service.ns.inodes[inode.parent]
    return path[::-1]


def check_consistency(service: MetadataService, members: Iterable[Member]) -> None:
    """At a quiet moment (nothing read, offloaded or promoted; open writers allowed), the
    master's namespace against each node's store: every sealed file of a node is in its DRAM
    or on its SSD with the master's size and checksums, saved exactly when the master thinks
    so, under its current path in the SSD index; a node stores nothing the master does not
    place on it (no orphan versions or extents); with nothing open, no copy, read buffer or
    quota charge is held; and the store's own books agree with its tiers, its index and the
    bytes both allocators account for (kvfs.store.audit: the DRAM arena's bytes used are the
    blocks of the versions it holds, each sealed, being written or in use)."""
    problems: list[str] = []
    linked = {inode.version: inode for inode in service.ns.inodes.values()
              if inode.is_file and inode.linked and inode.version}
    for member in members:
        store, node, who = member.store, member.node, f"node {member.node_id} ({member.name})"
        writing = {held.version for held in node.writing()}
        opens = sum(count for _, _, count in node.open_counts())
        problems += [f"{who}: {problem}" for problem in audit(store, writing)]
        placed = {version.version: version for version in service.objects.versions.values()
                  if version.node == member.node_id}
        books = store.residency
        held = set(books) | set(store.dram.versions()) | set(store.ssd.extents if store.ssd is not None else ())
        record = service.registry.nodes.get(member.node_id)
        on_their_way = set(record.outbox_dropped) if record is not None else set()  # the next heartbeat's drops
        for version in sorted(held - set(placed) - on_their_way):
            problems.append(f"{who}: stores version {version}, which the master does not place there")
        for version in sorted(writing - set(placed)):
            problems.append(f"{who}: writes version {version}, which the master does not know")
        if store.ssd is not None and books.removals():
            problems.append(f"{who}: SSD removals still pending: {books.removals()}")
        records = store.disk_records()
        for number, version in sorted(placed.items()):
            if not version.sealed:
                if number not in writing or number not in store.dram:
                    problems.append(f"{who}: version {number} is being written but not here")
                continue
            entry = books.entry(number)
            if entry is None or not (entry.in_dram or entry.on_ssd):
                if version.current:
                    problems.append(f"{who}: sealed version {number} is on no tier")
                continue
            if (entry.size, entry.checksums) != (version.size, version.checksums):
                problems.append(f"{who}: version {number}: size or checksums differ from the master's")
            inode = linked.get(number)
            if inode is None:
                continue
            if version.on_disk != store.is_saved(number):
                problems.append(f"{who}: version {number}: the master thinks saved {version.on_disk}, "
                                f"the store {store.is_saved(number)}")
            record = records.get(number)
            if store.is_saved(number) and (record is None or record.file.path != path_of(service, inode.ino)):
                problems.append(f"{who}: version {number}: the SSD index names it "
                                f"{record.file.path if record else None}, not {path_of(service, inode.ino)}")
        # With no file open, nothing holds a DRAM copy, a read buffer or a quota charge.
        if not opens:
            if books.busy_versions():
                problems.append(f"{who}: copies still in use: {sorted(books.busy_versions())}")
            free, total = store.read_buffers.available, len(store.read_buffers.view) // store.chunk_size
            prefetching = node.prefetches is not None and node.prefetches.started > (node.prefetches.claimed
                                                                                   + node.prefetches.wasted)
            if free != total and not prefetching:
                problems.append(f"{who}: {total - free} read buffers not given back")
            if node.unsealed.by_uid:
                problems.append(f"{who}: unsealed bytes still charged: {node.unsealed.by_uid}")
        if len(member.ops.files) != opens:
            problems.append(f"{who}: {len(member.ops.files)} FUSE handles, {opens} open files")
    assert problems == [], "\n".join(problems)


async def quiesce(members: Iterable[Member]) -> None:
    """Waits for every store's offloads and removals (a quiet moment for the check)."""
    for member in members:
        if member.store.ssd is not None:
            await member.store.wait_offloaded()
            await member.store.flush_removals_now()


# One node, the master embedded ------------------------------------------------------------

MountScenario = Callable[[Member], Awaitable[None]]


def run_mount(tmp_path: Path, engine_kind: str, scenario: MountScenario, settings: TierSettings = TierSettings(),
              dram: int = DRAM, disk: int = DISK, master: MasterSettings = MasterSettings(),
              unsealed_per_user: int = 0) -> None:
    """Runs `scenario` against one node's FUSE handlers over a store with both tiers (an SSD
    tier of `disk` bytes in tmp_path; none when 0), the master embedded, under a MockClock;
    then checks consistency."""

    async def main() -> None:
        engine = make_engine(engine_kind) if disk else None
        ssd = SsdTier(tmp_path / "disk", disk, engine, CHUNK, direct_io=True) if engine is not None else None
        try:
            async with trio.open_nursery() as nursery:
                if engine is not None:
                    await nursery.start(engine.run)
                store = TieredStore(DramTier(dram, CHUNK), ssd, settings, ReadBufferPool(READ_BUFFERS, CHUNK),
                                    clock=trio.current_time)
                service = MetadataService(TrioClock(), make_policy(settings.eviction_policy), master)
                member = build_member("local", EmbeddedMaster(service), store, tmp_path / "mnt",
                                      unsealed_per_user=unsealed_per_user)
                assert member.node_id == LOCAL_NODE
                nursery.start_soon(store.run)
                nursery.start_soon(member.ops.run_forgetter)
                await scenario(member)
                await quiesce([member])
                if ssd is not None and settings.offload == "eager" and not store.faults.failing("offload"):
                    assert store.unsaved() == (0, 0)  # every sealed file is saved by now
                check_consistency(service, [member])
                nursery.cancel_scope.cancel()
        finally:
            if ssd is not None:
                ssd.close()
            if engine is not None:
                engine.close()

    run_virtual(main)


# A master and nodes in one process ---------------------------------------------------------


class Cluster:
    """A master and its nodes connected in memory, with the timers their daemons run: each
    node's heartbeat every HEARTBEAT_S (registering again when the master no longer knows
    it), the master's expiry pass every `expire_interval_s`, and pushes of name changes
    after each request. A node's link can be cut and restored (`Link`)."""

    def __init__(self, service: MetadataService, tmp_path: Path, nursery: trio.Nursery) -> None:
        self.service = service
        self.hub = EmbeddedCluster(service)
        self.network = PeerNetwork()
        self.tmp_path = tmp_path
        self.nursery = nursery
        self.members: list[Member] = []
        self.declared_dead: list[tuple[float, int]] = []  # (when, node id)
        self._running = trio.Event()  # cleared while the master stalls
        self._running.set()
        self._pushes = trio.Event()
        self.hub.wake = lambda: self._pushes.set()  # a push follows the reply, as over the network
        self.pushing = trio.Event()  # cleared: pushes wait (a slow push connection, a busy pusher)
        self.pushing.set()
        nursery.start_soon(self._push_forever)
        nursery.start_soon(self._expire_forever)

    async def add(self, name: str, dram: int = DRAM) -> Member:
        """A node with a DRAM tier only, registered (as `kvfs node` does at start)."""
        address = f"{name}.test:7070"
        store = TieredStore(DramTier(dram, CHUNK), None, TierSettings(), ReadBufferPool(READ_BUFFERS, CHUNK),
                            clock=trio.current_time)
        link = Link(self, self.hub.connect())
        transport = InMemoryTransport(self.network)
        member = build_member(name, link, store, self.tmp_path / name, transport, address, client=link.client)
        link.client.on_notify = member.node.membership.names_changed
        self.nursery.start_soon(store.run)
        self.nursery.start_soon(member.ops.run_forgetter)
        self.network.stores[address] = store
        member.node.membership.adopt_disk()
        await member.join()
        self.nursery.start_soon(self._heartbeat_forever, member)
        self.members.append(member)
        return member

    async def running(self) -> None:
        await self._running.wait()

    async def stall(self, seconds: float, expire_first: bool = False) -> None:
        """The master stops for `seconds` (SIGSTOP, a slow save): no request is answered and no
        expiry pass runs meanwhile; requests sent meanwhile are answered after it, after one
        expiry pass if `expire_first` (its timer fires before it reads the queued heartbeats)."""
        self._running = trio.Event()
        await trio.sleep(seconds)
        if expire_first:
            self._expire()
        self._running.set()

    def is_live(self, member: Member) -> bool:
        return self.service.registry.is_live(member.node_id)

    async def _push_forever(self) -> None:
        while True:
            await self._pushes.wait()
            await self.pushing.wait()
            self._pushes = trio.Event()
            self.hub.push()

    async def _expire_forever(self) -> None:
        while True:
            await trio.sleep(self.service.settings.expire_interval_s)
            await self.running()
            self._expire()

    def _expire(self) -> None:
        for node_id in self.hub.expire_nodes():
            self.declared_dead.append((trio.current_time(), node_id))

    async def _heartbeat_forever(self, member: Member) -> None:
        while True:
            await trio.sleep(HEARTBEAT_S)
            if member.heartbeating and not await member.node.membership.heartbeat():
                await self.running()
                await member.join()
                member.rejoined += 1


class Link:
    """A node's link to the in-process master, behaving as kvfs.net.link.MasterLink does:
    requests wait while the master stalls; while the link is cut they wait up to `wait_s`
    (the node's --master-wait) for it to come back, then fail with MasterUnavailable; a
    link that comes back registers its node again before any other request goes through."""

    def __init__(self, cluster: Cluster, client: EmbeddedMember, wait_s: float = 10.0) -> None:
        self.cluster = cluster
        self.client = client
        self.wait_s = wait_s
        self._up = trio.Event()
        self._up.set()

    @property
    def connected(self) -> bool:
        return self._up.is_set()

    def cut(self) -> None:
        self._up = trio.Event()

    async def restore(self, member: Member) -> None:
        await self.cluster.running()
        await member.join()
        self._up.set()

    async def call(self, request: m.Request, wait_s: float | None = None) -> object:
        timeout = self.wait_s if wait_s is None else wait_s
        if not self._up.is_set():
            with trio.move_on_after(timeout):
                await self._up.wait()
            if not self._up.is_set():
                raise MasterUnavailable("the link to the master is cut")
        await self.cluster.running()
        answer = await self.client.call(request, wait_s)
        await trio.lowlevel.checkpoint()  # the pushes the request queued go out with its reply, as over the network
        return answer


ClusterScenario = Callable[[Cluster], Awaitable[None]]


def run_cluster(tmp_path: Path, scenario: ClusterScenario, nodes: tuple[str, ...] = ("a", "b"),
                dram: int = DRAM, master: MasterSettings = MasterSettings(cluster=True)) -> None:
    """Runs `scenario` against a master and `nodes` (DRAM tiers only) in one process under a
    MockClock that jumps at once (nothing runs outside the event loop); then checks
    consistency across all of them."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            service = MetadataService(TrioClock(), make_policy("reuse"), master)
            cluster = Cluster(service, tmp_path, nursery)
            for name in nodes:
                await cluster.add(name, dram)
            await scenario(cluster)
            await trio.sleep(HEARTBEAT_S * 2)  # the last drops and pushes delivered
            check_consistency(service, cluster.members)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
