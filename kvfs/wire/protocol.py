"""The kvfs wire protocol, without I/O: frames are built and parsed here, moved elsewhere.

A frame is a fixed 20-byte prefix, a msgpack header (a msgspec struct) and an
optional raw payload (chunk bytes), so that payloads can be sent from and
received into preallocated buffers without copies in Python:

    magic "KV" | version u8 | kind u8 | header length u32 | payload length u32 | request id u64

Every field is validated before anything is allocated: a bad magic, an unknown
version or kind, an oversized header or payload, or a header that does not
decode to a struct of the expected type raises ProtocolError, and the caller
closes that connection with the error's reason.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Any

import msgspec

MAGIC = b"KV"
VERSION = 1
PREFIX = struct.Struct(">2sBBIIQ")
PREFIX_SIZE = PREFIX.size
MAX_HEADER = 1 << 20  # control messages are small; a listing of 256 entries is ~40 KiB
MAX_PAYLOAD = 8 << 20  # one chunk (4 MiB) with room to spare


class FrameKind(enum.IntEnum):
    HELLO = 1  # authentication handshake
    REQUEST = 2
    RESPONSE = 3
    ERROR = 4
    NOTIFY = 5  # pushed by the master, unasked (request id 0)


class ProtocolError(Exception):
    """A peer sent something that is not a valid frame; the connection must close."""


@dataclass(frozen=True)
class Prefix:
    kind: FrameKind
    header_length: int
    payload_length: int
    request_id: int


class ErrorReply(msgspec.Struct):
    """A request failed with a POSIX errno (or EPROTO for a protocol error)."""

    errno: int
    message: str


def parse_prefix(data: bytes | memoryview) -> Prefix:
    if len(data) != PREFIX_SIZE:
        raise ProtocolError(f"frame prefix of {len(data)} bytes (want {PREFIX_SIZE})")
    magic, version, kind, header_length, payload_length, request_id = PREFIX.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} (this side speaks {VERSION})")
    try:
        frame_kind = FrameKind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if header_length > MAX_HEADER:
        raise ProtocolError(f"header of {header_length} bytes exceeds {MAX_HEADER}")
    if payload_length > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {payload_length} bytes exceeds {MAX_PAYLOAD}")
    return Prefix(frame_kind, header_length, payload_length, request_id)


_encoder = msgspec.msgpack.Encoder()


def encode_frame(kind: FrameKind, request_id: int, header: msgspec.Struct, payload_length: int = 0) -> bytes:
    """The prefix and header of a frame; the payload (if any) is sent after it as is."""
    body = _encoder.encode(header)
    if len(body) > MAX_HEADER:
        raise ProtocolError(f"header of {len(body)} bytes exceeds {MAX_HEADER}")
    if payload_length > MAX_PAYLOAD:
        raise ProtocolError(f"payload of {payload_length} bytes exceeds {MAX_PAYLOAD}")
    return PREFIX.pack(MAGIC, VERSION, kind, len(body), payload_length, request_id) + body


class HeaderDecoder:
    """Decodes headers into one expected type (a struct or a union of tagged structs)."""

    def __init__(self, kind: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind)

    def decode(self, data: bytes | memoryview) -> Any:
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as error:
            raise ProtocolError(f"invalid header: {error}") from None


@dataclass
class Frame:
    prefix: Prefix
    header: bytes
    payload: bytes


class FrameReader:
    """Splits a byte stream into frames (for control traffic and tests; the data path
    reads payloads straight into its buffers instead). Once it raised ProtocolError
    it stays failed: the stream cannot be resynchronised."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._prefix: Prefix | None = None
        self.failed: ProtocolError | None = None

    def feed(self, data: bytes) -> list[Frame]:
        if self.failed is not None:
            raise self.failed
        self._buffer += data
        frames: list[Frame] = []
        try:
            while True:
                if self._prefix is None:
                    if len(self._buffer) < PREFIX_SIZE:
                        break
                    self._prefix = parse_prefix(bytes(self._buffer[:PREFIX_SIZE]))
                    del self._buffer[:PREFIX_SIZE]
                need = self._prefix.header_length + self._prefix.payload_length
                if len(self._buffer) < need:
                    break
                header = bytes(self._buffer[: self._prefix.header_length])
                payload = bytes(self._buffer[self._prefix.header_length : need])
                del self._buffer[:need]
                frames.append(Frame(self._prefix, header, payload))
                self._prefix = None
        except ProtocolError as error:
            self.failed = error
            raise
        return frames
