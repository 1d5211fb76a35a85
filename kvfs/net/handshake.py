"""The handshake, once for every connection: `connect` (the connecting side) and `Gate` (the
accepting side, which refuses with a counted, logged reason).

The master's server and client, the peer server and both chunk transports open and accept
connections only through here, so that this is the one place that touches a new raw stream
before it is authenticated. The proofs and their order are pure (`kvfs.wire.auth`): the
client proves first, and the server sends nothing that depends on the secret before it has
checked the client's proof. Until then a connection is held to tiny frames (a hello or a
proof, no payload) and to `HANDSHAKE_TIMEOUT_S`.
"""

from __future__ import annotations

import errno
import logging
from typing import Any, Callable

import trio

from kvfs.wire.auth import (HANDSHAKE_MAX_HEADER, HANDSHAKE_MAX_PAYLOAD, AuthError, ClientHandshake,
                            HandshakeMessage, Hello, Proof, ServerHandshake)
from kvfs.wire.protocol import ErrorReply, FrameKind, HeaderDecoder, ProtocolError
from kvfs.wire.text import printable
from kvfs.net.streams import FrameStream, peer_name

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
REFUSAL_SEND_S = 0.5  # the refused peer gets this long to take our one-line reason
REFUSALS_LOGGED = 10  # refusal lines per REFUSAL_WINDOW_S and gate; the rest are counted, then told
REFUSAL_WINDOW_S = 10.0

# Who may connect to whom: a master serves nodes and command-line clients, a peer server nodes.
MASTER_CLIENTS = frozenset({"node", "client"})
PEER_CLIENTS = frozenset({"node"})

_messages = HeaderDecoder(HandshakeMessage)
_errors = HeaderDecoder(ErrorReply)

# What a failed handshake raises, on either side.
REFUSALS = (AuthError, ProtocolError, trio.TooSlowError, EOFError, trio.BrokenResourceError)


def _frames(stream: trio.abc.Stream) -> FrameStream:
    """A new connection's frames: a hello or a proof, nothing larger, until authenticated."""
    return FrameStream(stream, HANDSHAKE_MAX_HEADER, HANDSHAKE_MAX_PAYLOAD)


async def _receive(frames: FrameStream, kind: type) -> Any:
    frame = await frames.receive()
    if frame.prefix.kind == FrameKind.ERROR:  # the other side refused us, and said why
        raise AuthError(f"refused: {printable(_errors.decode(frame.header).message)}")
    if frame.prefix.kind != FrameKind.HELLO:
        raise ProtocolError(f"expected a {kind.__name__.lower()}, got a {frame.prefix.kind.name} frame")
    message = _messages.decode(frame.header)
    if not isinstance(message, kind):
        raise ProtocolError(f"expected a {kind.__name__.lower()}, got a {type(message).__name__.lower()}")
    return message


async def authenticate(frames: FrameStream, secret: bytes, role: str, server_role: str,
                       timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
    """The connecting side's handshake, as ROLE, with a server that must be SERVER_ROLE."""
    side = ClientHandshake(secret, role, frozenset({server_role}))
    with trio.fail_after(timeout_s):
        await frames.send(FrameKind.HELLO, 0, side.hello)
        await frames.send(FrameKind.HELLO, 0, side.answer(await _receive(frames, Hello)))
        side.verify(await _receive(frames, Proof))
    frames.authenticated()


async def connect(host: str, port: int, secret: bytes, role: str, server_role: str,
                  tune: Callable[[Any], None] | None = None) -> FrameStream:
    """An authenticated connection to the SERVER_ROLE ("master" or "peer") at HOST:PORT, as
    ROLE. `tune(socket)` runs before the handshake. Raises OSError, or one of REFUSALS;
    nothing is left open then."""
    stream = await trio.open_tcp_stream(host, port)
    try:
        if tune is not None:
            tune(stream.socket)
        frames = _frames(stream)
        await authenticate(frames, secret, role, server_role)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise
    return frames


class LogBudget:
    """At most `burst` log lines per `window_s`; the lines held back are counted, and the next
    line logged says how many (a flood of bad connections cannot flood the log)."""

    def __init__(self, burst: int = REFUSALS_LOGGED, window_s: float = REFUSAL_WINDOW_S) -> None:
        self.burst = burst
        self.window_s = window_s
        self._window_start = float("-inf")
        self._used = 0
        self._held = 0

    def take(self, now: float) -> tuple[bool, int]:
        """(whether to log this line, how many lines were held back before it)."""
        if now - self._window_start >= self.window_s:
            self._window_start, self._used = now, 0
        if self._used >= self.burst:
            self._held += 1
            return False, 0
        self._used += 1
        held, self._held = self._held, 0
        return True, held


class Gate:
    """The accepting side, as ROLE, for clients of CLIENT_ROLES: authenticates each new
    connection; one that fails is refused, counted (`refused`) and logged with its reason,
    peer-supplied text escaped and cut short."""

    def __init__(self, secret: bytes, role: str, client_roles: frozenset[str], what: str = "connection",
                 timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.secret = secret
        self.role = role
        self.client_roles = client_roles
        self.what = what
        self.timeout_s = timeout_s
        self.refused = 0
        self.log_budget = LogBudget()

    async def admit(self, stream: trio.SocketStream) -> tuple[FrameStream, str] | None:
        """(the authenticated frames, the client's role), or None: refused, the caller closes."""
        frames = _frames(stream)
        side = ServerHandshake(self.secret, self.role, self.client_roles)
        try:
            with trio.fail_after(self.timeout_s):
                hello = await _receive(frames, Hello)
                await frames.send(FrameKind.HELLO, 0, side.greet(hello))
                proof = side.verify(await _receive(frames, Proof))  # nothing secret-bound goes out before
                await frames.send(FrameKind.HELLO, 0, proof)
        except REFUSALS as error:
            await self._refuse(frames, stream, error)
            return None
        frames.authenticated()
        return frames, hello.role

    async def _refuse(self, frames: FrameStream, stream: trio.SocketStream, error: BaseException) -> None:
        self.refused += 1
        if isinstance(error, trio.TooSlowError):
            reason = f"no handshake within {self.timeout_s:g} s"
        else:
            reason = str(error) or type(error).__name__
        logged, held = self.log_budget.take(trio.current_time())
        if logged:
            log.warning("refused %s from %s: %s%s", self.what, peer_name(stream), printable(reason),
                        f" ({held} more refused before this one, not logged one by one)" if held else "")
        if isinstance(error, (AuthError, ProtocolError)):  # tell an honest client with the wrong secret why
            with trio.move_on_after(REFUSAL_SEND_S):
                try:
                    await frames.send(FrameKind.ERROR, 0, ErrorReply(errno.EACCES, "authentication failed"))
                except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                    pass
