"""kvfs's own AEAD records for node-to-node peer connections (`--peer-encryption on`).

A peer connection is set up in TLS 1.3 as every connection is (kvfs.net.handshake): both
certificates checked, the client admitted. Inside TLS each end then sends 32 fresh random
bytes (the server's in its Welcome, the client's in its answer); both derive one key per
direction from the two with HKDF-SHA256, end TLS (`TlsStream.unwrap`) and from then on every
byte of the connection travels in records of this module:

    length (4 bytes, big-endian: ciphertext + tag)  |  AES-256-GCM ciphertext + 16-byte tag

The nonce is the direction's record counter (64 bits, zero-padded to GCM's 96), never sent:
a replayed, reordered or dropped record is opened with the wrong nonce and fails its tag, as
does a flipped or cut byte. The length is the associated data, and the only thing read before
the tag is checked (bounded to one record's size, used only to know where the record ends).
A record carries at most `MAX_PLAINTEXT` (1 MiB, a chunk piece), so that a piece is one
record, decrypted straight into the reader's buffer. A failed tag raises `SealedRecordError`
(a ProtocolError: the connection closes, the load fails with EIO). The counter stops below
2**64: the connection closes before a nonce could repeat.

Why not TLS for the bulk bytes: Python's ssl moves 16 KiB records one call at a time, with
copies, at a fraction of what AES-GCM does here; `cryptography`'s AESGCM encrypts and
decrypts 1 MiB in one call, in place (`encrypt_into`, `decrypt_into`).

`derive_keys`, `Sealer` and `Opener` are pure (no I/O); `SealedSocket` puts them on a socket,
with the part of the socket API that `TlsStream`, `send_some` and `BlockingFrames` use.
"""

from __future__ import annotations

import socket
import struct
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvfs.wire.protocol import ProtocolError

__all__ = ["MAX_PLAINTEXT", "RECORDS_VERSION", "SECRET_SIZE", "Opener", "SealedRecordError", "SealedSocket",
           "Sealer", "derive_keys"]

RECORDS_VERSION = 1  # in the key derivation's info: a later construction derives other keys
SECRET_SIZE = 32  # each end's contribution
KEY_SIZE = 32  # AES-256
TAG_SIZE = 16
HEADER = struct.Struct(">I")
MAX_PLAINTEXT = 1 << 20  # a chunk piece (kvfs.checksum.PIECE_SIZE) is one record
MAX_RECORD = HEADER.size + MAX_PLAINTEXT + TAG_SIZE
COUNTER_LIMIT = 1 << 64  # records per direction and connection, nonces 0 .. 2**64 - 1
_SALT = b"kvfs peer records"


class SealedRecordError(ProtocolError):
    """A record failed authentication (or broke the record format): the connection must close."""


def _info(direction: str) -> bytes:
    return f"kvfs peer records v{RECORDS_VERSION} {direction}".encode()


def derive_keys(server_secret: bytes, client_secret: bytes) -> tuple[bytes, bytes]:
    """(client-to-server key, server-to-client key) from both ends' secrets."""
    for name, secret in (("server", server_secret), ("client", client_secret)):
        if len(secret) != SECRET_SIZE:
            raise ProtocolError(f"the {name}'s record secret has {len(secret)} bytes, not {SECRET_SIZE}")
    material = bytes(server_secret) + bytes(client_secret)
    return tuple(HKDF(hashes.SHA256(), KEY_SIZE, _SALT, _info(direction)).derive(material)  # type: ignore[return-value]
                 for direction in ("client->server", "server->client"))


def _nonce(counter: int) -> bytes:
    return b"\0\0\0\0" + counter.to_bytes(8, "big")


class _Direction:
    """One direction's key and record counter."""

    def __init__(self, key: bytes, counter: int = 0, limit: int = COUNTER_LIMIT) -> None:
        if len(key) != KEY_SIZE:
            raise ValueError(f"a record key has {KEY_SIZE} bytes, not {len(key)}")
        self.aead = AESGCM(key)
        self.counter = counter  # the next record's
        self.limit = limit

    def next_nonce(self) -> bytes:
        if self.counter >= self.limit:
            raise SealedRecordError(f"{self.counter} records on this connection: its nonces are spent")
        nonce = _nonce(self.counter)
        self.counter += 1
        return nonce


class Sealer(_Direction):
    """The sending direction: plaintext into records."""

    def seal_into(self, plaintext: memoryview | bytes, out: memoryview) -> int:
        """Writes the record of PLAINTEXT (1 .. MAX_PLAINTEXT bytes) at the start of OUT; returns its size."""
        length = len(plaintext)
        if not 0 < length <= MAX_PLAINTEXT:
            raise ValueError(f"a record carries 1 to {MAX_PLAINTEXT} bytes, not {length}")
        end = HEADER.size + length + TAG_SIZE
        HEADER.pack_into(out, 0, length + TAG_SIZE)
        self.aead.encrypt_into(self.next_nonce(), plaintext, bytes(out[:HEADER.size]), out[HEADER.size:end])
        return end


def record_length(header: bytes | memoryview) -> int:
    """The ciphertext length a record's header announces, bounded before anything trusts it."""
    (length,) = HEADER.unpack(header)
    if not TAG_SIZE < length <= MAX_PLAINTEXT + TAG_SIZE:
        raise SealedRecordError(f"a record of {length} bytes (at most {MAX_PLAINTEXT + TAG_SIZE})")
    return length


class Opener(_Direction):
    """The receiving direction: records into plaintext."""

    def open_into(self, header: bytes, ciphertext: memoryview | bytes, out: memoryview) -> int:
        """Authenticates and decrypts one record (HEADER's ciphertext) into OUT, which holds
        exactly its plaintext; returns the plaintext's length. Raises SealedRecordError; OUT
        then holds nothing to use."""
        length = len(ciphertext) - TAG_SIZE
        try:
            self.aead.decrypt_into(self.next_nonce(), ciphertext, header, out[:length])
        except InvalidTag:
            raise SealedRecordError(f"record {self.counter - 1} fails authentication (altered, replayed, "
                                    f"reordered or missing records on the path)") from None
        return length


class SealedSocket:
    """A connected TCP socket whose bytes travel in records, with the part of the socket API
    that `kvfs.net.streams` uses: blocking or not, `send` (non-blocking: as an SSL socket,
    all of a record or BlockingIOError; call again with the same bytes), `sendall`, `recv`,
    `recv_into` (a record that fits the target is decrypted straight into it).

    One thread at a time sends, and one receives (they touch separate state)."""

    def __init__(self, sock: socket.socket, send_key: bytes, receive_key: bytes) -> None:
        self._sock = sock
        self._sealer = Sealer(send_key)
        self._opener = Opener(receive_key)
        self._out = memoryview(bytearray(MAX_RECORD))  # the record being sent
        self._pending = self._out[:0]  # its bytes the socket has not taken yet
        self._pending_plain = 0  # the plaintext length of that record
        # Received: at most one record and the next one's header (never more, so that
        # nothing is buffered past what the caller asked for but the next length).
        self._in = memoryview(bytearray(MAX_RECORD + HEADER.size))
        self._in_length = 0
        self._plain = memoryview(bytearray(MAX_PLAINTEXT))  # a record larger than the caller's target
        self._plain_start = self._plain_end = 0

    # The socket's own.
    def fileno(self) -> int:
        return self._sock.fileno()

    def setblocking(self, flag: bool) -> None:
        self._sock.setblocking(flag)

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)

    def gettimeout(self) -> float | None:
        return self._sock.gettimeout()

    def getpeername(self) -> Any:
        return self._sock.getpeername()

    def setsockopt(self, *args: Any) -> None:
        self._sock.setsockopt(*args)

    def close(self) -> None:
        self._sock.close()

    @property
    def records_sent(self) -> int:
        return self._sealer.counter

    @property
    def records_received(self) -> int:
        return self._opener.counter

    # Sending.
    def _flush(self) -> bool:
        """Sends what is left of the current record; whether all of it went."""
        while len(self._pending):
            try:
                sent = self._sock.send(self._pending)
            except BlockingIOError:
                return False
            self._pending = self._pending[sent:]
        return True

    def send(self, data: bytes | bytearray | memoryview) -> int:
        """One record of DATA's first bytes: how many went, or BlockingIOError (the socket is
        full; call again with the same bytes once it is writable)."""
        if not len(self._pending):
            view = memoryview(data).cast("B")
            if not len(view):
                return 0
            length = min(len(view), MAX_PLAINTEXT)
            self._pending = self._out[: self._sealer.seal_into(view[:length], self._out)]
            self._pending_plain = length
        if not self._flush():
            raise BlockingIOError("the socket takes no more now")
        return self._pending_plain

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        """All of DATA (a blocking socket, as `socket.sendall`)."""
        view = memoryview(data).cast("B")
        if len(self._pending):  # a record a non-blocking send began
            self._sock.sendall(self._pending)
            self._pending = self._out[:0]
        while len(view):
            length = min(len(view), MAX_PLAINTEXT)
            self._sock.sendall(self._out[: self._sealer.seal_into(view[:length], self._out)])
            view = view[length:]

    # Receiving.
    def _record(self) -> int:
        """Reads until a whole record is in; its ciphertext length, or 0 at the end of the
        connection (a connection that ends inside a record is lost as a cut TLS connection
        is: EOF, nothing of the record used)."""
        while True:
            want = HEADER.size
            if self._in_length >= HEADER.size:
                want += record_length(self._in[: HEADER.size])
                if self._in_length >= want:
                    return want - HEADER.size
            # The rest of this record and the next one's header, no more.
            count = self._sock.recv_into(self._in[self._in_length : want + HEADER.size])
            if count == 0:
                return 0
            self._in_length += count

    def _consumed(self, ciphertext_length: int) -> None:
        end = HEADER.size + ciphertext_length
        rest = self._in_length - end  # at most the next header
        self._in[:rest] = self._in[end : self._in_length]
        self._in_length = rest

    def recv_into(self, buffer: Any, nbytes: int = 0) -> int:
        """Up to NBYTES (or all of BUFFER) of plaintext into BUFFER: what is left of the last
        record, else the next record (decrypted in place when it fits). 0: the peer closed."""
        target = memoryview(buffer).cast("B")
        wanted = min(nbytes or len(target), len(target))
        if self._plain_start < self._plain_end:
            count = min(wanted, self._plain_end - self._plain_start)
            target[:count] = self._plain[self._plain_start : self._plain_start + count]
            self._plain_start += count
            return count
        if not wanted:
            return 0
        ciphertext_length = self._record()
        if not ciphertext_length:
            return 0
        header = bytes(self._in[: HEADER.size])
        ciphertext = self._in[HEADER.size : HEADER.size + ciphertext_length]
        length = ciphertext_length - TAG_SIZE
        if length <= wanted:
            self._opener.open_into(header, ciphertext, target)
            self._consumed(ciphertext_length)
            return length
        self._opener.open_into(header, ciphertext, self._plain)
        self._consumed(ciphertext_length)
        target[:wanted] = self._plain[:wanted]
        self._plain_start, self._plain_end = wanted, length
        return wanted

    def recv(self, bufsize: int) -> bytes:
        """Up to BUFSIZE bytes of plaintext; b"" once the peer closed."""
        if self._plain_start >= self._plain_end:  # size the copy by the next record
            ciphertext_length = self._record() if bufsize else 0
            if not ciphertext_length:
                return b""
            bufsize = min(bufsize, ciphertext_length - TAG_SIZE)
        else:
            bufsize = min(bufsize, self._plain_end - self._plain_start)
        buffer = bytearray(bufsize)
        return bytes(buffer[: self.recv_into(buffer)])
