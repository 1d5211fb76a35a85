"""An open reader's bytes: `ReadSource`, and the life of the read buffers behind it.

A source is served from the DRAM tier (no buffers of its own) or from read buffers that
fill chunk by chunk, from SSD or from another node, while the reader is served (from
another node piece by piece, where the owner sends piece checksums). A reader
that closes while its chunks still arrive leaves the buffers to the stream, which gives
them back when it ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from kvfs.errors import StorageError
from kvfs.notices import Notices
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
    # Per chunk not yet whole, how many of its first bytes are in and verified (piece by
    # piece). A piece sets the chunk's `ready` event and puts a new one in its place, so
    # that its readers wake and serve what they can; `ready[index]` set means the chunk is
    # whole (or failed).
    verified: list[int] = field(default_factory=list)
    # The reports of fetches still filling it, which wait until wanted (kvfs.notices).
    notices: list[Notices] = field(default_factory=list)
    waiters: int = 0  # readers waiting now: reports reach the loop as they come

    def __post_init__(self) -> None:
        if len(self.verified) != len(self.chunks):
            self.verified = [0] * len(self.chunks)

    @property
    def tier(self) -> str:
        """Where the reader is served from: "dram", "ssd" or "peer"."""
        return "dram" if self.from_dram else "peer" if self.remote else "ssd"

    @classmethod
    def buffered(cls, version: int, lengths: list[int], buffers: ReadBufferPool, remote: bool = False) -> ReadSource:
        """A source with one read buffer (and one ready event) per chunk."""
        return cls(version, False, [buffers.take() for _ in lengths], [trio.Event() for _ in lengths], remote=remote)

    async def wait_for(self, event: trio.Event) -> None:
        """Waits for `event` (a chunk, a piece, the owner's answer): what the fetches have
        reported is taken first, and while this waits each report wakes the loop as it
        comes (of fetches that start meanwhile too)."""
        self.waiters += 1
        try:
            for notices in self.notices:
                notices.want()
            await event.wait()
        finally:
            self.waiters -= 1
            for notices in self.notices:
                notices.unwant()

    def add_notices(self, notices: Notices) -> None:
        """A fetch into this source starts: its reports wait until a reader waits."""
        self.notices.append(notices)
        for _ in range(self.waiters):
            notices.want()

    def end_notices(self, notices: Notices) -> None:
        """That fetch ended: what it reported and nobody wanted yet is delivered now."""
        self.notices.remove(notices)
        notices.deliver()

    def piece_arrived(self, index: int, verified: int) -> None:
        """The first `verified` bytes of chunk `index` are in and verified."""
        self.verified[index] = max(self.verified[index], verified)
        waiting, self.ready[index] = self.ready[index], trio.Event()
        waiting.set()

    async def read_chunks(self, offset: int, length: int, chunk_size: int) -> memoryview | bytes:
        """The bytes at offset..offset+length from the buffers, once they are in and verified
        (their whole chunk, or the pieces that hold them)."""
        first, last = offset // chunk_size, (offset + length - 1) // chunk_size
        end = offset + length
        for index in range(first, last + 1):
            needed = min(end - index * chunk_size, chunk_size)
            while not self.ready[index].is_set() and self.verified[index] < needed:
                # (a piece wakes it too: see `verified`; what was reported may already hold it)
                await self.wait_for(self.ready[index])
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
