"""Chunks for and from other nodes.

Serving: a peer's request for chunks of a version stored here is read like a local
reader's (a whole-file request may promote the version), and a peer that READs over RDMA
leases the DRAM copy (pinned until `end_lease`). Fetching: a version stored on another
node streams into read buffers, in parallel runs, while its reader is served; the open
returns once the owner answered, so that an owner without the version fails the open.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import trio

from kvfs.errors import StorageError
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.dram import DramTier
from kvfs.store.reads import LocalReads
from kvfs.store.residency import Residency, chunk_lengths
from kvfs.store.source import ReadSource

# The store's parts log as one component, under the name its lines have always had.
log = logging.getLogger("kvfs.store.tiered")

# Fills chunks start..stop-1 of a remote source (the transport's side of a fetch).
Fetch = Callable[[ReadSource, int, int], Awaitable[None]]


@dataclass(slots=True)
class HeldChunks:
    """A run of chunks of a version in DRAM, as views of the arena (no copy) and the writer's
    piece checksums of each where kept; pinned, so the views stay valid, until `release()`."""

    views: list[memoryview]
    pieces: list[list[int] | None]
    release: Callable[[], None]


class PeerChunks:
    """The store's exchange of chunks with other nodes; owned by `TieredStore`, which shares
    its books, DRAM tier, read path and read buffers with it."""

    def __init__(self, residency: Residency, dram: DramTier, reads: LocalReads, read_buffers: ReadBufferPool,
                 spawn: Callable[..., Any]) -> None:
        self.residency = residency
        self.dram = dram
        self.reads = reads
        self.read_buffers = read_buffers
        self.chunk_size = dram.chunk_size
        self._spawn = spawn  # starts a stream in the store's nursery

    def _chunk_lengths(self, version: int, first: int, count: int) -> list[int]:
        """The lengths of every chunk of a sealed version stored here, after checking that a
        peer's run first..first+count-1 lies within it."""
        lengths = self.residency.stored(version).lengths(self.chunk_size)
        if first < 0 or count < 0 or first + count > len(lengths):
            raise StorageError(errno.EINVAL, f"version {version} has {len(lengths)} chunks, not {first}+{count}")
        return lengths

    async def serve_chunks(self, version: int, first: int, count: int,
                           send: Callable[[int, memoryview | bytes], Awaitable[None]]) -> None:
        """Hands chunks of a sealed version to `send` in order (the peer server's source).
        A whole-file request counts as a read (it may promote the version into DRAM); a
        partial one from SSD reads just its chunks."""
        lengths = self._chunk_lengths(version, first, count)
        if version in self.dram or self.reads.promoting(version) or (first == 0 and count == len(lengths)):
            source = await self.reads.open_read(version)
            try:
                for index in range(first, first + count):
                    await send(index, await self.reads.read(source, index * self.chunk_size, lengths[index]))
            finally:
                self.reads.close_read(source)
            return
        buffer = self.read_buffers.take()
        try:
            for index in range(first, first + count):
                await self.reads.read_from_disk(version, [buffer], first_index=index)
                await send(index, buffer[: lengths[index]])
        finally:
            self.read_buffers.give_back(buffer)

    def hold_chunks(self, version: int, first: int, count: int) -> HeldChunks | None:
        """Chunks first..first+count-1 of a sealed version in DRAM, pinned and touched as a
        read (as `serve_chunks` does) until the caller releases them: so that the peer server
        sends a request's chunks, of several versions, in one go. None when the version is
        not in DRAM now (on SSD alone, or being promoted): `serve_chunks` serves it then, as
        the disk gives its chunks. Raises StorageError as `serve_chunks` does."""
        lengths = self._chunk_lengths(version, first, count)
        if version not in self.dram or self.reads.promoting(version):
            return None
        size = self.chunk_size
        views = [memoryview(self.dram.read(version, index * size, lengths[index])) for index in
                 range(first, first + count)]
        pieces = [self.dram.pieces(version, index) for index in range(first, first + count)]
        self.residency.pin(version)  # (last: nothing above can leave a pin behind)
        self.residency.touch(version)
        return HeldChunks(views, pieces, lambda: self.reads.unpin(version))

    def piece_checksums(self, version: int, index: int) -> list[int] | None:
        """The writer's checksums of one chunk's pieces, where the DRAM tier keeps them (they
        come with the chunk, so that the peer serves its first pieces before the last is in)."""
        return self.dram.pieces(version, index)

    def lease_dram(self, version: int, first: int, count: int) -> tuple[list[int | None], list[int]] | None:
        """Pins a sealed version's DRAM copy for a peer that READs it over RDMA: the arena
        offsets and lengths of chunks first..first+count-1, or None when the version is not
        in DRAM (the peer fetches it over TCP then). `end_lease` unpins it."""
        lengths = self._chunk_lengths(version, first, count)
        if version not in self.dram or self.reads.promoting(version):
            return None
        self.residency.pin(version)
        self.residency.touch(version)
        return self.dram.chunk_offsets(version, first, count), lengths[first:first + count]

    def end_lease(self, version: int) -> None:
        """The peer's RDMA READs of a leased version are done."""
        self.reads.unpin(version)

    async def open_remote(self, version: int, size: int, fetch: Fetch, streams: int) -> ReadSource:
        """A reader of a version stored on another node: `start_remote`, then `remote_answered`."""
        return await self.remote_answered(self.start_remote(version, size, fetch, streams))

    def start_remote(self, version: int, size: int, fetch: Fetch, streams: int) -> ReadSource:
        """Starts streaming a version stored on another node into read buffers (in `streams`
        parallel runs); the reader is served while they fill. `fetch(source, start, stop)`
        fills chunks start..stop-1, sets each one's ready event, and sets `answered` (when
        start is 0) as soon as the owner starts sending."""
        lengths = chunk_lengths(size, self.chunk_size)
        source = ReadSource.buffered(version, lengths, self.read_buffers, remote=True)
        if not lengths:
            source.answered.set()
            return source
        source.streaming = True
        self._spawn(self._stream_remote, source, fetch, max(1, min(streams, len(lengths))))
        return source

    async def remote_answered(self, source: ReadSource) -> ReadSource:
        """Waits until the owner answered: an open returns then, so that the kernel's first
        READ is on its way while chunk 0 is still arriving. An owner that no longer has the
        version (or cannot be reached) fails the open itself, and the source is closed."""
        if not source.answered.is_set():
            await source.wait_for(source.answered)
        if 0 in source.failures:
            self.reads.close_read(source)
            raise source.failures[0]
        return source

    async def _stream_remote(self, source: ReadSource, fetch: Fetch, streams: int) -> None:
        count = len(source.chunks)
        bounds = [count * i // streams for i in range(streams + 1)]

        async def run(start: int, stop: int) -> None:
            try:
                await fetch(source, start, stop)
            except Exception as error:
                if not isinstance(error, StorageError):
                    log.exception("fetching chunks %d-%d of version %d failed", start, stop - 1, source.version)
                # Before the owner answered, the open fails with the errno (ENOENT: the
                # version is gone); a transfer broken after that fails reads with EIO.
                refused = start == 0 and not source.answered.is_set()
                for index in range(start, stop):
                    if not source.ready[index].is_set():
                        code = error.errno if isinstance(error, StorageError) and refused and index == 0 else errno.EIO
                        source.failures[index] = StorageError(code, str(error))
                        source.ready[index].set()
                if start == 0:
                    source.answered.set()

        try:
            async with trio.open_nursery() as nursery:
                for start, stop in zip(bounds, bounds[1:]):
                    nursery.start_soon(run, start, stop)
        finally:
            source.end_stream(self.read_buffers)
