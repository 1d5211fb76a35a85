"""Connection setup, once for every connection: `connect` (the connecting side) and `Gate`
(the accepting side, which refuses with a counted, logged reason).

Every connection is TLS 1.3 with a certificate on each side, issued by the cluster's CA
(kvfs.security): TLS authenticates both ends and protects every frame (encrypted, with
per-record integrity and sequence numbers, so nothing can be injected or replayed). The
identity is the certificate's name and role; the rules of who may connect to whom are in
kvfs.cluster.authority. After TLS the server checks the client's role and answers with a
`Welcome` or an ERROR frame that says why not.

A peer port (a node's, a gate of PEER_CLIENTS) moves every admitted connection out of TLS,
inside the setup's time limit: its Welcome carries 32 random bytes of the server's, the
client answers (`Encryption`) with 32 of its own, and both sides end TLS (`TlsStream.unwrap`)
and carry the connection's frames in kvfs's own AEAD records, keyed from both secrets
(kvfs.net.sealed). A peer port of a node with peer encryption off also offers, in its
Welcome, to carry the frames in the clear; when the client runs with peer encryption off
too, the connection leaves TLS into plain frames instead. Identities are authenticated and
refusals made exactly as before; only the frames after admission change. Offer, answer and
secrets travel inside TLS, so nobody on the path learns the keys or can turn encryption
off, and an end that keeps it on keeps the connection encrypted.

Nodes of a cluster are upgraded together: a node that speaks no records is refused, with a
reason on both sides (its requests are answered with an ERROR frame saying so, and a client
that requires records, `connect(sealed=True)`, refuses a server that does not offer them).
Master connections stay in TLS.

Before that, a connection costs little: the gate holds at most `max_handshakes` of them at
once (and `max_per_source` per source address), each for at most `timeout_s`, with tiny
frame limits, and takes new connections from one address at a bounded rate (each costs a
TLS handshake's public-key operations); a connection beyond the limits is closed at once. Every refusal is counted
(`refused`, by reason in `refusals`) and logged within a budget, peer text escaped.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import socket
import ssl
from typing import Any, Callable

import trio

from kvfs.cluster.authority import MASTER_CLIENTS, PEER_CLIENTS, may_connect
from kvfs.security.credentials import Identity, Tls, identity_of_peer
from kvfs.wire.auth import HANDSHAKE_MAX_HEADER, HANDSHAKE_MAX_PAYLOAD, AuthError, Encryption, Welcome
from kvfs.wire.protocol import ErrorReply, FrameKind, HeaderDecoder, ProtocolError
from kvfs.wire.text import printable
from kvfs.net.sealed import SECRET_SIZE, derive_keys
from kvfs.net.streams import FrameStream, TlsStream, peer_name

__all__ = ["MASTER_CLIENTS", "PEER_CLIENTS", "REFUSALS", "Gate", "LogBudget", "connect"]

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
MAX_HANDSHAKES = 256  # connections in setup at once, per server
MAX_HANDSHAKES_PER_SOURCE = 32  # of those, from one source address
SOURCE_RATE = 50.0  # new connections per second and source address, sustained ...
SOURCE_BURST = 200  # ... and at once (a node's pool, a restart of many clients)
SOURCES_TRACKED = 4096  # source addresses remembered for the rate (the longest idle forgotten first)
REFUSAL_SEND_S = 0.5  # the refused peer gets this long to take our one-line reason
REFUSALS_LOGGED = 10  # refusal lines per REFUSAL_WINDOW_S and gate; the rest are counted, then told
REFUSAL_WINDOW_S = 10.0

_welcomes = HeaderDecoder(Welcome)
_errors = HeaderDecoder(ErrorReply)
_encryptions = HeaderDecoder(Encryption)

# What a failed setup raises, on either side.
REFUSALS = (AuthError, ProtocolError, ssl.SSLError, trio.TooSlowError, EOFError, trio.BrokenResourceError)


def _frames(stream: TlsStream) -> FrameStream:
    """A new connection's frames: a welcome or a refusal, nothing larger, until admitted."""
    return FrameStream(stream, HANDSHAKE_MAX_HEADER, HANDSHAKE_MAX_PAYLOAD)


def _wrap(stream: trio.SocketStream, context: ssl.SSLContext, server_side: bool) -> TlsStream:
    """The TCP connection's socket under TLS (the trio stream is spent; the TlsStream owns it)."""
    sock = socket.socket(fileno=stream.socket.detach())
    sock.setblocking(False)
    try:
        return TlsStream(context.wrap_socket(sock, server_side=server_side, do_handshake_on_connect=False))
    except BaseException:
        sock.close()
        raise


async def _leave_tls(frames: FrameStream, keys: tuple[bytes, bytes] | None = None) -> None:
    """Ends TLS on an admitted connection (both sides agreed); its frames go on in the clear,
    or in kvfs's records with KEYS (this side's sending key, its receiving key)."""
    if frames.parser.buffered:  # the peer sent frames before TLS ended: not this protocol
        raise ProtocolError(f"{frames.parser.buffered} bytes before the end of TLS")
    assert isinstance(frames.stream, TlsStream)
    await frames.stream.unwrap()
    if keys is None:
        frames.plaintext = True
    else:
        frames.stream.seal(*keys)
        frames.sealed = True


def _secret(offered: bytes, who: str) -> bytes:
    if len(offered) != SECRET_SIZE:
        raise ProtocolError(f"{who} offered a record secret of {len(offered)} bytes, not {SECRET_SIZE}")
    return offered


OLD_PEER = ("speaks no kvfs peer records (kvfs.net.sealed): a node of an older kvfs? The nodes of a cluster "
            "are upgraded together")


async def connect(host: str, port: int, tls: Tls, server_role: str,
                  tune: Callable[[Any], None] | None = None,
                  timeout_s: float = HANDSHAKE_TIMEOUT_S, plaintext: bool = False,
                  sealed: bool = False) -> FrameStream:
    """An admitted connection to the server at HOST:PORT, whose certificate must have
    SERVER_ROLE ("master", or "node" for a peer). `tune(socket)` runs before TLS. Raises
    OSError, or one of REFUSALS; nothing is left open then. The server's identity is the
    returned stream's `peer`. A server that offers kvfs's records gets them (the returned
    stream's `sealed`); SEALED: refuse a server that does not (AuthError). PLAINTEXT: leave
    TLS for plain frames instead if the server offers that too (a peer with peer encryption
    off); the returned stream's `plaintext` says if it did."""
    stream = await trio.open_tcp_stream(host, port)
    try:
        if tune is not None:
            tune(stream.socket)
        tls_stream = _wrap(stream, tls.client, server_side=False)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stream.aclose()
        raise
    try:
        with trio.fail_after(timeout_s):
            await tls_stream.handshake()
            server = identity_of_peer(tls_stream.peer_certificate())
            if server.role != server_role:
                raise AuthError(f"{host}:{port} is {server}, not a {server_role}")
            frames = _frames(tls_stream)
            frame = await frames.receive()
            if frame.prefix.kind == FrameKind.ERROR:  # the server refused us, and said why
                raise AuthError(f"refused: {printable(_errors.decode(frame.header).message)}")
            if frame.prefix.kind != FrameKind.HELLO:
                raise ProtocolError(f"expected a welcome, got a {frame.prefix.kind.name} frame")
            welcome = _welcomes.decode(frame.header)
            plain = plaintext and welcome.plaintext
            if sealed and not plain and not welcome.sealed:
                raise AuthError(f"{host}:{port} ({printable(welcome.name)}) {OLD_PEER}")
            if welcome.plaintext or welcome.sealed:  # the server offers to leave TLS and waits for our answer
                secret = os.urandom(SECRET_SIZE) if welcome.sealed else b""
                await frames.send(FrameKind.HELLO, 0, Encryption(plaintext, secret))
                if plain:
                    await _leave_tls(frames)
                elif welcome.sealed:
                    to_server, to_client = derive_keys(_secret(welcome.sealed, "the server"), secret)
                    await _leave_tls(frames, (to_server, to_client))
    except trio.BrokenResourceError as error:
        with trio.CancelScope(shield=True):
            await tls_stream.aclose()
        if isinstance(error.__cause__, ssl.SSLError):  # a certificate the other side does not accept
            raise AuthError(f"{host}:{port}: {error}") from None
        raise
    except BaseException:
        with trio.CancelScope(shield=True):
            await tls_stream.aclose()
        raise
    frames.authenticated()
    frames.peer = server
    frames.welcome = welcome
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


class SourceRate:
    """A token bucket per source address: `rate` new connections a second, `burst` at once.
    At most `tracked` sources are remembered; the one idle longest is forgotten first (a
    forgotten source starts with a full bucket, which is what an idle one has anyway)."""

    def __init__(self, rate: float = SOURCE_RATE, burst: int = SOURCE_BURST, tracked: int = SOURCES_TRACKED) -> None:
        self.rate = rate
        self.burst = burst
        self.tracked = tracked
        self._buckets: collections.OrderedDict[str, tuple[float, float]] = collections.OrderedDict()

    def take(self, source: str, now: float) -> bool:
        """Whether a new connection from SOURCE may go on now."""
        tokens, last = self._buckets.pop(source, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - last) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[source] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > self.tracked:
            self._buckets.popitem(last=False)
        return allowed


class Gate:
    """The accepting side, with TLS, for clients of CLIENT_ROLES: sets up each new connection;
    one that fails is refused, counted and logged with its reason. `epoch()` is what the
    Welcome announces (a master elected through etcd: its leadership's epoch)."""

    def __init__(self, tls: Tls, client_roles: frozenset[str], what: str = "connection",
                 timeout_s: float = HANDSHAKE_TIMEOUT_S, max_handshakes: int = MAX_HANDSHAKES,
                 max_per_source: int = MAX_HANDSHAKES_PER_SOURCE, epoch: Callable[[], int] = lambda: 0,
                 plaintext: bool = False, sealed: bool | None = None) -> None:
        self.tls = tls
        self.plaintext = plaintext  # offer to leave TLS after admission (a peer port, peer encryption off)
        self.plaintext_admitted = 0  # connections that did
        # Leave TLS for kvfs's records after admission: what a peer port does (the default for
        # a gate of peer clients); master connections stay in TLS.
        self.sealed = client_roles == PEER_CLIENTS if sealed is None else sealed
        self.sealed_admitted = 0  # connections that did
        self.epoch = epoch
        self.client_roles = client_roles
        self.what = what
        self.timeout_s = timeout_s
        self.max_handshakes = max_handshakes
        self.max_per_source = max_per_source
        self.handshaking = 0
        self._per_source: collections.Counter[str] = collections.Counter()
        self.source_rate = SourceRate()
        # by reason: tls, role, timeout, busy, version (a client without kvfs's records)
        self.refusals: collections.Counter[str] = collections.Counter()
        self.log_budget = LogBudget()

    @property
    def refused(self) -> int:
        return sum(self.refusals.values())

    async def admit(self, stream: trio.SocketStream) -> tuple[FrameStream, Identity] | None:
        """(the admitted frames, the client's identity), or None: refused. Admitted, the frames
        own the connection (the caller closes them); the caller closes `stream` in any case
        (a no-op once TLS took its socket)."""
        peer = peer_name(stream)
        source = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        if self.handshaking >= self.max_handshakes or self._per_source[source] >= self.max_per_source:
            self._count("busy", peer, f"{self.handshaking} connections in setup ({self._per_source[source]} from "
                                      f"this address): closed at once")
            return None
        if not self.source_rate.take(source, trio.current_time()):
            self._count("busy", peer, f"more than {self.source_rate.rate:g} new connections a second from this "
                                      f"address: closed at once")
            return None
        self.handshaking += 1
        self._per_source[source] += 1
        try:
            return await self._admit(stream, peer)
        finally:
            self.handshaking -= 1
            self._per_source[source] -= 1
            if not self._per_source[source]:
                del self._per_source[source]

    async def _admit(self, stream: trio.SocketStream, peer: Any) -> tuple[FrameStream, Identity] | None:
        try:
            tls_stream = _wrap(stream, self.tls.server, server_side=True)
        except (OSError, ssl.SSLError) as error:  # gone already (reset before we got to it)
            self._count("tls", peer, str(error) or type(error).__name__)
            return None
        frames = _frames(tls_stream)
        try:
            with trio.fail_after(self.timeout_s):
                await tls_stream.handshake()
                client = identity_of_peer(tls_stream.peer_certificate())
                if not may_connect(client.role, self.client_roles):
                    await self._refuse_role(frames, peer, client)
                    await tls_stream.aclose()
                    return None
                secret = os.urandom(SECRET_SIZE) if self.sealed else b""
                await frames.send(FrameKind.HELLO, 0, Welcome(self.tls.identity.name, self.tls.identity.role,
                                                                  self.epoch(), self.plaintext, secret))
                if (self.plaintext or self.sealed) and not await self._leave_tls(frames, peer, client, secret):
                    await tls_stream.aclose()
                    return None
        except REFUSALS as error:
            if isinstance(error, trio.TooSlowError):
                self._count("timeout", peer, f"no TLS handshake within {self.timeout_s:g} s")
            else:
                self._count("tls", peer, str(error) or type(error).__name__)
            await tls_stream.aclose()
            return None
        except BaseException:
            with trio.CancelScope(shield=True):
                await tls_stream.aclose()
            raise
        frames.authenticated()
        frames.peer = client
        self.plaintext_admitted += frames.plaintext
        self.sealed_admitted += frames.sealed
        return frames, client

    async def _leave_tls(self, frames: FrameStream, peer: Any, client: Identity, secret: bytes) -> bool:
        """The client's answer to our offer to leave TLS, and the move: to plain frames when it
        runs without encryption too (and we offered that), else to kvfs's records (when we offered
        them). False: refused (a client that speaks no records: told why, counted)."""
        frame = await frames.receive()
        if frame.prefix.kind == FrameKind.REQUEST and self.sealed:  # an older client, asking in TLS
            await self._refuse_version(frames, peer, client, frame.prefix.request_id)
            return False
        if frame.prefix.kind != FrameKind.HELLO or frame.payload:
            raise ProtocolError(f"expected an answer to the offer to leave TLS, got a {frame.prefix.kind.name} "
                                f"frame")
        answer = _encryptions.decode(frame.header)
        if self.plaintext and answer.plaintext:
            await _leave_tls(frames)
        elif self.sealed and answer.sealed:
            to_server, to_client = derive_keys(secret, _secret(answer.sealed, "the client"))
            await _leave_tls(frames, (to_client, to_server))
        elif self.sealed:  # an older client that keeps TLS: its first request gets our reason
            with trio.move_on_after(REFUSAL_SEND_S):
                frame = await frames.receive()
            request_id = frame.prefix.request_id if frame.prefix.kind == FrameKind.REQUEST else 0
            await self._refuse_version(frames, peer, client, request_id)
            return False
        return True

    async def _refuse_version(self, frames: FrameStream, peer: Any, client: Identity, request_id: int) -> None:
        """Refuses a client that speaks no records, answering its request with the reason (an
        older kvfs's fetch then fails with this message)."""
        reason = f"{client} {OLD_PEER}; this node carries peer connections in them only"
        self._count("version", peer, reason)
        with trio.move_on_after(REFUSAL_SEND_S):
            try:
                await frames.send(FrameKind.ERROR, request_id, ErrorReply(errno.EIO, reason))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    async def _refuse_role(self, frames: FrameStream, peer: Any, client: Identity) -> None:
        reason = f"this {self.what} does not serve {client} (only {', '.join(sorted(self.client_roles))})"
        self._count("role", peer, reason)
        with trio.move_on_after(REFUSAL_SEND_S):  # tell an honest client with the wrong bundle why
            try:
                await frames.send(FrameKind.ERROR, 0, ErrorReply(errno.EACCES, reason))
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass

    def _count(self, kind: str, peer: Any, reason: str) -> None:
        self.refusals[kind] += 1
        logged, held = self.log_budget.take(trio.current_time())
        if logged:
            log.warning("refused %s from %s: %s%s", self.what, peer, printable(reason),
                        f" ({held} more refused before this one, not logged one by one)" if held else "")
