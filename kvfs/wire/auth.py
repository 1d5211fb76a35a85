"""Mutual challenge-response authentication with a shared cluster secret (pure).

Each side sends a random nonce; each proves knowledge of the secret with an
HMAC-SHA256 over both nonces and its role, so a proof cannot be replayed on
another connection or reflected back to its sender. The secret never crosses
the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

import msgspec

NONCE_SIZE = 32
MIN_SECRET = 16


class Hello(msgspec.Struct, tag=True):
    """First message of each side: who it is and its nonce."""

    role: str  # "master", "node" or "client"
    nonce: bytes


class Proof(msgspec.Struct, tag=True):
    mac: bytes


HandshakeMessage = Hello | Proof


class AuthError(Exception):
    """The peer could not prove it knows the cluster secret."""


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_SIZE)


def prove(secret: bytes, role: str, my_nonce: bytes, their_nonce: bytes) -> bytes:
    return hmac.new(secret, b"kvfs-auth-v1|" + role.encode() + b"|" + my_nonce + their_nonce, hashlib.sha256).digest()


def check(secret: bytes, hello: Hello, proof: Proof, my_nonce: bytes) -> None:
    """Verifies the peer's proof (it signed its own nonce first, then ours)."""
    if len(hello.nonce) != NONCE_SIZE:
        raise AuthError(f"nonce of {len(hello.nonce)} bytes")
    if hello.nonce == my_nonce:
        raise AuthError("the peer echoed our nonce (a reflection attempt)")
    expected = prove(secret, hello.role, hello.nonce, my_nonce)
    if not hmac.compare_digest(expected, proof.mac):
        raise AuthError(f"{hello.role} failed to prove the cluster secret")


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
