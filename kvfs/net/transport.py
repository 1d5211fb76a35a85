"""Chunk transfer between nodes: the peer server and the TCP transport.

A reader's node asks the node that stores a version for a run of its chunks
(`FetchChunks`); the owner answers with one frame per chunk, its payload sent
straight from the DRAM arena (or from the SSD read buffer), and the reader
receives each payload straight into a read buffer with `recv_into`: no copy in
Python on either side. A connection carries one fetch at a time; a node keeps
a few connections per peer, so that a file's chunk runs and different files are
fetched in parallel.

Several files' runs bound for the same owner may go in one request (`FetchBatch`): the
owner answers the runs in order, each with its chunk frames or one error frame that ends
that run only, and the reader receives them all in one worker-thread call, each chunk
verified on its own, so that a bad or missing file fails itself and not its neighbours.

Where the owner keeps the writer's piece checksums of a chunk (`kvfs.checksum.PIECE_SIZE`
pieces, computed at seal), the chunk's frame header carries them, and the reader verifies
and hands on each piece as it arrives: the kernel's first READs of a chunk are served
while its last bytes are still on their way. The whole chunk is then verified against
its chunk checksum, as a chunk without pieces is.

A chunk connection is set up and authenticated in TLS as any other, then leaves it
(kvfs.net.handshake) for kvfs's own AEAD records (kvfs.net.sealed), in which its frames,
payloads included, travel encrypted and authenticated, each payload piece one record
decrypted straight into the read buffer. With peer encryption off on both nodes (`kvfs node
--peer-encryption off`) it leaves TLS for plain frames instead: every chunk and piece is
still verified against its checksum before a byte of it is served. RDMA control requests
are refused on a plain connection (they need encryption).

`Transport` is what the node calls; an RDMA transport (one-sided reads from the
registered arena) implements the same method.
"""

from __future__ import annotations

import errno
import logging
import select
import socket
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol, TypeVar, Union

import msgspec
import trio

from kvfs.checksum import PIECE_SIZE, chunk_checksum, chunk_hasher
from kvfs.wire.protocol import ErrorReply, FrameKind, Head, HeaderDecoder, ProtocolError
from kvfs.wire.rdma_messages import RDMA_REQUESTS, Unlease
from kvfs.wire.text import printable
from kvfs.cluster.authority import PEER_CLIENTS, PEER_ROLE
from kvfs.net.answers import SEND_STALL_S, Answers, ChunkData, take
from kvfs.net.handshake import HANDSHAKE_TIMEOUT_S, REFUSALS, Gate, LogBudget, connect
from kvfs.net.hop import in_thread
from kvfs.net.streams import BlockingFrames, FrameStream, peer_name, serve_tcp
from kvfs.security.credentials import Tls
from kvfs.concurrency import run_all
from kvfs.config import split_address
from kvfs.errors import KvfsError, StorageError
from kvfs.histogram import OperationStats
from kvfs.notices import Notices

log = logging.getLogger(__name__)
T = TypeVar("T")

SOCKET_BUFFER = 4 << 20
# The reader's budget against one peer (docs/cluster.md, "Bounds on a peer"): connecting and
# authenticating, then each wait for the owner's next bytes, take at most PEER_SILENCE_S; the
# owner pulses every PULSE_S (kvfs.net.answers) while it prepares a chunk, so only a frozen,
# dead or cut-off owner goes silent that long.
PEER_SILENCE_S = 3.0
CONNECT_TIMEOUT_S = PEER_SILENCE_S
STREAMS_PER_PEER = 8
# The owner's bounds on its readers: fetches served at once to one identity (more wait their
# turn, as tasks), and worker threads encrypting payloads at once. A thread runs while the
# socket takes data, and waits for room at most THREAD_WAIT_S (kvfs.net.answers) before it
# hands the wait to the event loop: a reader that stops reading holds a task, not a thread.
FETCHES_PER_PEER = STREAMS_PER_PEER
SEND_THREADS = 8
# A batch's bounds (the owner refuses a larger one as a protocol error): runs, and chunks in all.
MAX_BATCH_RUNS = 16
MAX_BATCH_CHUNKS = 32


class FetchChunks(msgspec.Struct, tag=True):
    version: int
    first: int  # chunk index
    count: int


class FetchBatch(msgspec.Struct, tag=True):
    """Runs of several versions in one request, answered in order: each run's chunk frames, or
    one error frame that ends that run alone."""

    runs: list[FetchChunks]


def check_batch(batch: FetchBatch) -> None:
    """Refuses a batch beyond the bounds, or with an empty run (a reader never sends one)."""
    if not 0 < len(batch.runs) <= MAX_BATCH_RUNS:
        raise ProtocolError(f"a batch of {len(batch.runs)} runs (1 to {MAX_BATCH_RUNS})")
    if any(run.count < 1 for run in batch.runs):
        raise ProtocolError("a batch with an empty run")
    if sum(run.count for run in batch.runs) > MAX_BATCH_CHUNKS:
        raise ProtocolError(f"a batch of over {MAX_BATCH_CHUNKS} chunks")


class ChunkSource(Protocol):
    """What the peer server serves from: the node's tiered store."""

    chunk_size: int

    async def serve_chunks(self, version: int, first: int, count: int,
                           send: Callable[[int, memoryview | bytes], Awaitable[None]]) -> None:
        """Calls `send(index, data)` for each chunk in order; raises StorageError."""

    # Optional: `piece_checksums(version, index) -> list[int] | None`, the writer's checksums
    # of a chunk's pieces where the source keeps them (a source without it sends whole chunks).
    # Optional: `hold_chunks(version, first, count) -> HeldChunks | None` (kvfs.store.remote),
    # a run's chunks as views pinned in DRAM, so that a request's chunks go out in one send.


def _no_pieces(index: int, verified: int) -> None:
    pass


@dataclass(slots=True)
class FetchRun:
    """One run of a batch, as `Transport.fetch` takes it: chunks first, first+1, ... of
    `version` into `targets`, with the same callbacks (called in the event loop)."""

    version: int
    first: int
    targets: list[memoryview]
    lengths: list[int]
    checksums: list[int]
    on_chunk: Callable[[int], None]
    on_answer: Callable[[], None] = lambda: None
    on_piece: Callable[[int, int], None] = _no_pieces
    # Where the worker thread leaves the callbacks for the event loop (None: each one wakes it).
    notices: Notices | None = None


class Transport(Protocol):
    reports_pieces: bool  # whether `fetch` takes `on_piece`

    async def fetch(self, address: str, version: int, first: int, targets: list[memoryview], lengths: list[int],
                    checksums: list[int], on_chunk: Callable[[int], None],
                    on_answer: Callable[[], None] = lambda: None,
                    on_piece: Callable[[int, int], None] = _no_pieces) -> None:
        """Fills `targets` with chunks first, first+1, ... of `version` stored at `address`,
        verifying each against its checksum and calling `on_chunk(index)` as each arrives.
        `on_answer()` runs once the peer has started sending (it has the version), before
        the first payload is in; `on_piece(index, verified)` whenever the first `verified`
        bytes of a chunk not yet whole are in and verified against the writer's piece
        checksums (only where the owner sent them). Raises StorageError: ENOENT if the
        peer refuses the connection or no longer has the version, EIO if it is too slow
        to connect or goes silent for PEER_SILENCE_S (or sends bad bytes)."""


def _tune(sock: trio.socket.SocketType) -> None:
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError:
            pass
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class RdmaService(Protocol):
    """The owner's side of the RDMA transport (`kvfs.net.rdma.RdmaExporter`)."""

    async def handle(self, session: Any, request: Any,
                     reply: Callable[[FrameKind, Any], Awaitable[None]]) -> Any:
        """Serves one RDMA control request; returns the connection's session (or None)."""

    async def close_session(self, session: Any) -> None:
        """The connection ended: revoke what it was granted."""


class PeerServer:
    """Serves chunk reads of this node's versions to authenticated peers, over TCP, and the
    control requests of the RDMA transport when this node has one."""

    def __init__(self, store: ChunkSource, tls: Tls, rdma: RdmaService | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S, send_stall_s: float = SEND_STALL_S,
                 fetches_per_peer: int = FETCHES_PER_PEER, plaintext: bool = False) -> None:
        self.store = store
        self.rdma = rdma
        # Every admitted connection leaves TLS for kvfs's records, or (PLAINTEXT: peer encryption
        # off here, and at the client too) for plain frames.
        self.gate = Gate(tls, PEER_CLIENTS, "peer connection", handshake_timeout_s, plaintext=plaintext,
                         sealed=True)
        self._requests = HeaderDecoder(Union[(FetchChunks, FetchBatch, *RDMA_REQUESTS)])  # type: ignore[misc]
        self.served_bytes = 0
        self.send_stall_s = send_stall_s
        self.fetches_per_peer = fetches_per_peer
        self.stalled = 0  # readers dropped for taking no data for send_stall_s
        self._stall_log = LogBudget()
        self._send_threads: trio.CapacityLimiter | None = None  # made in the event loop
        self._peers: dict[str, tuple[trio.CapacityLimiter, int]] = {}  # identity -> (its fetches, connections)

    @property
    def refused(self) -> int:
        """Connections that failed the handshake."""
        return self.gate.refused

    @property
    def plaintext_connections(self) -> int:
        """Connections admitted that left TLS (both ends with peer encryption off)."""
        return self.gate.plaintext_admitted

    @property
    def sealed_connections(self) -> int:
        """Connections admitted that moved to kvfs's records."""
        return self.gate.sealed_admitted

    async def serve(self, host: str, port: int, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_tcp(self._connection, host, port, task_status)

    async def _connection(self, stream: trio.SocketStream) -> None:
        peer = peer_name(stream)
        _tune(stream.socket)
        async with stream:
            admitted = await self.gate.admit(stream)
        if admitted is None:
            return
        frames, identity = admitted
        fetches = self._join(identity.name)
        if self._send_threads is None:
            self._send_threads = trio.CapacityLimiter(SEND_THREADS)
        answers = Answers(frames, self._count_served, self._send_threads, self.send_stall_s)
        async with frames.stream:
            session = None

            async def requests() -> None:
                nonlocal session
                while True:
                    request_id, request = await frames.receive_request(self._requests)
                    if isinstance(request, FetchChunks):
                        await self._fetch(answers, fetches, request_id, [request])
                    elif isinstance(request, FetchBatch):
                        check_batch(request)
                        await self._fetch(answers, fetches, request_id, request.runs)  # one fetch of the share
                    elif frames.plaintext:  # memory keys are not for a connection without TLS
                        raise ProtocolError(f"an RDMA request ({type(request).__name__}) on a plaintext connection")
                    else:
                        session = await self._rdma_request(frames, request_id, session, request)

            try:
                await run_all([requests, answers.pulse_while_serving])  # a failure is raised as itself
            except ProtocolError as error:
                log.warning("closing peer connection from %s: %s", peer, printable(error))
            except TimeoutError as error:  # a reader that stopped reading: what it held is freed
                self.stalled += 1
                logged, held = self._stall_log.take(trio.current_time())
                if logged:
                    log.warning("dropped peer connection from %s (%s): %s%s", peer, identity, error,
                                f" ({held} more dropped before this one)" if held else "")
            except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass
            except Exception:  # never let one connection take the server down
                log.exception("peer connection from %s failed", peer)
            finally:
                self._leave(identity.name)
                if session is not None and self.rdma is not None:
                    await self.rdma.close_session(session)

    def _join(self, name: str) -> trio.CapacityLimiter:
        """The identity's share of fetches, shared by all its connections."""
        limiter, connections = self._peers.get(name) or (trio.CapacityLimiter(self.fetches_per_peer), 0)
        self._peers[name] = (limiter, connections + 1)
        return limiter

    def _leave(self, name: str) -> None:
        limiter, connections = self._peers[name]
        if connections == 1:
            del self._peers[name]
        else:
            self._peers[name] = (limiter, connections - 1)

    async def _rdma_request(self, frames: FrameStream, request_id: int, session: Any, request: Any) -> Any:
        async def reply(kind: FrameKind, header: Any) -> None:
            await frames.send(kind, request_id, header)

        if self.rdma is not None:
            return await self.rdma.handle(session, request, reply)
        if not isinstance(request, Unlease):  # one-way: no answer
            await reply(FrameKind.ERROR, ErrorReply(errno.ENOTSUP, "this node has no RDMA transport"))
        return None

    async def _fetch(self, answers: Answers, fetches: trio.CapacityLimiter, request_id: int,
                     runs: list[FetchChunks]) -> None:
        """Answers the runs of one request in order; a run that fails ends with an error frame
        and the next one follows (a single `FetchChunks` is a batch of one). A peer's fetches
        beyond its share wait for `fetches`, holding nothing.

        The runs whose chunks the store holds in DRAM go out together, the request's frames in
        one worker call (`Answers.frames_out`), their views pinned until it returns; a run the
        store serves from SSD goes chunk by chunk, as the disk gives them (`serve_chunks`)."""
        pieces = getattr(self.store, "piece_checksums", None)
        hold = getattr(self.store, "hold_chunks", None)  # (a source without it serves chunk by chunk)

        def sender(version: int) -> Callable[[int, memoryview | bytes], Awaitable[None]]:
            async def send(index: int, data: memoryview | bytes) -> None:
                await answers.chunk(index, data, pieces(version, index) if pieces is not None else None)
            return send

        await take(fetches)
        answers.begin(request_id)
        releases: list[Callable[[], None]] = []
        views: list[memoryview] = []  # frames not yet sent, in order
        payload = 0
        try:
            for run in runs:
                try:  # the store checks the chunk range, for this path and the RDMA one
                    held = hold(run.version, run.first, run.count) if hold is not None else None
                    if held is None:
                        if views:  # what comes before it goes first
                            await answers.frames_out(views, payload)
                            views, payload = [], 0
                        await self.store.serve_chunks(run.version, run.first, run.count, sender(run.version))
                        continue
                except KvfsError as error:
                    if views:
                        views.extend(answers.error_frame(error))
                    else:
                        await answers.error(error)
                    continue
                releases.append(held.release)
                for offset, (view, checksums) in enumerate(zip(held.views, held.pieces)):
                    views.extend(answers.chunk_frame(run.first + offset, view, checksums))
                    payload += len(view)
            if views:
                await answers.frames_out(views, payload)
        finally:
            for release in releases:
                release()
            answers.end()
            fetches.release()

    def _count_served(self, count: int) -> None:
        self.served_bytes += count


class MeasuredTransport:
    """A `Transport` whose fetches are timed and counted by outcome (`fetches`); subclasses
    implement `_fetch`."""

    reports_pieces = True  # its fetches take `on_piece`
    takes_notices = False  # its fetches take `notices` (kvfs.notices)

    def __init__(self) -> None:
        self.fetches = OperationStats()  # one "fetch" per chunk run, by outcome

    async def fetch(self, address: str, version: int, first: int, targets: list[memoryview], lengths: list[int],
                    checksums: list[int], on_chunk: Callable[[int], None],
                    on_answer: Callable[[], None] = lambda: None,
                    on_piece: Callable[[int, int], None] = _no_pieces, notices: Notices | None = None) -> None:
        deferred = {"notices": notices} if notices is not None else {}
        await self.fetches.measure("fetch", self._fetch(address, version, first, targets, lengths, checksums,
                                                        on_chunk, on_answer, on_piece, **deferred))

    async def _fetch(self, address: str, version: int, first: int, targets: list[memoryview], lengths: list[int],
                     checksums: list[int], on_chunk: Callable[[int], None], on_answer: Callable[[], None],
                     on_piece: Callable[[int, int], None]) -> None:
        raise NotImplementedError


class TcpTransport(MeasuredTransport):
    """Fetches chunks from peers over persistent connections in kvfs's records after a TLS
    setup (plain instead, with peers that also run with peer encryption off, when `plaintext`)."""

    kind = "tcp"
    takes_notices = True

    def __init__(self, tls: Tls, streams_per_peer: int = STREAMS_PER_PEER, plaintext: bool = False) -> None:
        super().__init__()
        self.tls = tls
        self.plaintext = plaintext
        self.kind = "tcp-plain" if plaintext else "tcp"  # as `kvfs status` shows it
        self.connections = 0  # opened, ...
        self.plaintext_connections = 0  # ... of which left TLS for plain frames
        self.sealed_connections = 0  # ... of which for kvfs's records
        self.streams_per_peer = streams_per_peer
        self._idle: dict[str, list[BlockingFrames]] = {}
        self._chunks = HeaderDecoder(ChunkData)
        self._errors = HeaderDecoder(ErrorReply)
        self._next_id = 1
        self.fetched_bytes = 0
        self.checksum_failures = 0

    async def _connect(self, address: str, pooled: bool = True) -> tuple[BlockingFrames, bool]:
        """A connection to the peer: (an idle one, True) if one looks alive, else (a new one, False)."""
        idle = self._idle.get(address) if pooled else None
        while idle:
            connection = idle.pop()
            if _looks_alive(connection):
                return connection, True
            connection.close()  # the peer closed it (restarted, say): not worth a request
        host, port = split_address(address)
        with trio.move_on_after(CONNECT_TIMEOUT_S):
            frames = await connect(host, port, self.tls, PEER_ROLE, tune=_tune, plaintext=self.plaintext,
                                   sealed=True)
            self.connections += 1
            self.plaintext_connections += frames.plaintext
            self.sealed_connections += frames.sealed
            try:
                return BlockingFrames.detach(frames, PEER_SILENCE_S), False
            except BaseException:
                await frames.aclose()
                raise
        raise TimeoutError(errno.ETIMEDOUT, f"connecting to {address} took over {CONNECT_TIMEOUT_S:g} s")

    def _give_back(self, address: str, connection: BlockingFrames) -> None:
        idle = self._idle.setdefault(address, [])
        if len(idle) < self.streams_per_peer:
            idle.append(connection)
        else:
            connection.close()

    async def _fetch(self, address: str, version: int, first: int, targets: list[memoryview], lengths: list[int],
                     checksums: list[int], on_chunk: Callable[[int], None], on_answer: Callable[[], None],
                     on_piece: Callable[[int, int], None] = _no_pieces, notices: Notices | None = None) -> None:
        # The callbacks run in the event loop; the worker thread goes on.
        post = notices.post if notices is not None else trio.lowlevel.current_trio_token().run_sync_soon

        def arrived(index: int) -> None:
            post(on_chunk, index)

        def answered() -> None:
            post(on_answer)

        def piece(index: int, verified: int) -> None:
            post(on_piece, index, verified)

        def exchange(connection: BlockingFrames, request_id: int) -> None:
            self._exchange(connection, request_id, address, version, first, targets, lengths, checksums, arrived,
                           answered, piece)

        def last() -> None:  # the last chunk, on the thread's return (what it reported before, first)
            if notices is not None:
                notices.deliver()
            on_chunk(first + len(targets) - 1)

        await self._request(address, f"version {version}", FetchChunks(version, first, len(targets)), exchange,
                            last if targets else None)

    async def fetch_batch(self, address: str, runs: list[FetchRun]) -> list[StorageError | None]:
        """Fetches runs of several versions stored at `address` in one request and one worker-
        thread call, each as `fetch` would; returns each run's failure (None: every chunk in and
        verified), so that one bad or missing file fails alone. Raises StorageError as `fetch`
        does when the connection fails (for every run: chunks already in stay good)."""
        token = trio.lowlevel.current_trio_token()
        what = "versions " + ", ".join(str(run.version) for run in runs)
        request = FetchBatch([FetchChunks(run.version, run.first, len(run.targets)) for run in runs])

        def exchange(connection: BlockingFrames, request_id: int) -> list[StorageError | None]:
            return self._exchange_batch(connection, request_id, address, runs, token)

        return await self.fetches.measure("batch", self._request(address, what, request, exchange))

    async def _request(self, address: str, what: str, request: FetchChunks | FetchBatch,
                       exchange: Callable[[BlockingFrames, int], T], returned: Callable[[], None] | None = None) -> T:
        """Sends `request` and runs `exchange(connection, request_id)`, which receives its
        answer, in a worker thread, on a pooled connection (once more on a new one if the
        pooled one turns out stale); `returned()` in the event loop once it has returned
        (`in_thread`)."""
        try:
            return await self._request_once(address, what, request, exchange, returned)
        except _Unanswered:  # a pooled connection the peer had dropped (a restart): once more on a new one
            log.debug("%s: the pooled connection to %s was stale; reconnecting", what, address)
            return await self._request_once(address, what, request, exchange, returned, pooled=False)

    async def _request_once(self, address: str, what: str, request: FetchChunks | FetchBatch,
                            exchange: Callable[[BlockingFrames, int], T], returned: Callable[[], None] | None = None,
                            pooled: bool = True) -> T:
        try:
            connection, reused = await self._connect(address, pooled)
        except TimeoutError as error:  # slow is not absent: the peer may be alive and loaded
            raise StorageError(errno.EIO, f"{what}: peer {address} did not answer ({error})") from None
        except (OSError, ValueError, *REFUSALS) as error:
            raise StorageError(errno.ENOENT, f"{what}: peer {address} is unreachable ({error})") from None
        request_id = self._next_id
        self._next_id += 1
        reusable = False

        def send_request() -> None:
            # From the event loop, once a thread is granted: the owner starts on the request
            # while the receiving thread is still being scheduled (on two busy cores that
            # took up to 0.5 ms per load). It never blocks the loop: the connection is idle, every
            # earlier request's answer read whole, so its send buffer is empty and takes a
            # request frame at once.
            try:
                connection.send(FrameKind.REQUEST, request_id, request)
            except (ConnectionResetError, BrokenPipeError) as error:  # closed before a word of answer
                raise _Unanswered() from error

        try:
            # A fetch not yet begun still ends at a cancel; once begun it runs to its end (the
            # thread fills the caller's buffers). The light hop: no thread naming per call.
            await trio.lowlevel.checkpoint_if_cancelled()
            result = await in_thread(trio.to_thread.current_default_thread_limiter(), exchange, connection,
                                     request_id, returned=returned, first=send_request)
            reusable = True
            return result
        except _RemoteError:
            reusable = True  # the peer answered; the connection is in step
            raise
        except _Unanswered as error:
            if reused:
                raise
            raise StorageError(errno.ENOENT, f"{what}: lost peer {address} ({error.__cause__})") from None
        except TimeoutError:
            raise StorageError(errno.EIO, f"{what}: peer {address} was silent for {PEER_SILENCE_S:g} s") from None
        except (OSError, EOFError) as error:
            raise StorageError(errno.ENOENT, f"{what}: lost peer {address} ({error})") from None
        except ProtocolError as error:
            raise StorageError(errno.EIO, f"{what}: peer {address} sent a bad frame ({error})") from None
        finally:
            if reusable:
                self._give_back(address, connection)
            else:
                connection.close()

    def _answer(self, connection: BlockingFrames, request_id: int) -> Head:
        """The next frame for this request that is not a pulse (pulses only keep the deadline off)."""
        while True:
            head = connection.receive_head()
            prefix = head.prefix
            if prefix.kind == FrameKind.PULSE and prefix.request_id <= request_id and not prefix.payload_length:
                continue  # (a late one of an earlier request on this connection is harmless too)
            if prefix.request_id != request_id:
                raise ProtocolError(f"{prefix.kind.name} frame for request {prefix.request_id}, expected {request_id}")
            return head

    def _exchange(self, connection: BlockingFrames, request_id: int, address: str, version: int, first: int,
                  targets: list[memoryview], lengths: list[int], checksums: list[int],
                  arrived: Callable[[int], None], answered: Callable[[], None],
                  piece: Callable[[int, int], None]) -> None:
        """One fetch's answer, in a worker thread (its request was sent): a frame per chunk into
        its target. Each chunk but the last is reported as it arrives (`arrived`); the last one
        is the caller's to report, on the thread's return (`in_thread`'s `returned`): a report
        of its own would wake the event loop once more, just before the thread's return wakes it."""
        try:
            head = self._answer(connection, request_id)
        except (EOFError, ConnectionResetError) as error:  # closed before a word of answer
            raise _Unanswered() from error
        for offset, (target, length) in enumerate(zip(targets, lengths)):
            index = first + offset
            if offset:
                head = self._answer(connection, request_id)
            reply = self._chunk_reply(head, index, length, address)
            if not offset:
                answered()
            self._receive_chunk(connection, reply, target[:length], checksums, index, version, address, piece)
            if offset < len(targets) - 1:
                arrived(index)

    def _exchange_batch(self, connection: BlockingFrames, request_id: int, address: str, runs: list[FetchRun],
                        token: trio.lowlevel.TrioToken) -> list[StorageError | None]:
        """One batch's answer, in a worker thread (its request was sent): each run's frames in
        order. A run the owner ends with an error frame, or a chunk that fails its checksum
        (received whole, so the next frame is in step), fails that run alone."""
        try:
            head: Head | None = self._answer(connection, request_id)
        except (EOFError, ConnectionResetError) as error:  # closed before a word of answer
            raise _Unanswered() from error
        outcomes: list[StorageError | None] = []
        for run in runs:
            post = run.notices.post if run.notices is not None else token.run_sync_soon
            outcome: StorageError | None = None
            for offset, (target, length) in enumerate(zip(run.targets, run.lengths)):
                index = run.first + offset
                head = head or self._answer(connection, request_id)
                try:
                    reply = self._chunk_reply(head, index, length, address)
                except _RemoteError as error:  # the owner ended this run: the next frame is the next run's
                    outcome = error
                    break
                finally:
                    head = None
                if not offset:
                    post(run.on_answer)
                try:
                    self._receive_chunk(connection, reply, target[:length], run.checksums, index, run.version,
                                        address, lambda i, verified, run=run, post=post: post(run.on_piece, i,
                                                                                              verified))
                except StorageError as error:
                    outcome = outcome or error
                    continue
                post(run.on_chunk, index)
            outcomes.append(outcome)
        return outcomes

    def _chunk_reply(self, head: Head, index: int, length: int, address: str) -> ChunkData:
        """The header of chunk `index` (`length` bytes), checked; an error frame raises _RemoteError."""
        prefix, header = head.prefix, head.header
        if prefix.kind == FrameKind.ERROR:
            error = self._errors.decode(header)
            raise _RemoteError(error.errno, f"peer {address}: {error.message}")
        if prefix.kind != FrameKind.RESPONSE:
            raise ProtocolError(f"unexpected {prefix.kind.name} frame")
        reply = self._chunks.decode(header)
        if reply.index != index or reply.length != length or prefix.payload_length != length:
            raise ProtocolError(f"chunk {reply.index} of {reply.length} bytes, expected chunk {index} of {length}")
        if reply.pieces and len(reply.pieces) != -(-length // PIECE_SIZE):
            raise ProtocolError(f"chunk {index} of {length} bytes with {len(reply.pieces)} piece checksums")
        return reply

    def _receive_chunk(self, connection: BlockingFrames, reply: ChunkData, target: memoryview,
                       checksums: list[int], index: int, version: int, address: str,
                       piece: Callable[[int, int], None]) -> None:
        """A chunk's payload into `target`, verified (piece by piece where the owner sent the
        pieces' checksums); raises StorageError (EIO) once all of it is in if it is bad."""
        known = index < len(checksums)  # the writer's checksum of the whole chunk, checked below
        if reply.pieces:
            whole = self._receive_pieces(connection, target, reply.pieces, index, version, address, piece, known)
        else:
            connection.receive_payload(target)
            whole = chunk_checksum(target)
        if known and whole != checksums[index]:
            self.checksum_failures += 1
            raise StorageError(errno.EIO, f"version {version} chunk {index} from {address} fails its checksum")
        self.fetched_bytes += len(target)

    def _receive_pieces(self, connection: BlockingFrames, target: memoryview, pieces: list[int], index: int,
                        version: int, address: str, piece: Callable[[int, int], None], known: bool) -> int:
        """A chunk's payload piece by piece, each verified against the writer's piece checksum
        and handed on (`piece`) before the next is received (the last one goes with the whole
        chunk); returns the whole chunk's checksum, computed on the way. Where the caller
        checks that checksum (`known`), the last piece is verified by it alone: hashing it on
        its own too would verify nothing more. After a bad piece the rest is received, not
        handed on, and then the chunk fails."""
        whole = chunk_hasher()
        bad = None
        last = len(pieces) - 1
        for number, checksum in enumerate(pieces):
            start = number * PIECE_SIZE
            received = target[start : start + PIECE_SIZE]
            connection.receive_payload(received)
            if bad is not None:
                continue
            if not (number == last and known) and chunk_checksum(received) != checksum:
                bad = number
                continue
            whole.update(received)
            if number < last:
                piece(index, start + len(received))
        if bad is not None:
            self.checksum_failures += 1
            raise StorageError(errno.EIO, f"version {version} chunk {index} piece {bad} from {address} "
                                          f"fails its checksum")
        return whole.intdigest()

    async def aclose(self) -> None:
        for connections in self._idle.values():
            for connection in connections:
                connection.close()
        self._idle.clear()


class _RemoteError(StorageError):
    """The peer answered with an error: the connection itself is still good."""


class _Unanswered(Exception):
    """The connection closed before any answer to the request (its cause says how)."""


def _looks_alive(connection: BlockingFrames) -> bool:
    """An idle connection has nothing to read: readable means the peer closed (or reset) it."""
    poller = select.poll()
    poller.register(connection.sock, select.POLLIN | select.POLLPRI)
    return not poller.poll(0)
