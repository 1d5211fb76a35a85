"""Frames on a connection: the I/O shell around the one parser (`kvfs.wire.protocol.FrameParser`).

Every connection is TLS 1.3 (`kvfs.net.handshake` sets it up). `TlsStream` is a trio stream
over a non-blocking `ssl.SSLSocket`, rather than trio's SSLStream over memory buffers, so
that the same socket can be handed to a worker thread for bulk chunk bytes: the owner
encrypts a chunk's payload there (`send_all_blocking`), and the reader switches the socket
to blocking mode and decrypts each payload straight into its buffer (`BlockingFrames`).
OpenSSL releases the GIL while it encrypts and decrypts, so neither stalls the event loop.

A peer data connection between two nodes is set up in TLS as every other one, then leaves
it (`TlsStream.unwrap`: the TLS shutdown, after which the same TCP socket carries other
bytes): into kvfs's own AEAD records (`TlsStream.seal`, a `kvfs.net.sealed.SealedSocket`
over the TCP socket: peer encryption on, the default), or into plain frames when both nodes
run with peer encryption off. From then on `TlsStream`, `send_some` and `BlockingFrames`
work on the sealed or plain socket in the same way.

`FrameStream` reads and writes whole frames on a trio stream; every connection (master
requests, peer data, RDMA control) starts as one.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any, Callable

import trio

from kvfs.wire.protocol import (MAX_HEADER, MAX_PAYLOAD, Frame, FrameKind, FrameParser, Head, HeaderDecoder,
                                ProtocolError, encode_frame)
from kvfs.net.sealed import SealedSocket

Socket = ssl.SSLSocket | socket.socket | SealedSocket

READ_SIZE = 65536  # bytes asked of the stream at a time once authenticated


class TlsStream(trio.abc.Stream):
    """A trio stream over a non-blocking TLS socket (handshake done by `handshake()`), or over
    the plain socket it leaves once `unwrap()` ends TLS on the connection (`plaintext`), or
    over kvfs's records on that socket once `seal()` put them on (`sealed`).

    TLS keeps state across a write that could not finish: a send cut short (cancelled) leaves
    the stream broken, and every later use raises BrokenResourceError."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        sock.setblocking(False)
        self.socket: Socket = sock
        self.plaintext = False  # TLS ended: the socket is a plain or a sealed one
        self.sealed = False
        self._broken: str | None = None
        self._closed = False

    async def handshake(self) -> None:
        """The TLS handshake (the caller bounds it in time)."""
        if await self._retry(self.socket.do_handshake) == b"":
            raise trio.BrokenResourceError("the peer closed the connection during the TLS handshake")

    def _check_usable(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the connection is closed")
        if self._broken is not None:
            raise trio.BrokenResourceError(self._broken)

    async def _retry(self, call: Callable[[], Any], checkpoint: bool = True) -> Any:
        self._check_usable()
        waited = False
        while True:
            try:
                result = call()
            except ssl.SSLWantReadError:
                await trio.lowlevel.wait_readable(self.socket)
                waited = True
            except ssl.SSLWantWriteError:
                await trio.lowlevel.wait_writable(self.socket)
                waited = True
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            except (ssl.SSLError, OSError) as error:
                self._broken = f"TLS connection failed: {error}"
                raise trio.BrokenResourceError(self._broken) from error
            else:
                if not waited and checkpoint:  # (a wait is a checkpoint already: one more step is CPU for nothing)
                    await trio.lowlevel.checkpoint()  # a peer that always has data must not starve the others
                return result

    async def unwrap(self) -> None:
        """Ends TLS on this connection, both sides agreeing (each calls it): sends the TLS
        close_notify and waits for the peer's; the same TCP connection then carries plain
        bytes. OpenSSL reads records exactly (no read-ahead), so nothing the peer sends in
        the clear after its close_notify is swallowed by TLS."""
        sock = self.socket
        assert isinstance(sock, ssl.SSLSocket) and not self.plaintext
        if await self._retry(sock.unwrap) == b"":  # the peer closed the connection instead
            self._broken = "the peer closed the connection while leaving TLS"
            raise trio.BrokenResourceError(self._broken)
        plain = socket.socket(fileno=sock.detach())
        plain.setblocking(False)
        self.socket = plain
        self.plaintext = True

    def seal(self, send_key: bytes, receive_key: bytes) -> None:
        """Puts kvfs's records (kvfs.net.sealed) on the socket `unwrap()` left: every byte from
        now on is sealed with SEND_KEY and opened with RECEIVE_KEY."""
        assert isinstance(self.socket, socket.socket) and self.plaintext and not self.sealed
        self.socket = SealedSocket(self.socket, send_key, receive_key)
        self.sealed = True

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self.plaintext:
            return await self._plain(lambda: self.socket.recv(max_bytes or READ_SIZE), readable=True)
        # A TLS record holds at most 16 KiB: asking for more only allocates more per call.
        return await self._retry(lambda: self.socket.recv(min(max_bytes or READ_SIZE, READ_SIZE)))

    async def send_all(self, data: bytes | bytearray | memoryview, checkpoint: bool = True) -> None:
        """Sends everything. `checkpoint=False`: a TLS send that did not have to wait does not
        yield to other tasks either (for a caller whose next step is a wait: one turn of the
        event loop less per request); after `unwrap()` the flag changes nothing."""
        view = memoryview(data)
        if not len(view):
            return await trio.lowlevel.checkpoint()
        try:
            if self.plaintext:
                while len(view):
                    view = view[await self._plain(lambda: self.socket.send(view), readable=False):]
            else:  # one write: OpenSSL keeps its progress across retries of the same buffer
                await self._retry(lambda: self.socket.send(view), checkpoint)
        except trio.Cancelled:
            self._broken = "a send was cut short"
            raise

    async def _plain(self, call: Callable[[], Any], readable: bool) -> Any:
        """One recv or send on the plain socket, once it can go on."""
        self._check_usable()
        waited = False
        while True:
            try:
                result = call()
            except BlockingIOError:
                await (trio.lowlevel.wait_readable if readable else trio.lowlevel.wait_writable)(self.socket)
                waited = True
            except OSError as error:
                self._broken = f"connection failed: {error}"
                raise trio.BrokenResourceError(self._broken) from error
            else:
                if not waited:
                    await trio.lowlevel.checkpoint()
                return result

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.wait_writable(self.socket)

    def peer_certificate(self) -> dict[str, Any] | None:
        assert isinstance(self.socket, ssl.SSLSocket)
        return self.socket.getpeercert()

    def detach(self) -> Socket:
        """The socket, for a worker thread; this stream is spent."""
        if self._broken is not None:
            raise trio.BrokenResourceError(self._broken)
        self._closed = True
        return self.socket

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            trio.lowlevel.notify_closing(self.socket)
            self.socket.close()
        await trio.lowlevel.checkpoint()


def send_some(sock: Socket, view: memoryview) -> int:
    """Writes what a non-blocking socket takes of VIEW now, from a worker thread; returns how
    many bytes. On TLS that is all of it or 0 (call again with the same view once the socket
    is writable: OpenSSL keeps its progress across retries of the same buffer); on a plain
    socket, as much as its buffer takes; on a sealed one, whole records (each encrypted once:
    the rest of one the socket did not take goes first on the next call, with the same view)."""
    if isinstance(sock, ssl.SSLSocket):
        try:
            sock.send(view)
        except ssl.SSLWantWriteError:
            return 0
        return len(view)
    sent = 0
    while sent < len(view):
        try:
            sent += sock.send(view[sent:])
        except BlockingIOError:
            break
    return sent


class FrameStream:
    """Reads and writes whole frames on a trio stream.

    It starts with the limits it is given (the handshake's tiny ones on a new connection)
    and reads no more than those allow at a time; `authenticated()` lifts them."""

    def __init__(self, stream: trio.abc.Stream, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD) -> None:
        self.stream = stream
        self.peer: Any = None  # the other side's identity (kvfs.security.credentials.Identity), once admitted
        self.plaintext = False  # TLS ended after admission (peer encryption off on both ends)
        self.sealed = False  # TLS ended after admission, for kvfs's records (kvfs.net.sealed)
        self.welcome: Any = None  # the server's Welcome (kvfs.wire.auth), on a connection this side opened
        self.parser = FrameParser(max_header, max_payload)
        self._read_size = min(READ_SIZE, max_header + max_payload + 64)

    def authenticated(self) -> None:
        """The peer proved itself: frames of any size the protocol allows from now on."""
        self.parser.limit(MAX_HEADER, MAX_PAYLOAD)
        self._read_size = READ_SIZE

    async def receive(self) -> Frame:
        """The next whole frame. Raises EOFError when the peer closed, ProtocolError on a bad frame."""
        while (frame := self.parser.next_frame()) is None:
            data = await self.stream.receive_some(max(self._read_size, self.parser.wanted()))
            if not data:
                raise EOFError("connection closed")
            self.parser.feed(data)
        return frame

    async def receive_request(self, decoder: HeaderDecoder) -> tuple[int, Any]:
        """The next frame, which must be a request without payload: (request id, request)."""
        frame = await self.receive()
        if frame.prefix.kind != FrameKind.REQUEST or frame.payload:
            raise ProtocolError(f"unexpected {frame.prefix.kind.name} frame with {len(frame.payload)} payload bytes")
        return frame.prefix.request_id, decoder.decode(frame.header)

    async def send(self, kind: FrameKind, request_id: int, header: Any, payload: bytes | memoryview = b"") -> None:
        await self.stream.send_all(encode_frame(kind, request_id, header, len(payload)))
        if payload:
            await self.stream.send_all(payload)

    async def send_encoded(self, frame: bytes, checkpoint: bool = True) -> None:
        """A frame already encoded (`encode_frame`), payload-less or with its payload appended.
        `checkpoint=False` (a TlsStream only): see `TlsStream.send_all`."""
        if checkpoint:
            await self.stream.send_all(frame)
        else:
            assert isinstance(self.stream, TlsStream)
            await self.stream.send_all(frame, checkpoint=False)

    async def aclose(self) -> None:
        await self.stream.aclose()


class BlockingFrames:
    """Frames on a blocking TLS (or sealed, or plain, once unwrapped) socket, for a worker
    thread: the head is read exactly (so nothing of the payload is buffered), the payload
    decrypted (or received) straight into the caller's buffer. A peer silent for `timeout_s`
    raises TimeoutError (an OSError); a sealed record that fails authentication,
    SealedRecordError (a ProtocolError)."""

    def __init__(self, sock: Socket, parser: FrameParser, timeout_s: float) -> None:
        sock.setblocking(True)
        sock.settimeout(timeout_s)
        self.sock = sock
        self.parser = parser

    @classmethod
    def detach(cls, frames: FrameStream, timeout_s: float) -> BlockingFrames:
        """Takes over an authenticated `FrameStream` on a TLS socket (or one unwrapped, sealed or
        plain); the trio stream is spent."""
        if frames.parser.buffered:
            raise ProtocolError(f"{frames.parser.buffered} unexpected bytes after the handshake")
        assert isinstance(frames.stream, TlsStream)
        return cls(frames.stream.detach(), frames.parser, timeout_s)

    def send(self, kind: FrameKind, request_id: int, header: Any) -> None:
        self.sock.sendall(encode_frame(kind, request_id, header))

    def receive_head(self) -> Head:
        while (head := self.parser.next_head()) is None:
            data = bytearray(self.parser.wanted())
            self._receive_exactly(memoryview(data))
            self.parser.feed(data)
        return head

    def receive_payload(self, target: memoryview) -> None:
        """The last head's payload, which must be exactly `len(target)` bytes, into `target`."""
        rest = target[self.parser.drain_payload(target):]
        self._receive_exactly(rest)
        self.parser.payload_received(len(rest))

    def _receive_exactly(self, target: memoryview) -> None:
        got = 0
        while got < len(target):
            try:
                count = self.sock.recv_into(target[got:], len(target) - got)  # a TLS record at most
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                count = 0
            if count == 0:
                raise EOFError("the peer closed the connection")
            got += count

    def close(self) -> None:
        self.sock.close()


async def serve_tcp(handler: Callable[[trio.SocketStream], Any], host: str, port: int,
                    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serves connections on HOST:PORT; reports the bound port (PORT 0 picks a free one)."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(handler, listeners)


def peer_name(stream: Any) -> Any:
    """The address of a trio SocketStream's or a TlsStream's peer, for log lines."""
    try:
        return stream.socket.getpeername()
    except OSError:
        return "?"
