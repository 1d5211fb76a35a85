"""Mutual challenge-response authentication with a shared cluster secret (pure).

The client speaks first, and the server proves nothing before the client has:

    client -> server   Hello(role, client nonce)
    server -> client   Hello(role, server nonce)
    client -> server   Proof(HMAC(secret, "client" label | transcript))
    server -> client   Proof(HMAC(secret, "server" label | transcript))   only once the client's is right

The transcript is both hellos (roles and nonces, in the order sent), so a proof is bound
to its connection and to its direction: a server's proof never passes for a client's, on
this connection or another (the reflection across two concurrent connections), and a
server gives out no proof at all to a peer that has not proved itself. The secret never
crosses the wire. `ClientHandshake` and `ServerHandshake` are the two sides' state; the
connection code in kvfs.net moves their messages.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from typing import Annotated

import msgspec

from kvfs.wire.text import printable

NONCE_SIZE = 32
MIN_SECRET = 16
MAC_SIZE = 32
MAX_ROLE = 32
ROLES = frozenset({"master", "node", "client", "peer"})
# Before authentication a frame is a hello or a proof: a few hundred bytes at most, no payload.
HANDSHAKE_MAX_HEADER = 1024
HANDSHAKE_MAX_PAYLOAD = 0

_LABEL = b"kvfs-auth-v2"
_CLIENT_PROOF = b"client-proof"
_SERVER_PROOF = b"server-proof"


class Hello(msgspec.Struct, tag=True):
    """First message of each side: who it is and its nonce."""

    role: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ROLE)]  # one of ROLES
    nonce: Annotated[bytes, msgspec.Meta(min_length=NONCE_SIZE, max_length=NONCE_SIZE)]


class Proof(msgspec.Struct, tag=True):
    mac: Annotated[bytes, msgspec.Meta(min_length=MAC_SIZE, max_length=MAC_SIZE)]


HandshakeMessage = Hello | Proof


class AuthError(Exception):
    """The peer could not prove it knows the cluster secret, or broke the handshake's rules."""


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


_transcript_encoder = msgspec.msgpack.Encoder()


def transcript(client: Hello, server: Hello) -> bytes:
    """Both hellos, unambiguously encoded (each field length-delimited by msgpack)."""
    return _transcript_encoder.encode((client.role, client.nonce, server.role, server.nonce))


def client_proof(secret: bytes, client: Hello, server: Hello) -> bytes:
    return _mac(secret, _CLIENT_PROOF, transcript(client, server))


def server_proof(secret: bytes, client: Hello, server: Hello) -> bytes:
    return _mac(secret, _SERVER_PROOF, transcript(client, server))


def _mac(secret: bytes, label: bytes, data: bytes) -> bytes:
    return hmac.new(secret, _LABEL + b"|" + label + b"|" + data, hashlib.sha256).digest()


def _check_hello(hello: Hello, roles: frozenset[str], mine: Hello) -> None:
    if hello.role not in roles:
        raise AuthError(f"the peer claims role '{printable(hello.role, MAX_ROLE)}' "
                        f"(expected {' or '.join(sorted(roles))})")
    if hmac.compare_digest(hello.nonce, mine.nonce):
        raise AuthError("the peer echoed our nonce (a reflection attempt)")


class ClientHandshake:
    """The connecting side: `hello`, then `answer(server's hello)` gives our proof, then
    `verify(server's proof)`."""

    def __init__(self, secret: bytes, role: str, server_roles: frozenset[str], nonce: bytes | None = None) -> None:
        self.secret = secret
        self.server_roles = server_roles
        self.hello = Hello(role, new_nonce() if nonce is None else nonce)
        self.server: Hello | None = None

    def answer(self, server: Hello) -> Proof:
        _check_hello(server, self.server_roles, self.hello)
        self.server = server
        return Proof(client_proof(self.secret, self.hello, server))

    def verify(self, proof: Proof) -> str:
        """Checks the server's proof; returns its role."""
        if self.server is None:
            raise AuthError("a proof before the server's hello")
        if not hmac.compare_digest(server_proof(self.secret, self.hello, self.server), proof.mac):
            raise AuthError(f"the {self.server.role} failed to prove the cluster secret")
        return self.server.role


class ServerHandshake:
    """The accepting side: `greet(client's hello)` gives our hello, then `verify(client's
    proof)` gives our proof, only if the client's is right."""

    def __init__(self, secret: bytes, role: str, client_roles: frozenset[str], nonce: bytes | None = None) -> None:
        self.secret = secret
        self.client_roles = client_roles
        self.hello = Hello(role, new_nonce() if nonce is None else nonce)
        self.client: Hello | None = None

    def greet(self, client: Hello) -> Hello:
        _check_hello(client, self.client_roles, self.hello)
        self.client = client
        return self.hello

    def verify(self, proof: Proof) -> Proof:
        if self.client is None:
            raise AuthError("a proof before the client's hello")
        if not hmac.compare_digest(client_proof(self.secret, self.client, self.hello), proof.mac):
            raise AuthError(f"the {self.client.role} failed to prove the cluster secret")
        return Proof(server_proof(self.secret, self.client, self.hello))


def load_secret(path: str | None, environ: dict[str, str] = os.environ) -> bytes:  # type: ignore[assignment]
    """The cluster secret from KVFS_SECRET or a file (first line); at least 16 bytes."""
    value = environ.get("KVFS_SECRET")
    source = "KVFS_SECRET"
    if value is None and path is not None:
        with open(path, "rb") as f:
            value = f.readline().strip().decode()
        source = path
    if value is None:
        raise AuthError("no cluster secret: set KVFS_SECRET or give a secret file")
    if len(value) < MIN_SECRET:
        raise AuthError(f"the cluster secret from {source} is shorter than {MIN_SECRET} characters")
    return value.encode()
