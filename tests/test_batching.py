"""Several files' chunk runs in one request to their owner: `FetchBatch` on a real peer server
over loopback TLS, and the node's `FetchBatcher`, which sends prefetches waiting for a turn
together. One bad or missing file fails alone; a hostile batch is refused."""

from __future__ import annotations

import errno
import os

import pytest
import trio
import trio.testing

from conftest import load_tls
from kvfs.checksum import PIECE_SIZE, chunk_checksum
from kvfs.errors import StorageError
from kvfs.net.transport import MAX_BATCH_CHUNKS, MAX_BATCH_RUNS, FetchBatch, FetchChunks, FetchRun, PeerServer, \
    TcpTransport
from kvfs.node.batching import FetchBatcher
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.dram import DramTier
from kvfs.store.tiered import TieredStore
from kvfs.wire.protocol import FrameKind, encode_frame
from test_peer import _handshaken

OWNER = load_tls("owner")
READER = load_tls("reader")
CHUNK = 4 * PIECE_SIZE  # a node's chunk: four pieces, each verified as it arrives
ABSENT = 99


def owner_store(files: dict[int, bytes]) -> TieredStore:
    store = TieredStore(DramTier(16 * CHUNK, chunk_size=CHUNK), None, read_buffers=ReadBufferPool(4, CHUNK))
    for version, data in files.items():
        store.create(version)
        store.dram.write(version, 0, data)
        store.seal(version, len(data))
    return store


def chunks_of(data: bytes) -> list[bytes]:
    return [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]


def serve(store: TieredStore, test) -> PeerServer:
    server = PeerServer(store, OWNER)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            with trio.fail_after(30):  # a hang fails the test instead of stalling the suite
                await test(f"127.0.0.1:{port}")
            nursery.cancel_scope.cancel()

    trio.run(main)
    return server


class Received:
    """One run's targets and what its callbacks reported, in order."""

    def __init__(self, version: int, data: bytes, first: int = 0, count: int | None = None,
                 checksums: list[int] | None = None) -> None:
        pieces = chunks_of(data)
        count = len(pieces) - first if count is None else count
        self.data = data
        self.events: list[object] = []
        self.run = FetchRun(version, first, [memoryview(bytearray(CHUNK)) for _ in range(count)],
                            [len(piece) for piece in pieces[first : first + count]] or [CHUNK] * count,
                            [chunk_checksum(piece) for piece in pieces] if checksums is None else checksums,
                            self.events.append, lambda: self.events.append("answer"),
                            lambda index, verified: self.events.append((index, verified)))

    def bytes(self) -> bytes:
        return b"".join(bytes(target[:length]) for target, length in zip(self.run.targets, self.run.lengths))


def test_a_batch_fills_each_run_in_order_and_a_bad_or_missing_file_fails_alone() -> None:
    files = {7: os.urandom(2 * CHUNK + 4321), 8: os.urandom(CHUNK), 9: os.urandom(PIECE_SIZE + 17),
             10: os.urandom(CHUNK)}
    good, corrupt = files[7], files[8]

    async def test(address: str) -> None:
        transport = TcpTransport(READER)
        runs = [Received(7, good),
                Received(ABSENT, b"\0" * CHUNK),  # the owner does not have it: ENOENT for this file only
                Received(8, corrupt, checksums=[12345]),  # fails its checksum on the reader: EIO
                Received(9, files[9], first=0, count=3),  # beyond the file: the owner refuses this run
                Received(10, files[10])]
        outcomes = await transport.fetch_batch(address, [r.run for r in runs])
        assert outcomes[0] is None and runs[0].bytes() == good
        assert runs[0].events == ["answer", (0, PIECE_SIZE), (0, 2 * PIECE_SIZE), (0, 3 * PIECE_SIZE), 0,
                                  (1, PIECE_SIZE), (1, 2 * PIECE_SIZE), (1, 3 * PIECE_SIZE), 1, 2]
        assert isinstance(outcomes[1], StorageError) and outcomes[1].errno == errno.ENOENT
        assert runs[1].events == []  # never answered: an open of it fails, as a fetch of it alone would
        assert isinstance(outcomes[2], StorageError) and outcomes[2].errno == errno.EIO
        assert "checksum" in str(outcomes[2]) and 0 not in runs[2].events  # its chunk is never served
        assert isinstance(outcomes[3], StorageError) and outcomes[3].errno == errno.EINVAL
        assert outcomes[4] is None and runs[4].bytes() == files[10]
        assert runs[4].events[0] == "answer" and runs[4].events[-1] == 0
        assert transport.checksum_failures == 1
        assert transport.fetches.counts == {("batch", "ok"): 1}
        # The connection is still in step, and went back to the pool: a plain fetch follows on it.
        after = Received(8, corrupt)
        await transport.fetch(address, 8, 0, after.run.targets, after.run.lengths, after.run.checksums,
                              after.run.on_chunk)
        assert after.bytes() == corrupt and len(transport._idle[address]) == 1
        await transport.aclose()

    server = serve(owner_store(files), test)
    assert server.served_bytes == len(good) + 2 * len(corrupt) + len(files[10])


def test_a_corrupt_piece_in_a_batch_fails_its_file_and_the_next_file_arrives_whole() -> None:
    files = {7: os.urandom(CHUNK), 8: os.urandom(CHUNK)}
    store = owner_store(files)
    at = store.dram.chunk_offsets(7, 0, 1)[0]
    assert at is not None
    store.dram.arena.view[at + PIECE_SIZE + 3] ^= 0xFF  # the owner's copy of piece 1 goes bad after the seal

    async def test(address: str) -> None:
        transport = TcpTransport(READER)
        runs = [Received(7, files[7]), Received(8, files[8])]
        outcomes = await transport.fetch_batch(address, [r.run for r in runs])
        assert isinstance(outcomes[0], StorageError) and outcomes[0].errno == errno.EIO
        assert "piece 1" in str(outcomes[0])
        assert runs[0].events == ["answer", (0, PIECE_SIZE)]  # only the good piece before it was handed on
        assert outcomes[1] is None and runs[1].bytes() == files[8] and runs[1].events[-1] == 0
        await transport.aclose()

    serve(store, test)


def test_a_corrupt_last_piece_fails_its_chunk_and_nothing_of_that_chunk_is_served_after_the_good_pieces() -> None:
    """The last piece of a chunk is verified with the whole chunk (its own checksum is not
    computed as well): a bad one still fails the file with EIO, once, after the good pieces."""
    files = {7: os.urandom(CHUNK), 8: os.urandom(CHUNK)}
    store = owner_store(files)
    at = store.dram.chunk_offsets(7, 0, 1)[0]
    assert at is not None
    store.dram.arena.view[at + 3 * PIECE_SIZE + 5] ^= 0xFF  # the owner's copy of the last piece goes bad

    async def test(address: str) -> None:
        transport = TcpTransport(READER)
        runs = [Received(7, files[7]), Received(8, files[8])]
        outcomes = await transport.fetch_batch(address, [r.run for r in runs])
        assert isinstance(outcomes[0], StorageError) and outcomes[0].errno == errno.EIO
        assert "fails its checksum" in str(outcomes[0]) and transport.checksum_failures == 1
        assert runs[0].events == ["answer", (0, PIECE_SIZE), (0, 2 * PIECE_SIZE), (0, 3 * PIECE_SIZE)]
        assert outcomes[1] is None and runs[1].bytes() == files[8]
        await transport.aclose()

    serve(store, test)


HOSTILE = [
    FetchBatch([]),
    FetchBatch([FetchChunks(7, 0, 1)] * (MAX_BATCH_RUNS + 1)),
    FetchBatch([FetchChunks(7, 0, 1), FetchChunks(7, 0, 0)]),  # an empty run
    FetchBatch([FetchChunks(7, 0, -3), FetchChunks(7, 0, 5)]),  # a negative count to fit the total
    FetchBatch([FetchChunks(7, 0, MAX_BATCH_CHUNKS // 2 + 1)] * 2),  # over the chunks a batch may ask
]


@pytest.mark.parametrize("batch", HOSTILE)
def test_a_hostile_batch_is_refused_unanswered_and_the_server_keeps_serving(batch: FetchBatch) -> None:
    data = os.urandom(CHUNK)

    async def test(address: str) -> None:
        stream = await _handshaken(address)
        await stream.send_all(encode_frame(FrameKind.REQUEST, 1, batch))
        answered = b""
        try:
            while chunk := await stream.receive_some(65536):  # until the server hangs up
                answered += chunk
        except trio.BrokenResourceError:
            pass
        assert answered == b""  # not one chunk served from it
        await stream.aclose()
        good = Received(7, data)
        assert await TcpTransport(READER).fetch_batch(address, [good.run, Received(7, data).run]) == [None, None]
        assert good.bytes() == data

    server = serve(owner_store({7: data}), test)
    assert server.served_bytes == 2 * len(data)


def test_prefetches_waiting_for_a_turn_go_in_one_batch_and_bad_files_fail_only_their_opens() -> None:
    """The node's path: runs started with the store's `start_remote` (as a lookup's prefetch
    does) wait for the one turn; the turn's holder carries the queued runs in one request, up
    to the batcher's chunks; the rest go with the next turn."""
    files = {7: os.urandom(CHUNK), 8: os.urandom(CHUNK), 9: os.urandom(CHUNK), 10: os.urandom(CHUNK)}
    corrupt = 9
    order = [7, ABSENT, 8, corrupt, 10]  # as the lookups come

    async def test(address: str) -> None:
        transport = TcpTransport(READER)
        turns = trio.Semaphore(1)
        batcher = FetchBatcher(transport, turns, most=4)
        reader = TieredStore(DramTier(4 * CHUNK, chunk_size=CHUNK), None, read_buffers=ReadBufferPool(8, CHUNK))

        def fetcher(version: int, data: bytes):
            checksums = [12345] if version == corrupt else [chunk_checksum(data)]

            async def fetch(source, start: int, stop: int) -> None:
                try:
                    await batcher.fetch(address, FetchRun(version, start, source.chunks[start:stop], [len(data)],
                                                          checksums, lambda index: source.ready[index].set(),
                                                          source.answered.set, source.piece_arrived))
                finally:
                    fetched.append(version)
                    if len(fetched) == len(order):
                        all_fetched.set()
            return fetch

        fetched: list[int] = []
        all_fetched = trio.Event()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            await trio.testing.wait_all_tasks_blocked()
            sources = {}
            async with turns:  # a transfer holds the only turn while the lookups come in, one by one
                for version in order:
                    sources[version] = reader.start_remote(version, CHUNK,
                                                           fetcher(version, files.get(version, b"\0" * CHUNK)), 1)
                    await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(StorageError) as raised:
                await reader.remote_answered(sources[ABSENT])
            assert raised.value.errno == errno.ENOENT  # its open fails; the master is asked again
            for version in (7, 8, 10):
                source = await reader.remote_answered(sources[version])
                assert bytes(await reader.read(source, 0, CHUNK)) == files[version]
                reader.close_read(source)
            with pytest.raises(StorageError) as raised:  # its only chunk came in bad: EIO, as alone
                await reader.remote_answered(sources[corrupt])
            assert raised.value.errno == errno.EIO and "checksum" in str(raised.value)
            await all_fetched.wait()  # (a chunk is served before its fetch's thread is back)
            assert batcher.batches == 1 and batcher.batched_runs == 4  # 7, absent, 8, 9: four chunks
            assert transport.fetches.counts == {("batch", "ok"): 1, ("fetch", "ok"): 1}  # 10 alone
            assert not batcher._queues
            await trio.testing.wait_all_tasks_blocked()  # the streams end and give their buffers back
            assert reader.read_buffers.available == 8
            nursery.cancel_scope.cancel()
        await transport.aclose()

    serve(owner_store(files), test)


def test_a_run_cancelled_while_it_waits_for_a_turn_leaves_the_queue_and_is_not_fetched() -> None:
    files = {7: os.urandom(CHUNK), 8: os.urandom(CHUNK)}

    async def test(address: str) -> None:
        transport = TcpTransport(READER)
        turns = trio.Semaphore(1)
        batcher = FetchBatcher(transport, turns)
        kept, dropped = Received(7, files[7]), Received(8, files[8])
        async with trio.open_nursery() as nursery:
            async with turns:
                nursery.start_soon(batcher.fetch, address, kept.run)
                await trio.testing.wait_all_tasks_blocked()
                with trio.CancelScope() as scope:
                    scope.cancel()  # the reader gave up before a turn came
                    await batcher.fetch(address, dropped.run)
                assert [waiting.run for waiting in batcher._queues[address]] == [kept.run]
        assert kept.bytes() == files[7] and dropped.events == []
        assert transport.fetches.counts == {("fetch", "ok"): 1} and batcher.batches == 0 and not batcher._queues
        await transport.aclose()

    serve(owner_store(files), test)
