"""The handshake, once for every connection: `connect` (the connecting side) and `Gate` (the
accepting side, which refuses with a counted, logged reason).

The master's server and client, the peer server and both chunk transports open and accept
connections only through here, so that this is the one place that touches a new raw stream
before it is authenticated. The proofs themselves are pure (`kvfs.wire.auth`).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import trio

from kvfs.wire.auth import AuthError, HandshakeMessage, Hello, Proof, check, new_nonce, prove
from kvfs.wire.protocol import FrameKind, HeaderDecoder, ProtocolError
from kvfs.net.streams import FrameStream, peer_name

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0

_messages = HeaderDecoder(HandshakeMessage)

# What a failed handshake raises, on either side.
REFUSALS = (AuthError, ProtocolError, trio.TooSlowError, EOFError, trio.BrokenResourceError)


async def _receive(frames: FrameStream, kind: type) -> Any:
    frame = await frames.receive()
    message = _messages.decode(frame.header)
    if frame.prefix.kind != FrameKind.HELLO or not isinstance(message, kind):
        raise ProtocolError(f"expected a {kind.__name__.lower()}")
    return message


async def _authenticate(frames: FrameStream, secret: bytes, role: str) -> str:
    """Mutual authentication; returns the peer's role. Raises AuthError or ProtocolError."""
    nonce = new_nonce()
    await frames.send(FrameKind.HELLO, 0, Hello(role, nonce))
    hello = await _receive(frames, Hello)
    await frames.send(FrameKind.HELLO, 0, Proof(prove(secret, role, nonce, hello.nonce)))
    proof = await _receive(frames, Proof)
    check(secret, hello, proof, nonce)
    return hello.role


async def authenticate(frames: FrameStream, secret: bytes, role: str,
                       timeout_s: float = HANDSHAKE_TIMEOUT_S) -> str:
    """The connecting side's handshake on an open stream; returns the server's role."""
    with trio.fail_after(timeout_s):
        server_role = await _authenticate(frames, secret, role)
    frames.authenticated()
    return server_role


async def connect(host: str, port: int, secret: bytes, role: str,
                  tune: Callable[[Any], None] | None = None) -> FrameStream:
    """An authenticated connection to HOST:PORT as ROLE. `tune(socket)` runs before the
    handshake. Raises OSError, or one of REFUSALS; nothing is left open then."""
    stream = await trio.open_tcp_stream(host, port)
    try:
        if tune is not None:
            tune(stream.socket)
        frames = FrameStream(stream)
        await authenticate(frames, secret, role)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise
    return frames


class Gate:
    """The accepting side: authenticates each new connection; a connection that fails is
    refused, counted (`refused`) and logged with its reason."""

    def __init__(self, secret: bytes, role: str, what: str = "connection",
                 timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.secret = secret
        self.role = role
        self.what = what
        self.timeout_s = timeout_s
        self.refused = 0

    async def admit(self, stream: trio.SocketStream) -> tuple[FrameStream, str] | None:
        """(the authenticated frames, the peer's role), or None: refused, the caller closes."""
        frames = FrameStream(stream)
        try:
            with trio.fail_after(self.timeout_s):
                peer_role = await _authenticate(frames, self.secret, self.role)
        except REFUSALS as error:
            self.refused += 1
            log.warning("refused %s from %s: %s", self.what, peer_name(stream), error or type(error).__name__)
            return None
        frames.authenticated()
        return frames, peer_role
