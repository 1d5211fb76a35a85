"""The owner's answers (kvfs.net.answers): the connection's one pulse task, which speaks only
while a fetch waits on its store (frames across a full socket: tests/test_owner_sends.py)."""

from __future__ import annotations

import os

import trio

from conftest import load_tls
from kvfs.checksum import chunk_checksum
from kvfs.net.answers import PULSE_S, ChunkData
from kvfs.net.handshake import connect
from kvfs.net.transport import FetchChunks, PeerServer
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.dram import DramTier
from kvfs.store.tiered import TieredStore
from kvfs.wire.protocol import FrameKind, HeaderDecoder

OWNER = load_tls("owner")
READER = load_tls("reader")
CHUNK = 1 << 20
FAST, SLOW = 7, 8  # versions: SLOW's chunks take 1.5 PULSE_S to come from the store


class SlowSource:
    """A real DRAM store in front of which version SLOW's chunks wait 1.5 PULSE_S (a slow disk)."""

    def __init__(self, store: TieredStore) -> None:
        self.store = store
        self.chunk_size = store.chunk_size

    async def serve_chunks(self, version, first, count, send) -> None:
        async def slow_send(index: int, chunk) -> None:
            await trio.sleep(1.5 * PULSE_S)
            await send(index, chunk)

        await self.store.serve_chunks(version, first, count, slow_send if version == SLOW else send)


def test_pulses_come_only_while_a_fetch_waits_on_its_store() -> None:
    data = {version: os.urandom(CHUNK) for version in (FAST, SLOW)}
    store = TieredStore(DramTier(8 * CHUNK, chunk_size=CHUNK), None, read_buffers=ReadBufferPool(2, CHUNK))
    for version, content in data.items():
        store.create(version)
        store.dram.write(version, 0, content)
        store.seal(version, len(content))
    chunks = HeaderDecoder(ChunkData)

    async def answer(frames, request_id: int, version: int) -> int:
        """Asks for the version's chunk; returns how many pulses came before it."""
        await frames.send(FrameKind.REQUEST, request_id, FetchChunks(version, 0, 1))
        pulses = 0
        while True:
            frame = await frames.receive()
            assert frame.prefix.request_id == request_id
            if frame.prefix.kind == FrameKind.PULSE:
                pulses += 1
                continue
            assert frame.prefix.kind == FrameKind.RESPONSE
            reply = chunks.decode(frame.header)
            assert (reply.index, reply.length) == (0, CHUNK)
            assert chunk_checksum(frame.payload) == chunk_checksum(data[version])
            return pulses

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            port = await nursery.start(PeerServer(SlowSource(store), OWNER).serve, "127.0.0.1", 0)
            frames = await connect("127.0.0.1", port, READER, "node", sealed=True)
            with trio.fail_after(30):
                assert await answer(frames, 1, SLOW) >= 1  # the store kept it waiting: pulses
                assert await answer(frames, 2, FAST) == 0
                with trio.move_on_after(2.5 * PULSE_S) as quiet:  # between fetches: silence
                    await frames.receive()
                assert quiet.cancelled_caught
                assert await answer(frames, 3, FAST) == 0  # no stale pulse ahead of the next answer
                assert await answer(frames, 4, SLOW) >= 1  # and pulses again for the next slow one
            await frames.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
