"""Per-chunk checksums (xxh3-64): fast enough to compute at seal time on every chunk."""

from __future__ import annotations

import xxhash


def chunk_checksum(data: memoryview | bytes) -> int:
    """The xxh3-64 checksum of one chunk's bytes."""
    return xxhash.xxh3_64_intdigest(data)


# A chunk's pieces: the writer's node keeps a checksum per piece, so that a reader on another
# node can serve a chunk's first bytes, verified, before its last ones arrive. One piece is
# one FUSE READ (1 MiB), the unit the kernel asks for.
PIECE_SIZE = 1 << 20


def piece_checksums(data: memoryview | bytes) -> list[int]:
    """The xxh3-64 checksums of a chunk's PIECE_SIZE pieces (the last may be shorter)."""
    view = memoryview(data)
    return [xxhash.xxh3_64_intdigest(view[start : start + PIECE_SIZE]) for start in range(0, len(view), PIECE_SIZE)]


def chunk_and_piece_checksums(data: memoryview | bytes) -> tuple[int, list[int]]:
    """A chunk's checksum and its pieces' in one pass over memory: each piece is hashed
    for both while it is in cache."""
    view = memoryview(data)
    whole = xxhash.xxh3_64()
    pieces = []
    for start in range(0, len(view), PIECE_SIZE):
        piece = view[start : start + PIECE_SIZE]
        pieces.append(xxhash.xxh3_64_intdigest(piece))
        whole.update(piece)
    return whole.intdigest(), pieces


def chunk_hasher() -> xxhash.xxh3_64:
    """A chunk's checksum computed piece by piece as they arrive (`intdigest()` at the end
    equals `chunk_checksum` of the whole): each piece is hashed while it is still in cache."""
    return xxhash.xxh3_64()


def format_checksum(value: int) -> str:
    return f"xxh3:{value:016x}"
