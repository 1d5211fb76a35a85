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
VERSION = 3  # 3: TLS 1.3 with certificates; the setup ends with a Welcome (2: a shared secret's proofs)
PREFIX = struct.Struct(">2sBBIIQ")
PREFIX_SIZE = PREFIX.size
MAX_HEADER = 1 << 20  # control messages are small; a listing of 256 entries is ~40 KiB
MAX_PAYLOAD = 8 << 20  # one chunk (4 MiB) with room to spare


class FrameKind(enum.IntEnum):
    HELLO = 1  # connection setup: the server's Welcome
    REQUEST = 2
    RESPONSE = 3
    ERROR = 4
    NOTIFY = 5  # pushed by the master, unasked (request id 0)
    PULSE = 6  # "still working on your request": an owner preparing a chunk, so the reader waits on


_KINDS = {kind.value: kind for kind in FrameKind}


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


def parse_prefix(data: bytes | memoryview, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD) -> Prefix:
    """The prefix's fields, validated; lengths beyond the caller's limits are refused."""
    if len(data) != PREFIX_SIZE:
        raise ProtocolError(f"frame prefix of {len(data)} bytes (want {PREFIX_SIZE})")
    magic, version, kind, header_length, payload_length, request_id = PREFIX.unpack(data)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} (this side speaks {VERSION})")
    frame_kind = _KINDS.get(kind)  # (a dict, not FrameKind(kind): this runs for every frame)
    if frame_kind is None:
        raise ProtocolError(f"unknown frame kind {kind}")
    if header_length > max_header:
        raise ProtocolError(f"header of {header_length} bytes exceeds {max_header}")
    if payload_length > max_payload:
        raise ProtocolError(f"payload of {payload_length} bytes exceeds {max_payload}")
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


@dataclass(frozen=True)
class Head:
    """A frame's prefix and header; its payload (prefix.payload_length bytes) follows."""

    prefix: Prefix
    header: bytes


@dataclass(frozen=True)
class Frame:
    prefix: Prefix
    header: bytes
    payload: bytes


class FrameParser:
    """The push parser every connection reads with: bytes in, validated frames out.

    `feed` what arrived, then take whole frames with `next_frame` (payload buffered here) or
    heads with `next_head`, whose payload the caller may receive straight into its own
    buffer: `drain_payload` hands over what is already buffered, `payload_received` counts
    the rest. `wanted` says how many bytes the next step needs, so that a caller reading
    exactly that much never has bytes of the next frame buffered. Lengths beyond the limits
    (`limit`, e.g. tiny before authentication) are refused before anything is allocated.
    Once it raised ProtocolError it stays failed: the stream cannot be resynchronised.
    """

    def __init__(self, max_header: int = MAX_HEADER, max_payload: int = MAX_PAYLOAD) -> None:
        self.max_header = max_header
        self.max_payload = max_payload
        self._buffer = bytearray()
        self._prefix: Prefix | None = None  # parsed; its header not yet complete
        self._head: Head | None = None  # next_frame's head, waiting for its payload
        self._owed = 0  # payload bytes of the last head not yet handed over
        self.failed: ProtocolError | None = None

    def limit(self, max_header: int, max_payload: int) -> None:
        """Limits for the frames from now on (a frame already under way keeps its own)."""
        self.max_header = max_header
        self.max_payload = max_payload

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self.failed is not None:
            raise self.failed
        self._buffer += data

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def wanted(self) -> int:
        """Bytes still missing before the next head (or the owed payload) is complete."""
        if self._owed:
            return max(0, self._owed - len(self._buffer))
        if self._prefix is None:
            return max(0, PREFIX_SIZE - len(self._buffer))
        return max(0, self._prefix.header_length - len(self._buffer))

    def next_head(self) -> Head | None:
        """The next frame's prefix and header, or None until more bytes are fed."""
        if self.failed is not None:
            raise self.failed
        if self._owed or self._head is not None:
            raise RuntimeError("the previous frame's payload has not been taken")
        if self._prefix is None:
            if len(self._buffer) < PREFIX_SIZE:
                return None
            try:
                self._prefix = parse_prefix(bytes(self._buffer[:PREFIX_SIZE]), self.max_header, self.max_payload)
            except ProtocolError as error:
                self.failed = error
                raise
            del self._buffer[:PREFIX_SIZE]
        length = self._prefix.header_length
        if len(self._buffer) < length:
            return None
        head = Head(self._prefix, bytes(self._buffer[:length]))
        del self._buffer[:length]
        self._prefix = None
        self._owed = head.prefix.payload_length
        return head

    def drain_payload(self, target: memoryview) -> int:
        """Moves buffered bytes of the owed payload into `target`; returns how many."""
        count = min(len(target), self._owed, len(self._buffer))
        target[:count] = self._buffer[:count]
        del self._buffer[:count]
        self._owed -= count
        return count

    def payload_received(self, count: int) -> None:
        """The caller received `count` bytes of the owed payload itself."""
        if count > self._owed or count > 0 and self._buffer:
            raise RuntimeError(f"{count} payload bytes received outside, {self._owed} owed, "
                               f"{len(self._buffer)} buffered")
        self._owed -= count

    def next_frame(self) -> Frame | None:
        """The next whole frame, or None until more bytes are fed."""
        if self._head is None:
            self._head = self.next_head()
            if self._head is None:
                return None
        if len(self._buffer) < self._owed:
            return None
        head, self._head = self._head, None
        payload = bytes(self._buffer[: self._owed])
        del self._buffer[: self._owed]
        self._owed = 0
        return Frame(head.prefix, head.header, payload)

    def frames(self, data: bytes | bytearray | memoryview = b"") -> list[Frame]:
        """Feeds `data` and returns every frame now complete."""
        self.feed(data)
        out: list[Frame] = []
        while (frame := self.next_frame()) is not None:
            out.append(frame)
        return out
