"""Metadata requests over TCP: the trio adapter around the protocol and handshake.

`MetadataServer` serves a request handler (the master's `MetadataService.handle`)
to authenticated peers; `RemoteMaster` is the node's `MasterClient` for a master
in another process. Frames are parsed by `kvfs.cluster.protocol`; this module
only moves bytes. A peer that fails the handshake or sends an invalid frame is
disconnected with a logged reason; other connections are not affected.
"""

from __future__ import annotations

import errno
import logging
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

import trio

from kvfs.cluster import messages as m
from kvfs.cluster.auth import AuthError, HandshakeMessage, Hello, Proof, check, new_nonce, prove
from kvfs.cluster.protocol import (PREFIX_SIZE, ErrorReply, FrameKind, HeaderDecoder, Prefix, ProtocolError,
                                   encode_frame, parse_prefix)
from kvfs.errors import KvfsError, MetadataError

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
_ANY_REQUEST = typing.Union[tuple(m.Request.__subclasses__())]  # type: ignore[misc]


class FrameStream:
    """Reads and writes whole frames on a trio stream."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self._buffer = bytearray()

    async def _exactly(self, count: int) -> bytes:
        while len(self._buffer) < count:
            data = await self.stream.receive_some(max(65536, count - len(self._buffer)))
            if not data:
                raise EOFError("connection closed")
            self._buffer += data
        out = bytes(self._buffer[:count])
        del self._buffer[:count]
        return out

    async def receive(self) -> tuple[Prefix, bytes, bytes]:
        prefix = parse_prefix(await self._exactly(PREFIX_SIZE))
        header = await self._exactly(prefix.header_length)
        payload = await self._exactly(prefix.payload_length) if prefix.payload_length else b""
        return prefix, header, payload

    async def send(self, kind: FrameKind, request_id: int, header: Any, payload: bytes | memoryview = b"") -> None:
        await self.stream.send_all(encode_frame(kind, request_id, header, len(payload)))
        if payload:
            await self.stream.send_all(payload)


_handshake_decoder = HeaderDecoder(HandshakeMessage)


async def handshake(frames: FrameStream, secret: bytes, role: str) -> str:
    """Mutual authentication; returns the peer's role. Raises AuthError or ProtocolError."""
    nonce = new_nonce()
    with trio.fail_after(HANDSHAKE_TIMEOUT_S):
        await frames.send(FrameKind.HELLO, 0, Hello(role, nonce))
        prefix, header, _ = await frames.receive()
        hello = _handshake_decoder.decode(header)
        if prefix.kind != FrameKind.HELLO or not isinstance(hello, Hello):
            raise ProtocolError("expected a hello")
        await frames.send(FrameKind.HELLO, 0, Proof(prove(secret, role, nonce, hello.nonce)))
        prefix, header, _ = await frames.receive()
        proof = _handshake_decoder.decode(header)
        if prefix.kind != FrameKind.HELLO or not isinstance(proof, Proof):
            raise ProtocolError("expected a proof")
        check(secret, hello, proof, nonce)
    return hello.role


class MetadataServer:
    """Serves metadata requests to authenticated nodes and clients.

    `handle(request, caller)` answers one request; `caller` is the node id that
    registered on this connection (0 for a client that did not register)."""

    def __init__(self, handle: Callable[[m.Request, int], Any], secret: bytes) -> None:
        self.handle = handle
        self.secret = secret
        self._requests = HeaderDecoder(_ANY_REQUEST)
        self.refused = 0

    async def serve(self, host: str, port: int, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(port, host=host)
        task_status.started(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, stream: trio.SocketStream) -> None:
        try:
            peer = stream.socket.getpeername()
        except OSError:
            peer = "?"
        frames = FrameStream(stream)
        async with stream:
            try:
                role = await handshake(frames, self.secret, "master")
            except (AuthError, ProtocolError, trio.TooSlowError, EOFError, trio.BrokenResourceError) as error:
                self.refused += 1
                log.warning("refused connection from %s: %s", peer, error or type(error).__name__)
                return
            log.info("%s connected from %s", role, peer)
            caller = 0
            try:
                while True:
                    prefix, header, payload = await frames.receive()
                    if prefix.kind != FrameKind.REQUEST or payload:
                        raise ProtocolError(f"unexpected {prefix.kind.name} frame with {len(payload)} payload bytes")
                    request = self._requests.decode(header)
                    try:
                        response = self.handle(request, caller)
                        if isinstance(response, m.Registered):  # this connection now speaks for that node
                            caller = response.node
                            log.info("%s at %s registered as node %d", role, peer, caller)
                        await frames.send(FrameKind.RESPONSE, prefix.request_id, response)
                    except KvfsError as error:
                        await frames.send(FrameKind.ERROR, prefix.request_id, ErrorReply(error.errno, str(error)))
            except ProtocolError as error:
                log.warning("closing connection from %s: %s", peer, error)
            except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                log.info("%s at %s disconnected", role, peer)


class MasterUnavailable(MetadataError):
    """The connection to the master broke; the request may or may not have been applied."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


@dataclass(eq=False)
class _Pending:
    request: m.Request
    done: trio.Event = field(default_factory=trio.Event)
    response: Any = None
    error: Exception | None = None


class RemoteMaster:
    """A `MasterClient` for a master in another process: requests are pipelined on one
    connection and matched to their responses by id by a receiver task."""

    def __init__(self, frames: FrameStream) -> None:
        self._frames = frames
        self._send_lock = trio.Lock()
        self._next_id = 1
        self._pending: dict[int, _Pending] = {}
        self._decoders = {request: HeaderDecoder(response) for request, response in m.RESPONSE_TYPES.items()}
        self._errors = HeaderDecoder(ErrorReply)
        self.broken: Exception | None = None
        self.closed = trio.Event()

    @classmethod
    async def connect(cls, host: str, port: int, secret: bytes, nursery: trio.Nursery,
                      role: str = "node") -> "RemoteMaster":
        """Connects, authenticates, and starts the receiver task in `nursery`."""
        stream = await trio.open_tcp_stream(host, port)
        frames = FrameStream(stream)
        try:
            await handshake(frames, secret, role)
        except BaseException:
            await stream.aclose()
            raise
        master = cls(frames)
        nursery.start_soon(master._receive_forever)
        return master

    async def _receive_forever(self) -> None:
        try:
            while True:
                prefix, header, _ = await self._frames.receive()
                pending = self._pending.pop(prefix.request_id, None)
                if pending is None:
                    raise ProtocolError(f"response to unknown request {prefix.request_id}")
                if prefix.kind == FrameKind.ERROR:
                    reply = self._errors.decode(header)
                    pending.error = MetadataError(reply.errno or errno.EIO, reply.message)
                elif prefix.kind == FrameKind.RESPONSE:
                    pending.response = self._decoders[type(pending.request)].decode(header)
                else:
                    raise ProtocolError(f"unexpected {prefix.kind.name} frame")
                pending.done.set()
        except (ProtocolError, EOFError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            self._fail(error)
        finally:
            self._fail(EOFError("connection closed"))
            with trio.CancelScope(shield=True):
                await self._frames.stream.aclose()

    def _fail(self, error: Exception) -> None:
        if self.broken is None:
            self.broken = error
        for pending in self._pending.values():
            pending.error = MasterUnavailable(f"lost the connection to the master: {self.broken}")
            pending.done.set()
        self._pending.clear()
        self.closed.set()

    async def call(self, request: m.Request) -> Any:
        if self.broken is not None:
            raise MasterUnavailable(f"no connection to the master: {self.broken}")
        request_id = self._next_id
        self._next_id += 1
        pending = self._pending[request_id] = _Pending(request)
        try:
            async with self._send_lock:
                await self._frames.send(FrameKind.REQUEST, request_id, request)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as error:
            self._pending.pop(request_id, None)
            self._fail(error)
            raise MasterUnavailable(f"cannot reach the master: {error}") from None
        await pending.done.wait()
        if pending.error is not None:
            raise pending.error
        return pending.response

    async def aclose(self) -> None:
        self._fail(EOFError("closed"))
        await self._frames.stream.aclose()
