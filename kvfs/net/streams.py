"""Frames on a connection: the I/O shell around the one parser (`kvfs.wire.protocol.FrameParser`).

`FrameStream` reads and writes whole frames on a trio stream; every connection (master
requests, peer data, RDMA control) starts as one, and the handshake (`kvfs.net.handshake`)
runs on it. `BlockingFrames` is the same parser on a plain socket for a worker thread: the
chunk reader takes each payload with one blocking `recv_into` straight into its buffer.
"""

from __future__ import annotations

import socket
from typing import Any, Callable

import trio

from kvfs.wire.protocol import (MAX_HEADER, MAX_PAYLOAD, Frame, FrameKind, FrameParser, Head, HeaderDecoder,
                                ProtocolError, encode_frame)

READ_SIZE = 65536  # bytes asked of the stream at a time once authenticated


class FrameStream:
    """Reads and writes whole frames on a trio stream.

    It starts with the limits it is given (the handshake's tiny ones on a new connection)
    and reads no more than those allow at a time; `authenticated()` lifts them."""

    def __init__(self, stream: trio.abc.Stream, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD) -> None:
        self.stream = stream
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

    async def send_encoded(self, frame: bytes) -> None:
        """A frame already encoded (`encode_frame`), payload-less or with its payload appended."""
        await self.stream.send_all(frame)

    async def aclose(self) -> None:
        await self.stream.aclose()


class BlockingFrames:
    """Frames on a blocking socket, for a worker thread: the head is read exactly (so nothing
    of the payload is buffered), the payload straight into the caller's buffer with one
    `recv_into(MSG_WAITALL)`. A peer silent for `timeout_s` raises TimeoutError (an OSError)."""

    def __init__(self, sock: socket.socket, parser: FrameParser, timeout_s: float) -> None:
        sock.setblocking(True)
        sock.settimeout(timeout_s)
        self.sock = sock
        self.parser = parser

    @classmethod
    def detach(cls, frames: FrameStream, timeout_s: float) -> BlockingFrames:
        """Takes over an authenticated `FrameStream` on a TCP socket; the trio stream is spent."""
        if frames.parser.buffered:
            raise ProtocolError(f"{frames.parser.buffered} unexpected bytes after the handshake")
        assert isinstance(frames.stream, trio.SocketStream)
        return cls(socket.socket(fileno=frames.stream.socket.detach()), frames.parser, timeout_s)

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
            count = self.sock.recv_into(target[got:], len(target) - got, socket.MSG_WAITALL)
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


def peer_name(stream: trio.SocketStream) -> Any:
    try:
        return stream.socket.getpeername()
    except OSError:
        return "?"
