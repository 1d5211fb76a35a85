"""Extent headers: each file on the SSD tier describes itself on the tier.

Every file version offloaded to SSD gets one header block (a page, more only
for very large paths or xattrs) written and synced with its chunks, before its
index record commits. The header holds the file's record (version, path, size,
attributes, every chunk's offset, length and checksum), so the index can be
rebuilt from the segments alone when it is lost or damaged.

Layout of a header block (little-endian), starting on a page boundary:

    0   8  MAGIC
    8   4  layout version
    12  4  body length
    16  8  xxh3-64 of bytes 0..16 and of the body
    24  -  body: msgpack of HeaderBody
    ...    zeros up to the block's page-rounded length

A header is erased (its first page zeroed) before its file's space is freed.
This module is pure: no I/O.
"""

from __future__ import annotations

import struct

import msgspec
import xxhash

from kvfs.disk.records import LAYOUT_VERSION, DiskRecord

MAGIC = b"KVFShdr\x00"
PAGE = 4096
MAX_BODY = 4 << 20  # no block on the tier is larger than a chunk
_PREFIX = struct.Struct("<8sIIQ")


class HeaderBody(msgspec.Struct):
    chunk_size: int
    written_ns: int  # orders two headers of one version: the later rewrite wins
    record: DiskRecord


class HeaderError(ValueError):
    """A block is not a valid extent header (the message says why)."""


_encode = msgspec.msgpack.Encoder().encode
_decode_body = msgspec.msgpack.Decoder(HeaderBody).decode


def _checksum(prefix: bytes, body: bytes | memoryview) -> int:
    digest = xxhash.xxh3_64(prefix)
    digest.update(body)
    return digest.intdigest()


def header_length(body: bytes) -> int:
    """The page-rounded length of a header block holding `body`."""
    return -(-(_PREFIX.size + len(body)) // PAGE) * PAGE


def encode_header(record: DiskRecord, chunk_size: int, written_ns: int) -> bytes:
    """The header block of a record, padded to whole pages."""
    body = _encode(HeaderBody(chunk_size, written_ns, record))
    start = struct.pack("<8sII", MAGIC, LAYOUT_VERSION, len(body))
    block = start + struct.pack("<Q", _checksum(start, body)) + body
    return block + bytes(header_length(body) - len(block))


def _prefix(block: bytes | memoryview) -> tuple[int, int, int]:
    """A header's layout version, body length and checksum; HeaderError if it has no prefix."""
    if len(block) < _PREFIX.size:
        raise HeaderError("shorter than a header")
    magic, layout, length, checksum = _PREFIX.unpack_from(block)
    if magic != MAGIC:
        raise HeaderError("no header magic")
    return layout, length, checksum


def header_span(page: bytes | memoryview) -> int:
    """From a header's first page: the length of its whole block (to read the rest)."""
    _, length, _ = _prefix(page)
    if length > MAX_BODY:
        raise HeaderError(f"body length {length} is implausible")
    return -(-(_PREFIX.size + length) // PAGE) * PAGE


def decode_header(block: bytes | memoryview) -> HeaderBody:
    """The header in `block` (its first page at least); HeaderError if it is not valid."""
    layout, length, checksum = _prefix(block)
    if layout != LAYOUT_VERSION:
        raise HeaderError(f"layout {layout}, not {LAYOUT_VERSION}")
    body = memoryview(block)[_PREFIX.size : _PREFIX.size + length]
    if len(body) != length:
        raise HeaderError(f"body of {length} bytes cut short")
    if _checksum(bytes(block[:16]), body) != checksum:
        raise HeaderError("header checksum mismatch")
    try:
        return _decode_body(body)
    except msgspec.DecodeError as error:
        raise HeaderError(f"undecodable body ({error})") from None


def magic_pages(window: bytes | memoryview, start: int = 0) -> list[int]:
    """Offsets (within `window`, page-aligned, from `start`) of pages that begin with MAGIC."""
    data = bytes(window) if isinstance(window, memoryview) else window
    found = []
    position = data.find(MAGIC, start)
    while position >= 0:
        if position % PAGE == 0:
            found.append(position)
            position = data.find(MAGIC, position + PAGE)
        else:
            position = data.find(MAGIC, position - position % PAGE + PAGE)
    return found
