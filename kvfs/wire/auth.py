"""The message that ends a connection's setup (pure).

Authentication is TLS 1.3 with a certificate on each side (kvfs.net.handshake): the peer's
name and role come from its certificate, never from what it says. Once the server has
checked the client's identity against who may connect, it sends `Welcome` (or an ERROR
frame saying why not), so that a refused client learns why instead of seeing its first
request fail. Until then a connection is held to tiny frames.

Peer encryption off (`kvfs node --peer-encryption off`): a node's Welcome on its peer port
says it would carry chunks in the clear (`plaintext`), and the client, which must answer
such a Welcome, says with `Encryption` whether it would too. Only when both would do both
sides end TLS on that connection. Both messages travel inside TLS, so nobody on the path
can turn encryption off.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

MAX_NAME = 255
# Before admission a frame is a welcome or a refusal: a few hundred bytes at most, no payload.
HANDSHAKE_MAX_HEADER = 1024
HANDSHAKE_MAX_PAYLOAD = 0


class Welcome(msgspec.Struct, tag=True):
    """The server admitted the client: its own identity, as its certificate says."""

    name: Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
    role: Annotated[str, msgspec.Meta(max_length=16)]
    # A master elected through etcd: its leadership's epoch (the leader key's create_revision),
    # so that a client can refuse a deposed leader. 0: a single master, or not a master.
    epoch: Annotated[int, msgspec.Meta(ge=0)] = 0
    # This server runs with peer encryption off: it leaves TLS on this connection if the
    # client answers `Encryption(plaintext=True)`. A client must answer when this is set.
    plaintext: bool = False
    # A peer port: the server's 32 random bytes for kvfs's own records (kvfs.net.sealed), which
    # the connection moves to after admission. A client must answer when this is set.
    sealed: Annotated[bytes, msgspec.Meta(max_length=64)] = b""


class Encryption(msgspec.Struct, tag=True):
    """The client's answer to a Welcome with `plaintext` set (a HELLO frame): whether it too
    runs with peer encryption off, and so leaves TLS on this connection."""

    plaintext: bool
    sealed: Annotated[bytes, msgspec.Meta(max_length=64)] = b""  # the client's 32 bytes, to a Welcome's


HandshakeMessage = Welcome | Encryption


class AuthError(Exception):
    """The peer's certificate or role does not allow this connection, or it broke the setup."""
