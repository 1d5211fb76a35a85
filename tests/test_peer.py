"""Chunk transfer between nodes over real loopback TCP and TLS: a peer server on a real DRAM store."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import foreign_tls, load_tls
from kvfs.checksum import PIECE_SIZE, chunk_checksum, piece_checksums
from kvfs.wire.protocol import PREFIX, FrameKind, encode_frame
from kvfs.wire.protocol import VERSION as WIRE_VERSION
from kvfs.net.handshake import PEER_CLIENTS, Gate, connect
from kvfs.net.streams import serve_tcp
from kvfs.net.transport import PEER_SILENCE_S, ChunkData, FetchChunks, PeerServer, TcpTransport
from kvfs.errors import StorageError
from kvfs.notices import Notices
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.dram import DramTier
from kvfs.store.tiered import TieredStore

OWNER = load_tls("owner")
READER = load_tls("reader")
CHUNK = 1 << 20
VERSION = 7


def make_store(data: bytes) -> TieredStore:
    store = TieredStore(DramTier(32 * CHUNK, chunk_size=CHUNK), None, read_buffers=ReadBufferPool(8, CHUNK))
    store.create(VERSION)
    store.dram.write(VERSION, 0, data)
    store.seal(VERSION, len(data))
    return store


def lengths(size: int) -> list[int]:
    return [min(CHUNK, size - start) for start in range(0, size, CHUNK)]


def with_server(data: bytes, test) -> PeerServer:
    store = make_store(data)
    server = PeerServer(store, OWNER)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            with trio.fail_after(20):
                await test(f"127.0.0.1:{port}")
            nursery.cancel_scope.cancel()

    trio.run(main)
    return server


async def fetch_all(transport: TcpTransport, address: str, size: int, checksums: list[int]) -> bytes:
    targets = [memoryview(bytearray(CHUNK)) for _ in lengths(size)]
    arrived: list[int | str] = []
    await transport.fetch(address, VERSION, 0, targets, lengths(size), checksums, arrived.append,
                          lambda: arrived.append("answer"))
    assert arrived == ["answer", *range(len(targets))]  # the peer's answer is known before any payload
    return b"".join(bytes(t[:n]) for t, n in zip(targets, lengths(size)))


def test_chunks_arrive_exact_and_connections_are_reused() -> None:
    data = os.urandom(3 * CHUNK + 1234)
    checksums = [chunk_checksum(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)]

    async def test(address: str) -> None:
        transport = TcpTransport(READER)
        for _ in range(3):
            assert await fetch_all(transport, address, len(data), checksums) == data
        targets = [memoryview(bytearray(CHUNK)) for _ in range(2)]  # a run in the middle
        await transport.fetch(address, VERSION, 1, targets, [CHUNK, CHUNK], checksums, lambda index: None)
        assert bytes(targets[0]) + bytes(targets[1]) == data[CHUNK : 3 * CHUNK]
        with pytest.raises(StorageError) as raised:  # a version the peer does not hold
            await transport.fetch(address, VERSION + 1, 0, targets[:1], [CHUNK], [], lambda index: None)
        assert raised.value.errno == errno.ENOENT
        assert await fetch_all(transport, address, len(data), checksums) == data  # still in step
        assert len(transport._idle[address]) == 1  # one connection did all of it, one fetch at a time
        await transport.aclose()

    server = with_server(data, test)
    assert server.served_bytes == 4 * len(data) + 2 * CHUNK


def test_a_wrong_checksum_is_eio_and_an_unreachable_peer_enoent() -> None:
    data = os.urandom(CHUNK)

    async def test(address: str) -> None:
        transport = TcpTransport(READER)
        with pytest.raises(StorageError) as raised:
            await fetch_all(transport, address, len(data), [12345])
        assert raised.value.errno == errno.EIO and "checksum" in str(raised.value)
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        free_port = listener.getsockname()[1]
        listener.close()  # nothing listens there now
        with pytest.raises(StorageError) as raised:
            await fetch_all(transport, f"127.0.0.1:{free_port}", len(data), [])
        assert raised.value.errno == errno.ENOENT and "unreachable" in str(raised.value)
        wrong = TcpTransport(foreign_tls("reader"))  # a certificate of another CA
        with pytest.raises(StorageError) as raised:
            await fetch_all(wrong, address, len(data), [])
        assert raised.value.errno == errno.ENOENT

    server = with_server(data, test)
    assert server.refused == 1


async def _handshaken(address: str) -> trio.abc.Stream:
    host, port = address.rsplit(":", 1)
    return (await connect(host, int(port), READER, "node")).stream


async def _until_closed_or_quiet(stream: trio.abc.Stream) -> None:
    """Reads what the server answers until it hangs up or says nothing for a moment."""
    try:
        with trio.move_on_after(0.5):
            while await stream.receive_some(65536):
                pass
    except trio.BrokenResourceError:
        pass


BAD_FRAMES = [
    PREFIX.pack(b"KV", 9, FrameKind.REQUEST, 10, 0, 1),  # wrong version
    PREFIX.pack(b"KV", WIRE_VERSION, FrameKind.REQUEST, 1 << 30, 0, 1),  # oversized header
    PREFIX.pack(b"KV", WIRE_VERSION, FrameKind.REQUEST, 1000, 0, 1) + b"\x01" * 10,  # truncated, then closed
    encode_frame(FrameKind.RESPONSE, 1, FetchChunks(VERSION, 0, 1)),  # a response where a request belongs
    encode_frame(FrameKind.REQUEST, 1, FetchChunks(VERSION, 0, 99)),  # beyond the file: an error reply
    encode_frame(FrameKind.REQUEST, 1, FetchChunks(VERSION, -1, 2)),  # before the file: an error reply
]


@pytest.mark.parametrize("garbage", BAD_FRAMES)
def test_bad_frames_are_refused_and_the_server_keeps_serving(garbage: bytes, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    data = os.urandom(2 * CHUNK)
    checksums = [chunk_checksum(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)]

    async def test(address: str) -> None:
        stream = await _handshaken(address)
        await stream.send_all(garbage)
        await _until_closed_or_quiet(stream)  # the server answers with an error or hangs up, or waits for more
        await stream.aclose()
        assert await fetch_all(TcpTransport(READER), address, len(data), checksums) == data

    with_server(data, test)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(garbage=st.binary(min_size=1, max_size=300), authenticate=st.booleans())
def test_random_bytes_never_take_the_server_down(garbage: bytes, authenticate: bool) -> None:
    data = os.urandom(CHUNK)

    async def test(address: str) -> None:
        stream: trio.abc.Stream
        if authenticate:
            stream = await _handshaken(address)
        else:
            host, port = address.rsplit(":", 1)
            stream = await trio.open_tcp_stream(host, int(port))
        try:
            await stream.send_all(garbage)
        except trio.BrokenResourceError:
            pass  # refused at its first bytes
        await _until_closed_or_quiet(stream)
        await stream.aclose()
        assert await fetch_all(TcpTransport(READER), address, len(data), [chunk_checksum(data)]) == data

    with_server(data, test)


def test_a_remote_open_returns_on_the_answer_and_a_transfer_cut_later_fails_reads_with_eio() -> None:
    """A peer that starts sending a chunk and dies halfway: the open has succeeded (the
    peer had the version), the read of that chunk fails with EIO, nothing hangs."""

    gate = Gate(OWNER, PEER_CLIENTS)
    opened = trio.Event()

    async def dying_peer(stream: trio.SocketStream) -> None:
        admitted = await gate.admit(stream)
        assert admitted is not None
        frames, _ = admitted
        request = await frames.receive()
        await frames.send_encoded(encode_frame(FrameKind.RESPONSE, request.prefix.request_id, ChunkData(0, CHUNK),
                                               CHUNK))
        await frames.send_encoded(b"\0" * (CHUNK // 2))
        # It dies once the open has returned: a death between the answer and the open's return
        # is a race in the store (remote_answered then fails the open), not what this test is about.
        await opened.wait()
        await frames.aclose()

    async def main() -> None:
        reader = TieredStore(DramTier(8 * CHUNK, chunk_size=CHUNK), None, read_buffers=ReadBufferPool(4, CHUNK))
        transport = TcpTransport(READER)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            port = await nursery.start(serve_tcp, dying_peer, "127.0.0.1", 0)

            async def fetch(source, start: int, stop: int) -> None:
                await transport.fetch(f"127.0.0.1:{port}", VERSION, start, source.chunks[start:stop],
                                      [CHUNK] * (stop - start), [0] * stop, lambda index: source.ready[index].set(),
                                      source.answered.set if start == 0 else lambda: None)

            with trio.fail_after(10):
                source = await reader.open_remote(VERSION, 2 * CHUNK, fetch, streams=1)
                opened.set()
                with pytest.raises(StorageError) as raised:
                    await reader.read(source, 0, CHUNK)
                assert raised.value.errno == errno.EIO and "lost peer" in str(raised.value)
                reader.close_read(source)
            nursery.cancel_scope.cancel()

    trio.run(main)


# Pieces: a chunk's first bytes served, verified, before its last ones are in -------------

BIG = 4 * PIECE_SIZE  # a chunk of four pieces, as the node's own chunks are


def big_store(data: bytes) -> TieredStore:
    store = TieredStore(DramTier(4 * BIG, chunk_size=BIG), None, read_buffers=ReadBufferPool(4, BIG))
    store.create(VERSION)
    store.dram.write(VERSION, 0, data)
    store.seal(VERSION, len(data))
    return store


def serve_big(store: TieredStore, test) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            port = await nursery.start(PeerServer(store, OWNER).serve, "127.0.0.1", 0)
            with trio.fail_after(20):
                await test(f"127.0.0.1:{port}")
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_each_piece_is_handed_on_verified_before_its_chunk_is_whole() -> None:
    data = os.urandom(BIG + PIECE_SIZE + 4321)  # chunk 1: a piece and a short one
    chunk_lengths = [BIG, len(data) - BIG]
    checksums = [chunk_checksum(data[:BIG]), chunk_checksum(data[BIG:])]

    async def test(address: str) -> None:
        transport = TcpTransport(READER)
        targets = [memoryview(bytearray(BIG)) for _ in chunk_lengths]
        events: list[object] = []
        await transport.fetch(address, VERSION, 0, targets, chunk_lengths, checksums, events.append,
                              lambda: events.append("answer"), lambda index, verified: events.append((index, verified)))
        assert events == ["answer", (0, PIECE_SIZE), (0, 2 * PIECE_SIZE), (0, 3 * PIECE_SIZE), 0,
                          (1, PIECE_SIZE), 1]
        assert bytes(targets[0]) + bytes(targets[1][: chunk_lengths[1]]) == data
        await transport.aclose()

    serve_big(big_store(data), test)


def test_reports_left_in_notices_come_once_each_in_order_the_last_chunk_after_its_pieces() -> None:
    """The node's way: the thread's reports wait in a Notices (no reader waits), the last
    chunk is reported by the fetch itself once the thread has returned; each report comes
    once, in the order of the bytes, by the time the fetch returns."""
    data = os.urandom(BIG + PIECE_SIZE + 4321)
    chunk_lengths = [BIG, len(data) - BIG]
    checksums = [chunk_checksum(data[:BIG]), chunk_checksum(data[BIG:])]

    async def test(address: str) -> None:
        transport = TcpTransport(READER)
        notices = Notices()
        targets = [memoryview(bytearray(BIG)) for _ in chunk_lengths]
        events: list[object] = []
        await transport.fetch(address, VERSION, 0, targets, chunk_lengths, checksums, events.append,
                              lambda: events.append("answer"), lambda index, verified: events.append((index, verified)),
                              notices=notices)
        assert events == ["answer", (0, PIECE_SIZE), (0, 2 * PIECE_SIZE), (0, 3 * PIECE_SIZE), 0,
                          (1, PIECE_SIZE), 1]
        assert notices.wakeups == 0  # nobody waited: no report woke the loop on its own
        assert bytes(targets[0]) + bytes(targets[1][: chunk_lengths[1]]) == data
        await transport.aclose()

    serve_big(big_store(data), test)


def test_a_corrupt_piece_fails_the_fetch_with_eio_after_the_good_pieces_before_it() -> None:
    data = os.urandom(BIG)
    store = big_store(data)
    at = store.dram.chunk_offsets(VERSION, 0, 1)[0]
    assert at is not None
    store.dram.arena.view[at + PIECE_SIZE + 7] ^= 0xFF  # the owner's copy of piece 1 goes bad after the seal

    async def test(address: str) -> None:
        transport = TcpTransport(READER)
        pieces: list[tuple[int, int]] = []
        with pytest.raises(StorageError) as raised:
            await transport.fetch(address, VERSION, 0, [memoryview(bytearray(BIG))], [BIG], [chunk_checksum(data)],
                                  lambda index: None, lambda: None, lambda index, verified: pieces.append((index, verified)))
        assert raised.value.errno == errno.EIO and "piece 1" in str(raised.value)
        assert pieces == [(0, PIECE_SIZE)]  # only the good piece before it was handed on
        assert transport.checksum_failures == 1
        await transport.aclose()

    serve_big(store, test)


def test_a_read_of_a_first_piece_returns_while_the_rest_of_its_chunk_is_held_back() -> None:
    """An owner that sends a chunk's first piece and then waits: the reader's read of that
    piece returns (verified), a read of the next piece waits until the owner goes on."""
    data = os.urandom(BIG)
    gate = Gate(OWNER, PEER_CLIENTS)
    first_read = trio.Event()

    async def holding_peer(stream: trio.SocketStream) -> None:
        admitted = await gate.admit(stream)
        assert admitted is not None
        frames, _ = admitted
        request = await frames.receive()
        header = ChunkData(0, BIG, piece_checksums(data))
        await frames.send_encoded(encode_frame(FrameKind.RESPONSE, request.prefix.request_id, header, BIG))
        await frames.send_encoded(data[:PIECE_SIZE])
        await first_read.wait()
        await frames.send_encoded(data[PIECE_SIZE:])
        await _until_closed_or_quiet(frames.stream)

    async def main() -> None:
        reader = TieredStore(DramTier(2 * BIG, chunk_size=BIG), None, read_buffers=ReadBufferPool(2, BIG))
        transport = TcpTransport(READER)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader.run)
            port = await nursery.start(serve_tcp, holding_peer, "127.0.0.1", 0)

            async def fetch(source, start: int, stop: int) -> None:
                await transport.fetch(f"127.0.0.1:{port}", VERSION, start, source.chunks[start:stop], [BIG],
                                      [chunk_checksum(data)], lambda index: source.ready[index].set(),
                                      source.answered.set, source.piece_arrived)

            with trio.fail_after(10):
                source = await reader.open_remote(VERSION, BIG, fetch, streams=1)
                assert bytes(await reader.read(source, 0, PIECE_SIZE)) == data[:PIECE_SIZE]
                assert not source.ready[0].is_set()  # the chunk is not whole: its first piece was served
                first_read.set()
                assert bytes(await reader.read(source, PIECE_SIZE, 3 * PIECE_SIZE)) == data[PIECE_SIZE:]
                reader.close_read(source)
            await transport.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)


# Bounds on a peer: stale pooled connections, silent owners, slow owners -------------------


def test_a_pooled_connection_to_a_restarted_peer_is_replaced_transparently() -> None:
    """The owner restarts on the same port: the first fetch after it must not fail on the
    connection the reader kept from before."""
    data = os.urandom(2 * CHUNK)
    checksums = [chunk_checksum(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)]
    store = make_store(data)

    async def main() -> None:
        transport = TcpTransport(READER)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            with trio.fail_after(20):
                first = trio.CancelScope()

                async def serve_until_stopped(task_status=trio.TASK_STATUS_IGNORED) -> None:
                    with first:
                        await PeerServer(store, OWNER).serve("127.0.0.1", 0, task_status=task_status)

                port = await nursery.start(serve_until_stopped)
                address = f"127.0.0.1:{port}"
                assert await fetch_all(transport, address, len(data), checksums) == data
                (before,) = transport._idle[address]
                first.cancel()  # the owner goes, closing its connections
                await nursery.start(PeerServer(store, OWNER).serve, "127.0.0.1", port)  # and comes back
                assert await fetch_all(transport, address, len(data), checksums) == data
                (after,) = transport._idle[address]
                assert after is not before and before.sock.fileno() == -1  # the stale one was closed
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_connection_dropped_as_the_request_arrives_is_retried_once_on_a_new_one() -> None:
    """The race the pool's check cannot see: the peer closes the pooled connection just as the
    request goes out. Nothing of an answer came, so the fetch goes again on a new connection."""
    data = os.urandom(CHUNK)
    gate = Gate(OWNER, PEER_CLIENTS)
    connections = 0

    async def owner(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        this = connections
        admitted = await gate.admit(stream)
        assert admitted is not None
        frames, _ = admitted
        for served in range(2):
            request = await frames.receive()
            if this == 1 and served == 1:
                await frames.aclose()  # the second request on the first connection: gone
                return
            await frames.send(FrameKind.RESPONSE, request.prefix.request_id, ChunkData(0, CHUNK), data)

    async def main() -> None:
        transport = TcpTransport(READER)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_tcp, owner, "127.0.0.1", 0)
            with trio.fail_after(20):
                for _ in range(2):
                    assert await fetch_all(transport, f"127.0.0.1:{port}", CHUNK, [chunk_checksum(data)]) == data
            nursery.cancel_scope.cancel()
        assert connections == 2

    trio.run(main)


def test_a_fetch_asks_its_owner_only_once_a_thread_is_granted_to_receive_the_answer() -> None:
    """The request goes out from the event loop, so that the owner starts on it while the
    receiving thread is being scheduled, but only once that thread is granted: with every
    worker thread taken, the owner is not asked (an answer nobody reads would fill the socket
    until the owner drops the reader as stalled)."""
    data = os.urandom(CHUNK)
    gate = Gate(OWNER, PEER_CLIENTS)
    asked = 0

    async def owner(stream: trio.SocketStream) -> None:
        nonlocal asked
        admitted = await gate.admit(stream)
        assert admitted is not None
        frames, _ = admitted
        while True:
            request = await frames.receive()
            asked += 1
            await frames.send(FrameKind.RESPONSE, request.prefix.request_id, ChunkData(0, CHUNK), data)

    async def main() -> None:
        transport = TcpTransport(READER)
        threads = trio.to_thread.current_default_thread_limiter()
        holders = [object() for _ in range(int(threads.total_tokens))]
        got: list[bytes] = []

        async def load(address: str) -> None:
            got.append(await fetch_all(transport, address, CHUNK, [chunk_checksum(data)]))

        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_tcp, owner, "127.0.0.1", 0)
            address = f"127.0.0.1:{port}"
            with trio.fail_after(20):
                await load(address)  # (the connection is pooled now)
                assert asked == 1
                for holder in holders:
                    threads.acquire_on_behalf_of_nowait(holder)
                try:
                    async with trio.open_nursery() as loads:
                        loads.start_soon(load, address)
                        await trio.testing.wait_all_tasks_blocked(0.05)
                        assert asked == 1 and len(got) == 1  # waiting for a thread; the owner not asked
                        for holder in holders:
                            threads.release_on_behalf_of(holder)
                        holders = []
                finally:
                    for holder in holders:
                        threads.release_on_behalf_of(holder)
            assert asked == 2 and got == [data, data]
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("sent", ["nothing", "half a chunk"])
def test_an_owner_gone_silent_is_detected_within_the_peer_budget(sent: str) -> None:
    """An owner that stops sending (frozen, or cut off by the network) without closing: the
    fetch fails with EIO after PEER_SILENCE_S, not after minutes."""
    release = trio.Event()

    async def frozen_owner(stream: trio.SocketStream) -> None:
        admitted = await Gate(OWNER, PEER_CLIENTS).admit(stream)
        assert admitted is not None
        frames, _ = admitted
        request = await frames.receive()
        if sent == "half a chunk":
            await frames.send_encoded(encode_frame(FrameKind.RESPONSE, request.prefix.request_id,
                                                   ChunkData(0, CHUNK), CHUNK) + b"\0" * (CHUNK // 2))
        await release.wait()  # holds the connection open, saying nothing

    async def main() -> None:
        transport = TcpTransport(READER)
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_tcp, frozen_owner, "127.0.0.1", 0)
            started = trio.current_time()
            with trio.fail_after(PEER_SILENCE_S + 5):
                with pytest.raises(StorageError) as raised:
                    await fetch_all(transport, f"127.0.0.1:{port}", CHUNK, [])
            assert raised.value.errno == errno.EIO and f"silent for {PEER_SILENCE_S:g} s" in str(raised.value)
            assert trio.current_time() - started >= PEER_SILENCE_S  # it waited the budget, no less
            release.set()
            nursery.cancel_scope.cancel()

    trio.run(main)


class SlowSource:
    """A store whose chunks take longer than the reader's silence budget to come (a slow disk)."""

    def __init__(self, store: TieredStore, delay_s: float) -> None:
        self.store = store
        self.chunk_size = store.chunk_size
        self.delay_s = delay_s

    async def serve_chunks(self, version, first, count, send) -> None:
        async def slow_send(index: int, chunk) -> None:
            await trio.sleep(self.delay_s)
            await send(index, chunk)

        await self.store.serve_chunks(version, first, count, slow_send)


def test_an_owner_that_is_slow_but_alive_pulses_and_the_fetch_completes() -> None:
    data = os.urandom(2 * CHUNK)
    checksums = [chunk_checksum(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)]
    store = make_store(data)

    async def main() -> None:
        transport = TcpTransport(READER)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            port = await nursery.start(PeerServer(SlowSource(store, PEER_SILENCE_S + 0.5), OWNER).serve,
                                       "127.0.0.1", 0)
            started = trio.current_time()
            with trio.fail_after(30):
                assert await fetch_all(transport, f"127.0.0.1:{port}", len(data), checksums) == data
            assert trio.current_time() - started > 2 * PEER_SILENCE_S  # it did outlast the silence budget
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_reader_gone_mid_transfer_is_no_error_on_the_owner(caplog: pytest.LogCaptureFixture) -> None:
    data = os.urandom(3 * CHUNK)
    checksums = [chunk_checksum(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)]

    async def test(address: str) -> None:
        host, port = address.rsplit(":", 1)
        frames = await connect(host, int(port), READER, "node")
        await frames.send(FrameKind.REQUEST, 1, FetchChunks(VERSION, 0, 3))
        await frames.stream.receive_some(1000)  # the answer has started
        await frames.aclose()  # and the reader is gone
        assert await fetch_all(TcpTransport(READER), address, len(data), checksums) == data

    with_server(data, test)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_peers_that_stop_reading_hold_no_worker_and_are_dropped_while_a_fetch_succeeds(
        caplog: pytest.LogCaptureFixture) -> None:
    """Sixteen connections of one identity ask for 24 MiB each and never read: they take at
    most their identity's share of fetches, no worker thread while their sockets are full, and
    are dropped (logged) after the stall budget. Another node's 8 MiB fetch meanwhile succeeds
    as usual."""
    import socket

    caplog.set_level(logging.WARNING)
    data = os.urandom(24 * CHUNK)
    checksums = [chunk_checksum(data[i : i + CHUNK]) for i in range(0, len(data), CHUNK)]
    store = TieredStore(DramTier(32 * CHUNK, chunk_size=CHUNK), None, read_buffers=ReadBufferPool(8, CHUNK))
    store.create(VERSION)
    store.dram.write(VERSION, 0, data)
    store.seal(VERSION, len(data))
    server = PeerServer(store, OWNER, send_stall_s=3, fetches_per_peer=4)
    mallory = load_tls("mallory")

    def small_window(sock) -> None:  # the stalled readers' kernel buffers stay small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            stalled = []
            for request_id in range(16):
                frames = await connect("127.0.0.1", port, mallory, "node", tune=small_window)
                await frames.send(FrameKind.REQUEST, request_id + 1, FetchChunks(VERSION, 0, 24))
                stalled.append(frames)
            with trio.fail_after(30):  # generous: on an idle machine this takes milliseconds
                got = await fetch_all(TcpTransport(READER), f"127.0.0.1:{port}", 8 * CHUNK, checksums[:8])
            assert got == data[: 8 * CHUNK]
            # Their sockets full, the four fetches of their share wait in the event loop, holding no thread.
            shares, threads = server._peers["mallory"][0], server._send_threads
            assert threads is not None
            with trio.fail_after(30):
                while threads.borrowed_tokens or shares.borrowed_tokens < 4:
                    await trio.sleep(0.01)
            assert server.stalled == 0 and shares.statistics().tasks_waiting == 12
            with trio.fail_after(30):  # every stalled reader is dropped after the stall budget
                while server.stalled < 16:
                    await trio.sleep(0.05)
            assert "mallory" not in server._peers  # nothing of theirs is held any more
            for frames in stalled:
                await frames.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    dropped = [r.getMessage() for r in caplog.records if "dropped peer connection" in r.getMessage()]
    assert dropped and all("node 'mallory'" in line and "took no data for 3 s" in line for line in dropped)
    assert len(dropped) == 10  # a budget of lines; the count has every one
