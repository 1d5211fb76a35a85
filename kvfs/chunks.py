"""The chunk: the unit of allocation, transfer and checksum, the same in every tier."""

from __future__ import annotations

CHUNK_SIZE = 4 << 20


def chunk_count(size: int, chunk_size: int = CHUNK_SIZE) -> int:
    return -(-size // chunk_size)
