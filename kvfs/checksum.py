"""Per-chunk checksums (xxh3-64): fast enough to compute at seal time on every chunk."""

from __future__ import annotations

import xxhash


def chunk_checksum(data: memoryview | bytes) -> int:
    """The xxh3-64 checksum of one chunk's bytes."""
    return xxhash.xxh3_64_intdigest(data)


def format_checksum(value: int) -> str:
    return f"xxh3:{value:016x}"
