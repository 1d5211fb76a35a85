"""The RDMA transport: a node READs chunks straight from the owner's DRAM arena.

Control goes over the owner's peer server (the same authenticated TCP port as
the TCP transport); data goes by one-sided RDMA READ into the reader's
registered read buffers, with no owner CPU and no copy in Python:

1. `RdmaConnect`: the two nodes connect a pair of RC queue pairs; the owner
   grants a small probe window, and the reader READs it and checks its checksum
   before it trusts the path (`transport = auto` uses RDMA only after this).
2. `Locate(version, chunks)`: the owner pins the version's DRAM copy and binds a
   type 2 memory window per chunk on that connection's queue pair: an rkey that
   only this peer can use, for exactly that chunk. The arena's own registration
   grants no remote access.
3. The reader READs each chunk and verifies its checksum, then sends `Unlease`:
   the owner invalidates the windows, then unpins, so the memory can be reused
   only once no rkey reaches it. A lease not returned within `LEASE_TTL_S` is
   revoked the same way.

Whatever the RDMA path cannot do falls back to TCP for that fetch, counted by
reason: the owner has no RDMA, the version is only on its SSD, a READ fails
(revoked rkey, dead peer, timeout), a checksum does not match, or the target
buffer is not registered memory.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import msgspec
import trio

from kvfs.checksum import chunk_checksum
from kvfs.wire.auth import AuthError
from kvfs.wire.protocol import ErrorReply, FrameKind, HeaderDecoder, ProtocolError
from kvfs.wire.rdma_messages import (NOT_IN_DRAM, Locate, Located, RdmaAccepted, RdmaConnect, RevokeForTest,
                                         Unlease)
from kvfs.cluster.authority import PEER_ROLE
from kvfs.net.handshake import connect
from kvfs.net.streams import FrameStream
from kvfs.net.transport import MeasuredTransport, TcpTransport
from kvfs.net.verbs import (Endpoint, QueuePair, RdmaDevice, RdmaError, RdmaUnavailable, Window, buffer_address,
                                probe)
from kvfs.config import split_address
from kvfs.errors import ConfigError, KvfsError, StorageError
from kvfs.security.credentials import Tls
from kvfs.store.buffers import ReadBufferPool

log = logging.getLogger(__name__)

LEASE_TTL_S = 10.0  # a reader holds chunks this long at most; then its windows are revoked
PROBE_SIZE = 4096
RETRY_RDMA_AFTER_S = 30.0  # a peer whose RDMA failed is fetched over TCP this long
CONTROL_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0  # the control connection, handshake included


# The owner's side ------------------------------------------------------------------------


@dataclass
class _Lease:
    version: int
    windows: list[Window]
    started: float


class RdmaExporter:
    """Lets peers READ this node's DRAM arena through memory windows (one per peer server)."""

    def __init__(self, device: RdmaDevice, store: Any) -> None:
        self.device = device
        self.store = store
        self.arena = device.register(store.dram.arena.view, windows=True)
        self._probe_map = mmap.mmap(-1, PROBE_SIZE)
        self._probe_map[:] = msgspec.json.encode({"kvfs": "rdma probe", "gid": device.gid}).ljust(PROBE_SIZE, b".")
        self.probe = device.register(memoryview(self._probe_map), windows=True)
        self.probe_checksum = chunk_checksum(self._probe_map)
        self.sessions: set[RdmaSession] = set()
        self.granted = 0
        self.revoked = 0

    async def accept(self, request: RdmaConnect) -> tuple[RdmaSession, RdmaAccepted]:
        qp = self.device.create_queue_pair()
        try:
            qp.connect(Endpoint(request.qp_num, request.psn, request.gid))
            probe = await self.device.grant(qp, self.probe, self.probe.address, PROBE_SIZE)
        except BaseException:
            qp.close()
            raise
        session = RdmaSession(self, qp, probe)
        self.sessions.add(session)
        mine = qp.endpoint()
        return session, RdmaAccepted(mine.qp_num, mine.psn, mine.gid, self.probe.address, probe.rkey,
                                     self.probe_checksum)

    async def handle(self, session: RdmaSession | None, request: Any,
                     reply: Callable[[FrameKind, Any], Awaitable[None]]) -> RdmaSession | None:
        """One RDMA control request on a peer connection; returns the connection's session."""
        if isinstance(request, RdmaConnect):
            if session is not None:
                await session.close()
            try:
                session, accepted = await self.accept(request)
            except RdmaError as error:
                await reply(FrameKind.ERROR, ErrorReply(errno.EIO, f"rdma connect failed: {error}"))
                return None
            await reply(FrameKind.RESPONSE, accepted)
            return session
        if session is None:
            if not isinstance(request, Unlease):  # one-way: an answer would be read as the next call's
                await reply(FrameKind.ERROR, ErrorReply(errno.ENOTCONN, "no RDMA connection on this peer connection"))
            return session
        if isinstance(request, Locate):
            try:
                located = await session.locate(request)
            except (KvfsError, RdmaError) as error:
                code = error.errno if isinstance(error, KvfsError) else errno.EIO
                await reply(FrameKind.ERROR, ErrorReply(code, str(error)))
                return session
            await reply(FrameKind.RESPONSE, located)
        elif isinstance(request, Unlease):
            await session.unlease(request.lease)  # no answer: the reader does not wait for it
        elif isinstance(request, RevokeForTest):
            await session.revoke_all()
            await reply(FrameKind.RESPONSE, RevokeForTest())
        return session

    async def close_session(self, session: RdmaSession) -> None:
        await session.close()

    async def expire_leases(self) -> None:
        """Revokes leases not returned in time (a background task)."""
        while True:
            await trio.sleep(1.0)
            deadline = time.monotonic() - LEASE_TTL_S
            for session in list(self.sessions):
                for lease_id, lease in list(session.leases.items()):
                    if lease.started < deadline:
                        log.warning("rdma: lease %d of version %d not returned in %.0f s; revoking its rkeys",
                                    lease_id, lease.version, LEASE_TTL_S)
                        await session.unlease(lease_id)


@dataclass(eq=False)
class RdmaSession:
    """One peer connection's RDMA state on the owner: its queue pair and its leases."""

    exporter: RdmaExporter
    qp: QueuePair
    probe: Window
    leases: dict[int, _Lease] = field(default_factory=dict)
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    async def locate(self, request: Locate) -> Located:
        store, device = self.exporter.store, self.exporter.device
        found = store.lease_dram(request.version, request.first, request.count)
        if found is None:
            raise StorageError(NOT_IN_DRAM, f"version {request.version} is not in DRAM here")
        offsets, lengths = found
        lease = _Lease(request.version, [], time.monotonic())
        lease_id = next(self._ids)
        self.leases[lease_id] = lease  # from now on unlease() unpins, whatever happens below
        addresses, rkeys = [], []
        try:
            for offset, length in zip(offsets, lengths):
                if offset is None:
                    addresses.append(-1)
                    rkeys.append(0)
                    continue
                address = self.exporter.arena.address + offset
                window = await device.grant(self.qp, self.exporter.arena, address, length)
                lease.windows.append(window)
                addresses.append(address)
                rkeys.append(window.rkey)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self.unlease(lease_id)
            raise
        self.exporter.granted += len(lease.windows)
        return Located(lease_id, addresses, rkeys, lengths)

    async def unlease(self, lease_id: int) -> None:
        """Invalidates the lease's windows, then unpins its version (in that order)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return
        try:
            for window in lease.windows:
                await self._revoke(window)
        finally:
            self.exporter.store.end_lease(lease.version)

    async def _revoke(self, window: Window) -> None:
        if not await self.exporter.device.revoke(self.qp, window):
            self.qp.broken = True  # in error: nothing passes through it; it goes at close
        self.exporter.revoked += 1

    async def revoke_all(self) -> None:
        for lease_id in list(self.leases):
            await self.unlease(lease_id)

    async def close(self) -> None:
        with trio.CancelScope(shield=True):
            await self.revoke_all()
            await self._revoke(self.probe)
        self.qp.close()  # after its windows (see RdmaDevice.revoke)
        self.exporter.sessions.discard(self)


# The reader's side -----------------------------------------------------------------------


class _Refused(Exception):
    """The owner cannot serve this over RDMA (no RDMA there, or the version is not in DRAM)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


_REPLIES = HeaderDecoder(RdmaAccepted | Located | RevokeForTest)  # type: ignore[operator]
_ERRORS = HeaderDecoder(ErrorReply)


class _RdmaPeer:
    """The reader's RDMA connection to one owner: a control stream and a queue pair."""

    def __init__(self, address: str, frames: FrameStream, qp: QueuePair) -> None:
        self.address = address
        self.frames = frames
        self.qp = qp
        self.lock = trio.Lock()
        self._ids = itertools.count(1)

    async def call(self, request: Any) -> Any:
        async with self.lock:
            request_id = next(self._ids)
            with trio.fail_after(CONTROL_TIMEOUT_S):
                await self.frames.send(FrameKind.REQUEST, request_id, request)
                frame = await self.frames.receive()
            prefix, header = frame.prefix, frame.header
            if prefix.request_id != request_id:
                raise ProtocolError(f"reply to request {prefix.request_id}, expected {request_id}")
            if prefix.kind == FrameKind.ERROR:
                error = _ERRORS.decode(header)
                raise StorageError(error.errno, f"peer {self.address}: {error.message}")
            return _REPLIES.decode(header)

    async def send_only(self, request: Any) -> None:
        async with self.lock:
            await self.frames.send(FrameKind.REQUEST, next(self._ids), request)

    async def aclose(self) -> None:
        self.qp.close()
        await self.frames.aclose()


class RdmaTransport(MeasuredTransport):
    """Fetches chunks with RDMA READs where the owner supports it, over TCP otherwise."""

    kind = "rdma"

    def __init__(self, device: RdmaDevice, tls: Tls, tcp: TcpTransport, read_buffers: ReadBufferPool) -> None:
        super().__init__()
        self.device = device
        self.tls = tls
        self.tcp = tcp
        self.read_buffers = read_buffers
        self.landing = device.register(read_buffers.view)
        self._probe_map = mmap.mmap(-1, PROBE_SIZE)
        self._probe_landing = device.register(memoryview(self._probe_map))
        self._peers: dict[str, _RdmaPeer] = {}
        self._connecting: dict[str, trio.Lock] = {}
        self._tcp_until: dict[str, float] = {}  # peers fetched over TCP for now, until then
        self.rdma_bytes = 0
        self.rdma_reads = 0
        self.errors: dict[str, int] = {}
        self.fallbacks: dict[str, int] = {}
        # Tests only: awaited between the owner's grant and the READs (to revoke in between).
        self.after_locate: Callable[[str], Awaitable[None]] | None = None

    # What the node and the metrics read, as for TcpTransport.
    @property
    def fetched_bytes(self) -> int:
        return self.tcp.fetched_bytes + self.rdma_bytes

    @property
    def checksum_failures(self) -> int:
        return self.tcp.checksum_failures + self.fallbacks.get("checksum", 0)

    def _count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1

    async def _fetch(self, address: str, version: int, first: int, targets: list[memoryview], lengths: list[int],
                     checksums: list[int], on_chunk: Callable[[int], None], on_answer: Callable[[], None],
                     on_piece: Callable[[int, int], None] = lambda index, verified: None) -> None:
        delivered: set[int] = set()
        answered = False

        def deliver(index: int) -> None:
            if index not in delivered:
                delivered.add(index)
                on_chunk(index)

        def answer() -> None:
            nonlocal answered
            if not answered:
                answered = True
                on_answer()

        try:
            if not all(target.obj is self.read_buffers.view.obj for target in targets):
                raise _Refused("unregistered_buffer", "a target buffer is not registered memory")
            peer = await self._peer(address)
            await self._read_run(peer, version, first, targets, lengths, checksums, deliver, answer)
            return
        except _Refused as refused:
            self._count(self.fallbacks, refused.reason)
            log.debug("rdma: version %d from %s over TCP: %s", version, address, refused)
        except (RdmaError, OSError, EOFError, ProtocolError, AuthError, trio.TooSlowError,
                trio.BrokenResourceError, trio.ClosedResourceError) as error:
            reason = error.status if isinstance(error, RdmaError) else "control"
            self._count(self.errors, reason)
            self._count(self.fallbacks, reason)
            log.warning("rdma: fetching version %d from %s failed (%s); over TCP instead", version, address, error)
            await self._drop_peer(address)
        missing = [first + i for i in range(len(targets)) if first + i not in delivered]
        if not missing:
            return
        start = missing[0] - first  # one TCP run from the first chunk not delivered
        await self.tcp.fetch(address, version, first + start, targets[start:], lengths[start:], checksums,
                             deliver, answer, on_piece)

    async def _read_run(self, peer: _RdmaPeer, version: int, first: int, targets: list[memoryview],
                        lengths: list[int], checksums: list[int], deliver: Callable[[int], None],
                        answer: Callable[[], None]) -> None:
        try:
            located = await peer.call(Locate(version, first, len(targets)))
        except StorageError as error:
            if error.errno == NOT_IN_DRAM:
                raise _Refused("not_in_dram", str(error)) from None
            raise
        answer()
        if self.after_locate is not None:
            await self.after_locate(peer.address)
        # Every READ runs to its completion (none is cancelled while it may still write into
        # its target); the chunks that failed are then fetched over TCP by the caller.
        failures: list[Exception] = []

        async def read_one(offset: int) -> None:
            try:
                await self._read_chunk(peer, located, offset, first + offset, targets[offset], lengths[offset],
                                       checksums, deliver)
            except (RdmaError, _Refused, ProtocolError) as error:
                failures.append(error)

        try:
            async with trio.open_nursery() as nursery:
                for offset in range(len(targets)):
                    nursery.start_soon(read_one, offset)
            if failures:  # the cause first (the other READs of a broken queue pair are only flushed)
                broken = [f for f in failures if isinstance(f, RdmaError)]
                raise next((f for f in broken if f.status != "wr_flush_err"), (broken or failures)[0])
        finally:
            if not peer.qp.broken:
                with trio.CancelScope(shield=True):
                    try:
                        await peer.send_only(Unlease(located.lease))
                    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                        pass  # the owner ends the lease when the connection goes

    async def _read_chunk(self, peer: _RdmaPeer, located: Located, offset: int, index: int, target: memoryview,
                          length: int, checksums: list[int], deliver: Callable[[int], None]) -> None:
        if located.lengths[offset] != length:
            raise ProtocolError(f"chunk {index} is {located.lengths[offset]} bytes there, {length} expected")
        if located.addresses[offset] < 0:  # a hole
            target[:length] = bytes(length)
        else:
            await self.device.read(peer.qp, self.landing, buffer_address(target), length,
                                   located.addresses[offset], located.rkeys[offset])
            self.rdma_reads += 1
            self.rdma_bytes += length
        if index < len(checksums) and chunk_checksum(target[:length]) != checksums[index]:
            # Bytes of another block (a reused region) or damaged: never delivered; TCP redoes it.
            raise _Refused("checksum", f"chunk {index} read over RDMA fails its checksum")
        deliver(index)

    async def _peer(self, address: str) -> _RdmaPeer:
        if self._tcp_until.get(address, 0) > time.monotonic():
            raise _Refused("peer_without_rdma", f"{address} is fetched over TCP for now")
        peer = self._peers.get(address)
        if peer is not None and not peer.qp.broken:
            return peer
        lock = self._connecting.setdefault(address, trio.Lock())
        async with lock:
            peer = self._peers.get(address)
            if peer is not None and not peer.qp.broken:
                return peer
            try:
                peer = await self._connect(address)
            except _Refused:
                self._tcp_until[address] = time.monotonic() + RETRY_RDMA_AFTER_S
                raise
            self._peers[address] = peer
            return peer

    async def _connect(self, address: str) -> _RdmaPeer:
        host, port = split_address(address)
        with trio.fail_after(CONNECT_TIMEOUT_S):
            frames = await connect(host, port, self.tls, PEER_ROLE)
        try:
            qp = self.device.create_queue_pair()
        except BaseException:
            with trio.CancelScope(shield=True):
                await frames.aclose()
            raise
        peer = _RdmaPeer(address, frames, qp)
        try:
            mine = qp.endpoint()
            try:
                accepted = await peer.call(RdmaConnect(mine.qp_num, mine.psn, mine.gid))
            except StorageError as error:
                raise _Refused("peer_without_rdma", str(error)) from None
            qp.connect(Endpoint(accepted.qp_num, accepted.psn, accepted.gid))
            # The test READ: only a path that really moves the right bytes is used.
            landing = memoryview(self._probe_map)
            landing[:] = bytes(PROBE_SIZE)
            await self.device.read(qp, self._probe_landing, self._probe_landing.address, PROBE_SIZE,
                                   accepted.probe_address, accepted.probe_rkey)
            if chunk_checksum(landing) != accepted.probe_checksum:
                raise _Refused("probe_mismatch", f"the test READ from {address} returned other bytes")
        except BaseException as error:
            with trio.CancelScope(shield=True):
                await peer.aclose()
            if isinstance(error, RdmaError):
                raise _Refused("probe_failed", f"the test READ from {address} failed: {error}") from None
            raise
        log.info("rdma: connected to %s (queue pair %d to %d)", address, qp.qp_num, accepted.qp_num)
        return peer

    async def _drop_peer(self, address: str) -> None:
        peer = self._peers.pop(address, None)
        if peer is not None:
            with trio.CancelScope(shield=True):
                await peer.aclose()

    async def revoke_for_test(self, address: str) -> None:
        """Asks the owner to invalidate every window it granted this node (tests only)."""
        peer = await self._peer(address)
        await peer.call(RevokeForTest())

    async def aclose(self) -> None:
        for address in list(self._peers):
            await self._drop_peer(address)
        await self.tcp.aclose()


def open_rdma(mode: str, device_name: str | None = None) -> RdmaDevice | None:
    """The RDMA device a node uses under `transport = mode`, or None for TCP only. `rdma`
    without a usable device is a configuration error; `auto` says in one line why it uses TCP."""
    if mode == "tcp":
        log.info("transport tcp: chunks move over TCP")
        return None
    try:
        device = probe(device_name)
    except RdmaUnavailable as reason:
        if mode == "rdma":
            raise ConfigError(f"transport rdma: RDMA is unavailable here: {reason}") from None
        log.info("transport auto: using TCP, RDMA is unavailable here (%s)", reason)
        return None
    log.info("transport %s: RDMA on %s; peers without RDMA over TCP", mode, device.describe())
    return device
