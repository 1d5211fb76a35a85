"""The DRAM tier: file versions stored as fixed-size chunks in the arena.

A version is a list of chunk extents. While a version is written, each chunk
owns a block and remembers how far it has been written (`filled`); bytes past
`filled` read as zeros, so holes and truncate-then-extend never expose bytes of
an older file. Sealing fills those gaps, trims the last block to its length and
computes the per-chunk checksums, and the per-piece ones it keeps for peers (a reader
on another node verifies each piece as it arrives and serves it before the chunk's
last byte is in).

A chunk being written takes a whole chunk-sized block when one is free (no
copy as it grows). When none is, it takes the smallest block its bytes need
and moves to a bigger one if the file grows: in a full tier of small sealed
files, a whole aligned chunk is free only after every file in it was evicted,
and insisting on one evicted several times the bytes a small file needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvfs.checksum import chunk_and_piece_checksums, piece_checksums
from kvfs.chunks import CHUNK_SIZE, chunk_count
from kvfs.errors import NoSpace
from kvfs.store.arena import PAGE_SIZE, Arena

@dataclass
class Extent:
    offset: int  # where the chunk's block starts in the arena
    filled: int  # bytes [0, filled) of the chunk hold written data
    room: int  # the size of its block (a chunk being written may outgrow it)


class DramTier:
    """Chunk storage for file versions in one arena."""

    def __init__(self, capacity: int, chunk_size: int = CHUNK_SIZE, populate: bool = False) -> None:
        self.chunk_size = chunk_size
        self.arena = Arena(capacity, chunk_size)
        if populate:
            self.arena.populate()
        self._versions: dict[int, list[Extent | None]] = {}
        # Per sealed version, per chunk, its pieces' checksums: computed from the same bytes
        # as the chunk checksums (at seal, or when a promotion has verified them).
        self._pieces: dict[int, list[list[int]]] = {}

    @property
    def capacity(self) -> int:
        return self.arena.capacity

    @property
    def used(self) -> int:
        return self.arena.used

    def __contains__(self, version: int) -> bool:
        return version in self._versions

    def versions(self) -> list[int]:
        return list(self._versions)

    def create(self, version: int) -> None:
        self._versions.setdefault(version, [])

    def write(self, version: int, offset: int, data: bytes | memoryview) -> None:
        """Stores `data` at `offset`; raises NoSpace if a chunk cannot be allocated.

        Chunks are allocated before any byte is copied, so a failed write leaves
        the version's content unchanged (a retry after eviction redoes it all).
        """
        if not data:
            return
        extents = self._versions[version]
        end = offset + len(data)
        first, last = offset // self.chunk_size, (end - 1) // self.chunk_size
        if len(extents) <= last:
            extents.extend([None] * (last + 1 - len(extents)))
        for index in range(first, last + 1):
            needed = min(self.chunk_size, end - index * self.chunk_size)
            extent = extents[index]
            if extent is None:
                block, room = self._allocate(needed)
                extents[index] = Extent(block, 0, room)
            elif needed > extent.room:  # a chunk that started small outgrows its block
                block, room = self._allocate(needed)
                self.arena.view[block : block + extent.filled] = self.arena.view[extent.offset : extent.offset + extent.filled]
                self.arena.free(extent.offset)
                extent.offset, extent.room = block, room
        view, source = self.arena.view, memoryview(data)
        position = offset
        while position < end:
            index, within = divmod(position, self.chunk_size)
            length = min(self.chunk_size - within, end - position)
            extent = extents[index]
            assert extent is not None
            if within > extent.filled:
                self.arena.zero(extent.offset + extent.filled, within - extent.filled)
            start = extent.offset + within
            view[start : start + length] = source[position - offset : position - offset + length]
            extent.filled = max(extent.filled, within + length)
            position += length

    def _allocate(self, needed: int) -> tuple[int, int]:
        """A block for a chunk being written: a whole chunk if one is free, else the
        smallest that holds `needed` bytes. Returns (offset, size); raises NoSpace."""
        block = self.arena.allocate(self.chunk_size)
        if block is None and needed < self.chunk_size:
            block = self.arena.allocate(needed)
        if block is not None:
            return block, self.arena.block_size(block)
        raise NoSpace(f"DRAM tier full ({self.used} of {self.capacity} bytes used)", needed)

    def read(self, version: int, offset: int, length: int) -> memoryview | bytes:
        """Returns `length` bytes at `offset` (the caller clips to the file size).

        A read inside one written chunk is a zero-copy view of the arena.
        """
        extents = self._versions[version]
        index, within = divmod(offset, self.chunk_size)
        if within + length <= self.chunk_size:
            return self._read_chunk(extents, index, within, length)
        parts = []
        position, end = offset, offset + length
        while position < end:
            index, within = divmod(position, self.chunk_size)
            part = min(self.chunk_size - within, end - position)
            parts.append(self._read_chunk(extents, index, within, part))
            position += part
        return b"".join(parts)

    def _read_chunk(self, extents: list[Extent | None], index: int, within: int, length: int) -> memoryview | bytes:
        extent = extents[index] if index < len(extents) else None
        if extent is None:
            return bytes(length)
        start = extent.offset + within
        if within + length <= extent.filled:
            return self.arena.view[start : start + length]
        valid = max(0, extent.filled - within)
        return bytes(self.arena.view[start : start + valid]) + bytes(length - valid)

    def truncate(self, version: int, size: int) -> None:
        """Shrinks the stored bytes to `size` (growing needs no storage: holes read as zeros)."""
        extents = self._versions[version]
        keep = chunk_count(size, self.chunk_size)
        for extent in extents[keep:]:
            if extent is not None:
                self.arena.free(extent.offset)
        del extents[keep:]
        if 0 < keep <= len(extents) and extents[keep - 1] is not None:
            tail = size - (keep - 1) * self.chunk_size
            extent = extents[keep - 1]
            assert extent is not None
            extent.filled = min(extent.filled, tail)

    def copy(self, source: int, target: int, size: int) -> None:
        """Copies the first `size` bytes of `source` into the new version `target`."""
        self.create(target)
        for index in range(chunk_count(size, self.chunk_size)):
            start = index * self.chunk_size
            length = min(self.chunk_size, size - start)
            self.write(target, start, self.read(source, start, length))

    def seal(self, version: int, size: int) -> list[int]:
        """Makes the version dense and compact, and returns its chunk checksums."""
        self.truncate(version, size)
        extents = self._versions[version]
        checksums, pieces = [], []
        for index in range(chunk_count(size, self.chunk_size)):
            length = min(self.chunk_size, size - index * self.chunk_size)
            extent = extents[index] if index < len(extents) else None
            if extent is None:  # a hole: checksum of zeros, no storage
                data: memoryview | bytes = bytes(length)
            else:
                if extent.filled < length:
                    self.arena.zero(extent.offset + extent.filled, length - extent.filled)
                    extent.filled = length
                self._compact(extent, length)
                data = self.arena.view[extent.offset : extent.offset + length]
            whole, parts = chunk_and_piece_checksums(data)
            checksums.append(whole)
            pieces.append(parts)
        self._pieces[version] = pieces
        return checksums

    def keep_pieces(self, version: int, lengths: list[int]) -> None:
        """Computes the piece checksums of a sealed version whose chunks were just verified
        against their chunk checksums (a promotion from SSD)."""
        self._pieces[version] = [piece_checksums(self.read(version, index * self.chunk_size, length))
                                 for index, length in enumerate(lengths)]

    def pieces(self, version: int, index: int) -> list[int] | None:
        """The piece checksums of one chunk of a sealed version, if this tier has them."""
        pieces = self._pieces.get(version)
        return pieces[index] if pieces is not None and index < len(pieces) else None

    def _compact(self, extent: Extent, length: int) -> None:
        """Gives a sealed chunk the smallest block that holds it. A short chunk moves into
        the free space that earlier short chunks left (so that small files pack together
        and whole chunks stay free for writers, who always take a whole chunk); if there
        is none, its block is shrunk in place."""
        if length <= self.chunk_size // 2:
            moved = self.arena.allocate(length)
            if moved is not None:
                view = self.arena.view
                view[moved : moved + length] = view[extent.offset : extent.offset + length]
                self.arena.free(extent.offset)
                extent.offset, extent.room = moved, self.arena.block_size(moved)
                return
        self.arena.shrink(extent.offset, length)
        extent.room = self.arena.block_size(extent.offset)

    def adopt(self, version: int, lengths: list[int]) -> list[memoryview]:
        """Allocates a sealed version's chunks for bytes that will be read into them
        (promotion from SSD); returns a writable view per chunk, rounded up to whole
        pages. Raises NoSpace with nothing allocated."""
        extents: list[Extent | None] = []
        for length in lengths:
            block = self.arena.allocate(length)
            if block is None:
                for extent in extents:
                    assert extent is not None
                    self.arena.free(extent.offset)
                raise NoSpace(f"DRAM tier full ({self.used} of {self.capacity} bytes used)")
            extents.append(Extent(block, length, self.arena.block_size(block)))
        self._versions[version] = extents
        return [self.block_view(version, index) for index in range(len(lengths))]

    def chunk_offsets(self, version: int, first: int, count: int) -> list[int | None]:
        """Where chunks first..first+count-1 of a sealed version start in the arena (None: a
        hole, which reads as zeros and has no storage)."""
        extents = self._versions[version]
        return [extents[i].offset if i < len(extents) and extents[i] is not None else None  # type: ignore[union-attr]
                for i in range(first, first + count)]

    def block_view(self, version: int, index: int) -> memoryview:
        """The whole page-rounded block of one chunk (for I/O straight from or into the arena)."""
        extent = self._versions[version][index]
        assert extent is not None
        length = -(-extent.filled // PAGE_SIZE) * PAGE_SIZE
        return self.arena.view[extent.offset : extent.offset + length]

    def materialize(self, version: int, size: int) -> None:
        """Gives every chunk of a sealed version a block (holes become zeroed blocks), so
        that it can be written out chunk by chunk. Raises NoSpace."""
        extents = self._versions[version]
        for index in range(chunk_count(size, self.chunk_size)):
            if index >= len(extents):
                extents.append(None)
            if extents[index] is None:
                length = min(self.chunk_size, size - index * self.chunk_size)
                block = self.arena.allocate(length)
                if block is None:
                    raise NoSpace(f"DRAM tier full ({self.used} of {self.capacity} bytes used)")
                self.arena.zero(block, length)
                extents[index] = Extent(block, length, self.arena.block_size(block))

    def block_bytes(self, version: int) -> int:
        """The arena bytes a version's blocks take (for audits: their sum is the arena's use)."""
        return sum(self.arena.block_size(e.offset) for e in self._versions[version] if e is not None)

    def drop(self, version: int) -> None:
        """Frees every chunk of a version (unknown versions are ignored)."""
        self._pieces.pop(version, None)
        for extent in self._versions.pop(version, ()):
            if extent is not None:
                self.arena.free(extent.offset)
