"""Metadata requests over TCP: the trio adapter around the protocol and handshake.

`MetadataServer` serves a request handler (the master's `MetadataService.handle`)
to authenticated peers; `RemoteMaster` is the node's `MasterClient` for a master
in another process. Connections are opened and accepted by `kvfs.net.handshake`
(TLS 1.3, a certificate on each side) and carry frames through `kvfs.net.streams`.
Each request is checked against the connection's identity (kvfs.cluster.authority)
before it is handled: a refusal answers EPERM and is logged. A peer that fails the
handshake or sends an invalid frame is disconnected with a logged reason; other
connections are not affected.
"""

from __future__ import annotations

import errno
import logging
import math
import ssl
import typing
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Protocol

import msgspec
import trio

from kvfs.batching import batches
from kvfs.wire import messages as m
from kvfs.wire.protocol import ErrorReply, FrameKind, HeaderDecoder, ProtocolError, encode_frame
from kvfs.wire.text import printable
from kvfs.cluster.authority import MASTER_CLIENTS, MASTER_ROLE, Caller, Refused, check_request
from kvfs.net.commit import GroupCommit
from kvfs.net.deadlines import Watchdog
from kvfs.net.handshake import HANDSHAKE_TIMEOUT_S, Gate, LogBudget, connect
from kvfs.net.pushes import ACK_WAIT_S, Watcher, reply_waits
from kvfs.net.streams import FrameStream, peer_name, serve_tcp
from kvfs.errors import KvfsError, MetadataError
from kvfs.security.credentials import Identity, Tls

log = logging.getLogger(__name__)

_ANY_REQUEST = typing.Union[tuple(m.Request.__subclasses__())]  # type: ignore[misc]


PUSH_BYTES = 640 << 10  # name changes per pushed frame (a frame header holds 1 MiB)
ANSWERS_TOGETHER = 64  # requests of one connection already received, answered in one write
REPLIES_QUEUED = 256  # a connection's replies waiting for their commit; then its next request waits
LATE_ANSWERS_KEPT = 4096  # ids of requests given up at their deadline whose answers may still come


async def acquire(lock: trio.Lock) -> None:
    """Takes `lock`; when nobody holds it, without yielding to other tasks (trio's `acquire`
    always does): for a caller whose step before or after is a checkpoint anyway, a turn of
    the event loop less. Unlike `kvfs.net.answers.take`, a caller already cancelled (a
    request whose deadline passed) is cancelled here, as by `acquire`: its frame is not sent."""
    if lock.locked():
        await lock.acquire()
    else:
        await trio.lowlevel.checkpoint_if_cancelled()
        lock.acquire_nowait()


def push_batches(changes: list[m.NameChange]) -> list[list[m.NameChange]]:
    """Name changes in order, cut into frames that fit a header."""
    return batches(changes, lambda change: m.entry_bytes(change[1], change[3]), PUSH_BYTES)


class Notifier(Protocol):
    """Name changes waiting to be pushed to nodes (the metadata service)."""

    notify: set[int]  # nodes with changes waiting

    def take_notifications(self, node_id: int) -> list[m.NameChange]:
        """The node's waiting changes, which are then no longer waiting."""


class MetadataServer:
    """Serves metadata requests to authenticated nodes and clients, and pushes name
    changes to the nodes that watch directories.

    `handle(request, caller)` answers one request; `caller` is the node id that
    registered on this connection (0 for a client that did not register).
    `owner_of(version)` is the node storing a version (None if unknown), for the
    authority's checks of requests that name versions.

    A master elected through etcd passes `group` (kvfs.net.commit): each reply, and each
    pushed name change, then waits until the changes it may show are committed, while
    the connection's next requests are handled; replies still leave in request order.
    `may_act()` is checked before a request is handled and before its reply or a push is
    sent: once false (the leadership's lease may have run out), the connection waits for
    `resumed()` (a leader paused while etcd answers no renewal: True once it may act again)
    and is closed if that is False. `epoch()` is the leadership's epoch, announced in the Welcome.

    `save()` makes durable what the requests handled so far changed (`kvfs master`: one lmdb
    transaction). It is called once per batch of requests handled together in one turn of a
    connection's loop, before any of their answers leaves and before any other task runs (no
    checkpoint between the handling and the save), so no answer and no push shows a change
    that is not saved."""

    def __init__(self, handle: Callable[[m.Request, int], Any], tls: Tls, notifier: Notifier | None = None,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
                 owner_of: Callable[[int], int | None] = lambda version: None,
                 group: GroupCommit | None = None, may_act: Callable[[], bool] = lambda: True,
                 epoch: Callable[[], int] = lambda: 0, temp_suffix: bytes = b"",
                 resumed: Callable[[], Awaitable[bool]] | None = None,
                 save: Callable[[], None] = lambda: None) -> None:
        self.handle = handle
        self.save = save
        self.temp_suffix = temp_suffix  # writers' temporary names: their creates wait for no node (kvfs.net.pushes)
        self.notifier = notifier
        self.owner_of = owner_of
        self.group = group
        self.may_act = may_act
        self._resumed = resumed
        self.gate = Gate(tls, MASTER_CLIENTS, "connection", handshake_timeout_s, epoch=epoch)
        self.denied = 0  # requests refused by the authority
        self._denied_log = LogBudget()
        self._requests = HeaderDecoder(_ANY_REQUEST)
        self._wake: dict[int, trio.Event] = {}  # node -> its pusher's wake-up
        self._watchers: dict[int, Watcher] = {}  # node -> its connection's pushes (kvfs.net.pushes)

    async def _may_act_again(self) -> bool:
        """Whether this master may act, once a pause of its leadership (if any) ended."""
        return self.may_act() or (self._resumed is not None and await self._resumed())

    @property
    def refused(self) -> int:
        """Connections that failed the handshake."""
        return self.gate.refused

    def wake_pushers(self) -> dict[int, tuple[Watcher, int]]:
        """Lets the connections of nodes with waiting name changes push them; returns, by
        node, the push that will carry the changes (for a reply to wait for)."""
        if self.notifier is None or not self.notifier.notify:
            return {}
        pushes = {}
        for node in self.notifier.notify:
            event, watcher = self._wake.get(node), self._watchers.get(node)
            if event is not None:
                event.set()
            if watcher is not None:
                pushes[node] = (watcher, watcher.queue())
        self.notifier.notify.clear()
        return pushes

    async def _push_forever(self, frames: FrameStream, send_lock: trio.Lock, node: int, watcher: Watcher) -> None:
        try:
            await self._push_changes(frames, send_lock, node, watcher)
        finally:
            if self._watchers.get(node) is watcher:  # (the connection ends with this task)
                del self._watchers[node]

    async def _push_changes(self, frames: FrameStream, send_lock: trio.Lock, node: int, watcher: Watcher) -> None:
        assert self.notifier is not None
        event = self._wake[node]  # (set at registration: changes queued before this task ran count)
        while True:
            await event.wait()
            # Renewed before the changes are taken: a wake while they are sent is for later
            # changes, which the next round sends (not left until some other change comes).
            event = self._wake[node] = trio.Event()
            try:
                if self.group is None:
                    # Taken and sent under the lock that an answer carrying the node's waiting
                    # changes is handled and sent under: the node gets them in the order made.
                    async with send_lock:
                        await self._push(frames, self.notifier.take_notifications(node), watcher.queued)
                    continue
                changes, seq = self.notifier.take_notifications(node), watcher.queued
                await self.group.wait(self.group.handled)  # a node learns of a name only once it is durable
                if not await self._may_act_again():
                    return  # the request loop closes the connection
                async with send_lock:
                    await self._push(frames, changes, seq)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the request loop sees the connection go, too

    async def serve(self, host: str, port: int, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_tcp(self._connection, host, port, task_status)

    async def serve_stream(self, stream: trio.SocketStream) -> None:
        """One accepted connection, served until it closes (for an owner that accepts them)."""
        await self._connection(stream)

    async def _connection(self, stream: trio.SocketStream) -> None:
        peer = peer_name(stream)
        async with stream:
            admitted = await self.gate.admit(stream)
        if admitted is None:
            return
        frames, identity = admitted
        log.info("%s connected from %s", identity, peer)
        try:
            async with trio.open_nursery() as nursery:  # the request loop and, once registered, the pusher
                await self._requests_until_closed(frames, nursery, identity, peer)
                nursery.cancel_scope.cancel()
        except Exception:  # never let one connection take the server down
            log.exception("connection from %s failed", peer)
        finally:
            with trio.CancelScope(shield=True):
                await frames.aclose()

    def _refuse(self, caller: Caller, peer: Any, error: Refused) -> None:
        self.denied += 1
        logged, held = self._denied_log.take(trio.current_time())
        if logged:
            log.warning("refused a request from %s at %s: %s%s", caller, peer, printable(error),
                        f" ({held} more refused before this one)" if held else "")

    async def _requests_until_closed(self, frames: FrameStream, nursery: trio.Nursery, identity: Identity,
                                     peer: Any) -> None:
        caller = Caller(identity.name, identity.role, identity.addresses)
        send_lock = trio.Lock()
        # Replies that wait (for their commit, for other nodes to apply the changes pushed to
        # them) go out in order from a task of their own while the next requests are handled.
        replies, queued = trio.open_memory_channel[_Reply](REPLIES_QUEUED)
        waiting = [0]  # replies in that channel or being sent from it
        nursery.start_soon(self._send_in_order, frames, send_lock, queued, waiting, nursery, identity, peer)
        try:
            while True:
                request_id, request = await frames.receive_request(self._requests)
                if not await self._may_act_again():
                    log.info("closing connection from %s at %s: this master may no longer lead", identity, peer)
                    return
                if self.group is not None or waiting[0]:  # (replies leave in order)
                    frame, caller, pushes = self._answer(request_id, request, caller, nursery, frames, send_lock,
                                                         peer)
                    self.save()
                    waiting[0] += 1
                    await replies.send(_Reply(frame, self.group.ticket() if self.group is not None else None,
                                              pushes, trio.current_time() + ACK_WAIT_S))
                    continue
                deferred: _Reply | None = None
                hostile: ProtocolError | None = None
                # Handled and sent under the send lock: the answer may carry the node's waiting
                # name changes, and no push of later ones may pass it (`_push_forever`).
                await acquire(send_lock)  # (its checkpoint is the send below, or the deferred reply's queueing)
                try:
                    answers: list[bytes] = []
                    received: tuple[int, m.Request] | None = (request_id, request)
                    while received is not None:
                        frame, caller, pushes = self._answer(*received, caller, nursery, frames, send_lock, peer,
                                                             with_changes=True)
                        if pushes:  # waits for other nodes to apply what it added (after those before it)
                            deferred = _Reply(frame, None, pushes, trio.current_time() + ACK_WAIT_S)
                            break
                        answers.append(frame)
                        if len(answers) >= ANSWERS_TOGETHER or not self.may_act():
                            break  # (the next receive finds it and closes the connection)
                        # Requests already here (a node's concurrent callers send theirs together)
                        # are answered in the same write and saved in one transaction: one TLS
                        # record, one wake-up of the node, one commit.
                        try:
                            received = self._buffered(frames)
                        except ProtocolError as error:  # those before it are still saved and answered
                            hostile, received = error, None
                    self.save()  # (no checkpoint since the first request: nothing else saw the changes)
                    if answers:
                        await frames.send_encoded(answers[0] if len(answers) == 1 else b"".join(answers))
                finally:
                    send_lock.release()
                if hostile is not None:
                    raise hostile
                if deferred is not None:
                    waiting[0] += 1
                    await replies.send(deferred)
        except ProtocolError as error:
            log.warning("closing connection from %s: %s", peer, printable(error))
        except trio.BrokenResourceError as error:
            if isinstance(error.__cause__, ssl.SSLError):  # a forged or damaged record: tampering on the path
                log.warning("closing connection from %s at %s: %s", identity, peer, printable(error))
            else:
                log.info("%s at %s disconnected", identity, peer)
        except (EOFError, trio.ClosedResourceError):
            log.info("%s at %s disconnected", identity, peer)

    def _buffered(self, frames: FrameStream) -> tuple[int, m.Request] | None:
        """The next request if it has already arrived whole, else None (nothing is read)."""
        frame = frames.parser.next_frame()
        if frame is None:
            return None
        if frame.prefix.kind != FrameKind.REQUEST or frame.payload:
            raise ProtocolError(f"unexpected {frame.prefix.kind.name} frame with {len(frame.payload)} payload bytes")
        return frame.prefix.request_id, self._requests.decode(frame.header)

    def _answer(self, request_id: int, request: m.Request, caller: Caller, nursery: trio.Nursery,
                frames: FrameStream, send_lock: trio.Lock, peer: Any,
                with_changes: bool = False) -> tuple[bytes, Caller, list[tuple[Watcher, int]]]:
        """One request handled: its encoded answer (preceded by pushes, when the node's
        waiting name changes are too many to ride on it), the connection's caller after it,
        and the pushes to other nodes that must be applied before the answer leaves (a name
        added: kvfs.net.pushes)."""
        pushes = b""
        watcher = self._watchers.get(caller.node) if caller.node else None
        try:
            try:
                check_request(caller, request, self.owner_of)
            except Refused as refused:
                self._refuse(caller, peer, refused)
                raise
            if watcher is not None and isinstance(request, m.Heartbeat):
                watcher.acknowledge(request.applied)
            response = self.handle(request, caller.node)
            if isinstance(response, m.Registered):  # this connection now speaks for that node
                caller = Caller(caller.name, caller.role, caller.addresses, response.node)
                log.info("%s %r at %s registered as node %d", caller.role, caller.name, peer, caller.node)
                if self.notifier is not None:
                    self._wake[caller.node] = trio.Event()
                    watcher = self._watchers[caller.node] = Watcher()
                    nursery.start_soon(self._push_forever, frames, send_lock, caller.node, watcher)
            elif watcher is not None and isinstance(response, m.Beat):
                response.pushed = watcher.queued
            elif (with_changes and caller.node and hasattr(response, "changes")
                  and not self._must_wait(request, caller.node)):  # (an answer that waits carries none)
                pushes = self._hand_changes(response, caller.node)
            reply: tuple[FrameKind, Any] = (FrameKind.RESPONSE, response)
        except KvfsError as error:
            reply = (FrameKind.ERROR, ErrorReply(error.errno, str(error)))
        except Exception as error:  # a bug answers EIO; the master keeps serving everyone
            log.exception("%s from %s failed", type(request).__name__, peer)
            reply = (FrameKind.ERROR, ErrorReply(errno.EIO, f"{type(request).__name__} failed: {error!r}"))
        waits = [push for node, push in self.wake_pushers().items()
                 if node != caller.node and reply_waits(request, self.temp_suffix)]
        try:
            frame = encode_frame(reply[0], request_id, reply[1])
        except ProtocolError as error:  # an answer too large to send: the caller gets an errno
            log.error("%s from %s: %s", type(request).__name__, peer, error)
            frame = encode_frame(FrameKind.ERROR, request_id, ErrorReply(errno.EFBIG, str(error)))
        return pushes + frame, caller, waits

    def _must_wait(self, request: m.Request, node: int) -> bool:
        """Whether the answer to `request` waits for other nodes (see `wake_pushers`)."""
        return (reply_waits(request, self.temp_suffix) and self.notifier is not None
                and any(other != node and other in self._watchers for other in self.notifier.notify))

    async def _push(self, frames: FrameStream, changes: list[Any], seq: int) -> None:
        """Pushes name changes; the last frame carries the push's number (an empty push too)."""
        pushed = push_batches(changes) or [[]]
        for i, batch in enumerate(pushed, 1):
            await frames.send(FrameKind.NOTIFY, 0, m.NameChanges(batch, seq if i == len(pushed) else 0))

    def _hand_changes(self, response: Any, node: int) -> bytes:
        """The name changes waiting for `node` go with its answer: a push frame less for
        each change the node makes in a directory it watches (the master queues those for it
        too), and for its answer's other changes. Returns the push frames to send before the
        answer instead, when they are too many for one."""
        assert self.notifier is not None
        if node not in self.notifier.notify:
            return b""
        self.notifier.notify.discard(node)
        changes = self.notifier.take_notifications(node)
        if sum(m.entry_bytes(change[1], change[3]) for change in changes) <= PUSH_BYTES:
            response.changes = changes
            return b""
        return b"".join(encode_frame(FrameKind.NOTIFY, 0, m.NameChanges(batch)) for batch in push_batches(changes))

    async def _send_in_order(self, frames: FrameStream, send_lock: trio.Lock,
                             queued: trio.MemoryReceiveChannel[_Reply], waiting: list[int], nursery: trio.Nursery,
                             identity: Identity, peer: Any) -> None:
        """Sends a connection's replies in order, each once the nodes its change was pushed
        to applied it (at most until its deadline: kvfs.net.pushes) and once committed.
        The replies queued behind it that are ready too (one commit releases many) leave
        in the same write."""
        held: _Reply | None = None  # taken from the channel, not ready yet: the next to send
        try:
            while True:
                if held is not None:
                    reply, held = held, None
                else:
                    try:
                        reply = await queued.receive()
                    except trio.EndOfChannel:
                        break
                for watcher, seq in reply.pushes:
                    await watcher.wait_applied(seq, reply.deadline)
                if reply.ticket is not None:
                    assert self.group is not None
                    await self.group.wait(reply.ticket)
                out = [reply.frame]
                while len(out) < ANSWERS_TOGETHER:
                    try:
                        held = queued.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    if held.pushes or (held.ticket is not None and self.group is not None
                                       and self.group.committed < held.ticket):
                        break  # it waits: sent alone, after these
                    out.append(held.frame)
                    held = None
                if not await self._may_act_again():
                    log.info("closing connection from %s at %s: this master may no longer lead", identity, peer)
                    break
                async with send_lock:
                    await frames.send_encoded(out[0] if len(out) == 1 else b"".join(out))
                waiting[0] -= len(out)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass  # gone: the request loop sees it too
        nursery.cancel_scope.cancel()  # the connection ends with its replies


@dataclass
class _Reply:
    """A reply that waits before it is sent (see `_send_in_order`)."""

    frame: bytes
    ticket: int | None  # its changes' commit, with an elected master
    pushes: list[tuple[Watcher, int]]  # pushes to other nodes that must be applied first
    deadline: float  # the most the pushes are waited for (trio time)


class MasterUnavailable(MetadataError):
    """The connection to the master broke; the request may or may not have been applied."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


@dataclass(eq=False)
class _Pending:
    request: m.Request
    timeout: float | None  # what the caller allowed, seconds
    deadline: float  # trio time; inf: none (kvfs.net.deadlines)
    done: trio.Event = field(default_factory=trio.Event)
    response: Any = None
    error: Exception | None = None


class MasterSilent(MasterUnavailable):
    """The master did not answer a request within its deadline: the connection is given up."""


class RemoteMaster:
    """A `MasterClient` for a master in another process: requests are pipelined on one
    connection and matched to their responses by id by a receiver task.

    With `request_timeout_s`, a request not answered within it fails with EIO and the
    connection is closed: a master that stopped answering (frozen, or cut off by a silent
    partition) is not waited for until TCP gives up, minutes later. The master answers a
    connection's requests in order, so one unanswered that long means none will be."""

    def __init__(self, frames: FrameStream,
                 on_notify: Callable[[m.NameChanges], None] | None = None,
                 request_timeout_s: float | None = None) -> None:
        self._frames = frames
        self._on_notify = on_notify
        self.request_timeout_s = request_timeout_s
        self.heard_at = trio.current_time()  # when the master last sent a frame
        self._notifications = HeaderDecoder(m.NameChanges)
        self._send_lock = trio.Lock()
        self._outgoing: list[bytes] = []  # frames waiting for the sender before them (`_send`)
        self._next_id = 1
        self._pending: dict[int, _Pending] = {}
        # Requests given up at their deadline, oldest first: id -> the request's type. The
        # master still answers them (in order, after the ones before): such an answer is
        # dropped, not taken for a peer out of step, which would fail every request in flight.
        self._expired: dict[int, type] = {}
        self.late_answers = 0
        self._watchdog = Watchdog()  # the pending requests' deadlines
        self._watching = trio.CancelScope()  # its task's, cancelled when the connection ends
        self._decoders = {request: HeaderDecoder(response) for request, response in m.RESPONSE_TYPES.items()}
        self._errors = HeaderDecoder(ErrorReply)
        self.broken: Exception | None = None
        self.closed = trio.Event()

    @classmethod
    async def connect(cls, host: str, port: int, tls: Tls, nursery: trio.Nursery,
                      on_notify: Callable[[m.NameChanges], None] | None = None,
                      request_timeout_s: float | None = None) -> "RemoteMaster":
        """Connects (TLS, the master's certificate must have role master) and starts the
        receiver task in `nursery`."""
        frames = await connect(host, port, tls, MASTER_ROLE)
        master = cls(frames, on_notify, request_timeout_s)
        nursery.start_soon(master._receive_forever)
        nursery.start_soon(master._watch_deadlines)
        return master

    @property
    def epoch(self) -> int:
        """The leader epoch the master's Welcome announced (0: a single master)."""
        welcome = self._frames.welcome
        return welcome.epoch if welcome is not None else 0

    async def _receive_forever(self) -> None:
        try:
            while True:
                frame = await self._frames.receive()
                self.heard_at = trio.current_time()
                prefix, header = frame.prefix, frame.header
                if prefix.kind == FrameKind.NOTIFY:
                    changes = self._notifications.decode(header)
                    if self._on_notify is not None:
                        self._on_notify(changes)
                    continue
                pending = self._pending.pop(prefix.request_id, None)
                if pending is None:
                    self._late_answer(prefix.request_id, prefix.kind, header)
                    continue
                if prefix.kind == FrameKind.ERROR:
                    reply = self._errors.decode(header)
                    pending.error = MetadataError(reply.errno or errno.EIO, reply.message)
                elif prefix.kind == FrameKind.RESPONSE:
                    pending.response = self._response(type(pending.request), header)
                else:
                    raise ProtocolError(f"unexpected {prefix.kind.name} frame")
                pending.done.set()
        except (ProtocolError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            self._fail(error)
        finally:
            self._fail(EOFError("connection closed"))
            with trio.CancelScope(shield=True):
                await self._frames.aclose()

    def _response(self, request: type, header: bytes) -> Any:
        """A response decoded, its name changes applied (as if pushed just before it)."""
        response = self._decoders[request].decode(header)
        changes = getattr(response, "changes", None)
        if changes and self._on_notify is not None:
            self._on_notify(m.NameChanges(changes))
        return response

    def _late_answer(self, request_id: int, kind: FrameKind, header: bytes) -> None:
        """The answer to a request given up at its deadline: dropped, but the name changes
        it carries are applied, as those of any answer (they are not sent again). An id
        never given out, or answered already, is a peer out of step."""
        request = self._expired.pop(request_id, None)
        if request is None:
            raise ProtocolError(f"response to unknown request {request_id}")
        if kind == FrameKind.RESPONSE:
            self._response(request, header)
        elif kind != FrameKind.ERROR:
            raise ProtocolError(f"unexpected {kind.name} frame")
        self.late_answers += 1

    def _fail(self, error: Exception) -> None:
        if self.broken is None:
            self.broken = error
        for pending in self._pending.values():
            pending.error = MasterUnavailable(f"lost the connection to the master: {self.broken}")
            pending.done.set()
        self._pending.clear()
        self.closed.set()
        self._watching.cancel()

    async def _watch_deadlines(self) -> None:
        with self._watching:
            await self._watchdog.run(self._earliest, self._expire)

    def _earliest(self) -> float:
        return min((pending.deadline for pending in self._pending.values()), default=math.inf)

    async def _expire(self, now: float) -> None:
        """Fails the requests whose deadline passed; gives the connection up when the master
        has been silent for a whole `request_timeout_s`, not when a caller's shorter
        remainder ran out."""
        for request_id, pending in list(self._pending.items()):
            if pending.deadline > now:
                continue
            del self._pending[request_id]
            self._expired[request_id] = type(pending.request)
            if len(self._expired) > LATE_ANSWERS_KEPT:
                del self._expired[next(iter(self._expired))]
            pending.error, silent = self._timed_out(pending, now)
            pending.done.set()
            if silent:
                await self._give_up(pending.error)
                return

    def _timed_out(self, pending: _Pending, now: float) -> tuple[MasterUnavailable, bool]:
        """The error of a request not answered in time, and whether the master is silent."""
        timeout = pending.timeout or 0.0
        name = type(pending.request).__name__
        silent = now - self.heard_at
        if silent < (self.request_timeout_s or timeout):
            return MasterUnavailable(f"{name}: no answer from the master within {timeout:.1f} s"), False
        return MasterSilent(f"{name}: no answer from the master within {timeout:.1f} s (silent for "
                            f"{silent:.1f} s); giving up the connection"), True

    async def call(self, request: m.Request, timeout_s: float | None = None) -> Any:
        """The master's answer; `timeout_s` (else `request_timeout_s`) bounds the wait for it
        (the connection's watchdog; a send the master does not take ends when the connection is
        given up). The connection is given up only when the master has been silent
        for a whole `request_timeout_s`, not when a caller's shorter remainder ran out."""
        if self.broken is not None:
            raise MasterUnavailable(f"no connection to the master: {self.broken}")
        timeout = self.request_timeout_s if timeout_s is None else timeout_s
        request_id = self._next_id
        self._next_id += 1
        try:  # encoded before anything is sent: a request the wire cannot carry leaves the stream in step
            frame = encode_frame(FrameKind.REQUEST, request_id, request)
        except (OverflowError, TypeError, ValueError, msgspec.EncodeError, ProtocolError) as error:
            raise MetadataError(errno.EINVAL, f"{type(request).__name__}: a field the protocol cannot carry "
                                              f"({error})") from None
        now = trio.current_time()
        pending = _Pending(request, timeout, math.inf if timeout is None else now + max(0.0, timeout))
        if pending.deadline <= now:  # no time left at all: not sent
            error, silent = self._timed_out(pending, now)
            if silent:
                await self._give_up(error)
            else:
                await trio.lowlevel.checkpoint()
            raise error
        # The deadline is the connection's watchdog's to keep (kvfs.net.deadlines): no
        # cancel scope of the caller's own.
        self._pending[request_id] = pending
        self._watchdog.watch(pending.deadline)
        try:
            await self._send(frame)
            await pending.done.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            self._pending.pop(request_id, None)
            self._fail(error)
            raise MasterUnavailable(f"cannot reach the master: {error}") from None
        except trio.Cancelled:  # the caller gave up (as before, its answer, if any, is read and dropped)
            pending.deadline = math.inf
            raise
        if pending.error is not None:
            raise pending.error
        return pending.response

    async def _send(self, frame: bytes) -> None:
        """Sends a request's frame. Frames of callers that come while another is being sent
        wait in `_outgoing` and leave together after it, in one write: with many writers,
        one TLS record and one wake-up of the master for several requests (which it answers
        together, `MetadataServer`). The caller's frame is on its way (or the connection
        failed) when this returns."""
        self._outgoing.append(frame)
        lock = self._send_lock
        try:
            # Uncontended, the lock is taken without yielding, and the send does not yield
            # either: the caller's wait for the answer is its checkpoint (two turns of the
            # event loop less per request).
            await acquire(lock)  # (ours may have left with the holder's before we get it)
            try:
                while self._outgoing:
                    frames, self._outgoing = self._outgoing, []
                    try:
                        await self._frames.send_encoded(frames[0] if len(frames) == 1 else b"".join(frames),
                                                        checkpoint=False)
                    except trio.Cancelled:  # (a caller's deadline) the stream may hold part of a frame now
                        self._fail(EOFError("a request was cut off while being sent"))
                        raise
            finally:
                lock.release()
        except trio.Cancelled:  # while waiting: a frame not sent yet is not sent at all
            self._outgoing = [waiting for waiting in self._outgoing if waiting is not frame]
            raise

    async def _give_up(self, error: Exception) -> None:
        """Fails every request in flight and closes the connection (its receiver ends)."""
        self._fail(error)
        with trio.CancelScope(shield=True):
            await self._frames.aclose()

    async def aclose(self) -> None:
        self._fail(EOFError("closed"))
        await self._frames.aclose()
