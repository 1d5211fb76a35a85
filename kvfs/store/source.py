"""An open reader's bytes: `ReadSource`, and the life of the read buffers behind it.

A source is served from the DRAM tier (no buffers of its own) or from read buffers that
fill chunk by chunk, from SSD or from another node, while the reader is served. A reader
that closes while its chunks still arrive leaves the buffers to the stream, which gives
them back when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from kvfs.errors import StorageError
from kvfs.store.buffers import ReadBufferPool


@dataclass
class ReadSource:
    """Where an open reader's bytes are: the DRAM tier (no chunks) or SSD read buffers that
    fill chunk by chunk while the reader is served (each chunk verified before use)."""

    version: int
    from_dram: bool
    chunks: list[memoryview] = field(default_factory=list)  # per chunk, for SSD reads
    ready: list[trio.Event] = field(default_factory=list)
    failures: dict[int, StorageError] = field(default_factory=dict)  # chunk -> why it cannot be served
    # Remote sources: the owner has answered (it is sending chunk 0, or it failed).
    answered: trio.Event = field(default_factory=trio.Event)
    streaming: bool = False
    closed: bool = False
    remote: bool = False  # streamed from another node

    @property
    def tier(self) -> str:
        """Where the reader is served from: "dram", "ssd" or "peer"."""
        return "dram" if self.from_dram else "peer" if self.remote else "ssd"

    @classmethod
    def buffered(cls, version: int, lengths: list[int], buffers: ReadBufferPool, remote: bool = False) -> ReadSource:
        """A source with one read buffer (and one ready event) per chunk."""
        return cls(version, False, [buffers.take() for _ in lengths], [trio.Event() for _ in lengths], remote=remote)

    async def read_chunks(self, offset: int, length: int, chunk_size: int) -> memoryview | bytes:
        """The bytes at offset..offset+length from the buffers, once their chunks are in."""
        first, last = offset // chunk_size, (offset + length - 1) // chunk_size
        for index in range(first, last + 1):
            if not self.ready[index].is_set():
                await self.ready[index].wait()
            if index in self.failures:  # good chunks are still served; this one never
                raise self.failures[index]
        within = offset - first * chunk_size
        if first == last:
            return self.chunks[first][within : within + length]
        joined = b"".join(self.chunks[i] for i in range(first, last + 1))
        return joined[within : within + length]

    def close(self, buffers: ReadBufferPool) -> None:
        """The reader is done (a buffered source): its buffers go back now, or when its stream ends."""
        self.closed = True
        if not self.streaming:
            self.give_back(buffers)

    def end_stream(self, buffers: ReadBufferPool) -> None:
        """Its chunks are all in (or failed): a reader that closed meanwhile left its
        buffers to the stream, which gives them back now."""
        self.streaming = False
        if self.closed:
            self.give_back(buffers)

    def give_back(self, buffers: ReadBufferPool) -> None:
        for buffer in self.chunks:
            buffers.give_back(buffer)
        self.chunks = []
