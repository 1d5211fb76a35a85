"""The owner's sends of a whole request at once: a batch's DRAM runs and their error frames in
one go, sealed and plain, through a real peer server and the TCP transport, with every pin
given back; the sends' own pieces across a socket that fills; the light worker-thread hop."""

from __future__ import annotations

import errno
import os
import select
import socket
import threading

import pytest
import trio
import trio.testing

from conftest import load_tls
from inprocess import until
from kvfs.checksum import PIECE_SIZE, chunk_checksum
from kvfs.errors import StorageError
from kvfs.net.answers import send_views_some, send_views_waiting, sendmsg_some
from kvfs.net.hop import in_thread
from kvfs.net.sealed import SealedSocket
from kvfs.net.transport import FetchRun, PeerServer, TcpTransport
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.dram import DramTier
from kvfs.store.tiered import TieredStore

CHUNK = 2 * PIECE_SIZE
ABSENT = 99


def runs_of(files: dict[int, bytes], versions: list[int]) -> tuple[list[FetchRun], list[list[int]]]:
    """A run per version (ABSENT: a file the owner does not have), and the chunks each reported."""
    runs, reported = [], []
    for version in versions:
        data = files.get(version, b"\0" * CHUNK)
        pieces = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)]
        chunks: list[int] = []
        reported.append(chunks)
        runs.append(FetchRun(version, 0, [memoryview(bytearray(CHUNK)) for _ in pieces],
                             [len(piece) for piece in pieces], [chunk_checksum(piece) for piece in pieces],
                             chunks.append))
    return runs, reported


@pytest.mark.parametrize("plaintext", [False, True])
def test_a_batch_of_dram_runs_goes_out_in_order_with_its_errors_and_every_pin_comes_back(plaintext: bool) -> None:
    files = {version: os.urandom(CHUNK * (1 + version % 3) + version) for version in range(1, 13)}
    store = TieredStore(DramTier(64 * CHUNK, chunk_size=CHUNK), None, read_buffers=ReadBufferPool(2, CHUNK))
    for version, data in files.items():
        store.create(version)
        store.dram.write(version, 0, data)
        store.seal(version, len(data))
    server = PeerServer(store, load_tls("owner"), plaintext=plaintext)
    # Errors first, in the middle and last: each fails its own run, the others arrive whole.
    versions = [ABSENT, 1, 2, ABSENT, 3, 4, 5, ABSENT]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            transport = TcpTransport(load_tls("reader"), plaintext=plaintext)
            with trio.fail_after(30):
                for batch in (versions, list(range(6, 13)), [12]):  # and a connection in step after each
                    runs, reported = runs_of(files, batch)
                    outcomes = await transport.fetch_batch(f"127.0.0.1:{port}", runs)
                    await trio.testing.wait_all_tasks_blocked()  # the reports have run
                    for version, run, outcome, chunks in zip(batch, runs, outcomes, reported):
                        if version == ABSENT:
                            assert isinstance(outcome, StorageError) and outcome.errno == errno.ENOENT
                            assert chunks == []
                            continue
                        assert outcome is None and chunks == list(range(len(run.targets)))
                        got = b"".join(bytes(t[:n]) for t, n in zip(run.targets, run.lengths))
                        assert got == files[version]
            assert transport.connections == 1
            assert server.plaintext_connections == int(plaintext)
            # Views given back: the owner releases them once its send thread returns, which can
            # be just after the reader has the last byte.
            await until(lambda: not any(store.residency.pinned(version) for version in files), 10)
            await transport.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)
    served = sum(len(files[v]) for v in versions if v != ABSENT) + sum(len(files[v]) for v in range(6, 13))
    assert server.served_bytes == served + len(files[12])


class DiskFor:
    """The real store, but the given versions it serves chunk by chunk (`serve_chunks`), as it
    does a version on SSD alone: the peer server's other path, between held runs."""

    def __init__(self, store: TieredStore, versions: set[int]) -> None:
        self.store = store
        self.chunk_size = store.chunk_size
        self.versions = versions
        self.piece_checksums = store.piece_checksums
        self.serve_chunks = store.serve_chunks

    def hold_chunks(self, version: int, first: int, count: int):
        return None if version in self.versions else self.store.hold_chunks(version, first, count)


def test_runs_served_chunk_by_chunk_keep_their_place_between_held_runs() -> None:
    files = {version: os.urandom(CHUNK * version + 99) for version in (1, 2, 3, 4)}
    store = TieredStore(DramTier(32 * CHUNK, chunk_size=CHUNK), None, read_buffers=ReadBufferPool(2, CHUNK))
    for version, data in files.items():
        store.create(version)
        store.dram.write(version, 0, data)
        store.seal(version, len(data))
    server = PeerServer(DiskFor(store, {2, 4}), load_tls("owner"))
    versions = [1, 2, ABSENT, 3, 4, 1]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            transport = TcpTransport(load_tls("reader"))
            with trio.fail_after(30):
                runs, reported = runs_of(files, versions)
                outcomes = await transport.fetch_batch(f"127.0.0.1:{port}", runs)
                await trio.testing.wait_all_tasks_blocked()
            for version, run, outcome, chunks in zip(versions, runs, outcomes, reported):
                if version == ABSENT:
                    assert isinstance(outcome, StorageError) and outcome.errno == errno.ENOENT
                    continue
                assert outcome is None and chunks == list(range(len(run.targets)))
                assert b"".join(bytes(t[:n]) for t, n in zip(run.targets, run.lengths)) == files[version]
            await until(lambda: not any(store.residency.pinned(version) for version in files), 10)
            await transport.aclose()
            nursery.cancel_scope.cancel()

    trio.run(main)


def views_across_a_full_socket(how: str) -> None:
    plain = how == "plain"
    key_a, key_b = os.urandom(32), os.urandom(32)
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
    sender = left if plain else SealedSocket(left, key_a, key_b)
    receiver = right if plain else SealedSocket(right, key_b, key_a)
    sender.setblocking(False)
    parts = [os.urandom(size) for size in (30, 3 * CHUNK + 17, 0, 41, CHUNK, 1, 0, 2 * CHUNK + 5)]
    expected = b"".join(parts)
    full = threading.Event()
    received = bytearray(len(expected))

    def receive() -> None:
        full.wait(10)  # the socket fills before anything is read
        view, got = memoryview(received), 0
        while got < len(view):
            count = receiver.recv_into(view[got:])
            assert count
            got += count

    reader = threading.Thread(target=receive)
    reader.start()
    views = [memoryview(part) for part in parts]
    at, calls = 0, 0
    while at < len(views):
        if how == "waiting":  # the reader reads nothing until this returns: it does return
            at = send_views_waiting(sender, views, at)
        else:
            at = sendmsg_some(left, views, at) if plain else send_views_some(sender, views, at)
        calls += 1
        if at < len(views):
            full.set()
            select.select([], [left], [], 10)
    full.set()
    reader.join(10)
    assert calls > 1  # it did stop at a full socket and go on from where it said
    assert bytes(received) == expected
    left.close()
    right.close()


@pytest.mark.parametrize("how", ["sealed", "plain", "waiting"])
def test_a_request_s_views_go_out_whole_and_in_order_across_a_full_socket(how: str) -> None:
    views_across_a_full_socket(how)


def test_the_hop_returns_raises_bounds_its_threads_and_outlives_a_cancel() -> None:
    running, most = 0, 0
    lock = threading.Lock()
    release = threading.Event()

    def work(value: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.wait(10)
        with lock:
            running -= 1
        return value * 2

    def fail() -> None:
        raise ConnectionResetError("gone")

    async def main() -> None:
        limiter = trio.CapacityLimiter(2)
        results: list[int] = []

        async def one(value: int) -> None:
            results.append(await in_thread(limiter, work, value))

        async with trio.open_nursery() as nursery:
            for value in range(5):
                nursery.start_soon(one, value)
            await until(lambda: running >= 2, 10)  # two threads run (threads are not tasks trio can wait on)
            assert limiter.borrowed_tokens == 2  # two threads at once; three tasks wait their turn
            release.set()
        assert sorted(results) == [0, 2, 4, 6, 8] and most == 2 and limiter.borrowed_tokens == 0
        with pytest.raises(ConnectionResetError):
            await in_thread(limiter, fail)
        assert limiter.borrowed_tokens == 0
        release.clear()
        finished: list[int] = []
        timer = threading.Timer(0.5, release.set)  # the thread outlasts the cancel below
        timer.start()
        with trio.move_on_after(0.1) as scope:
            finished.append(await in_thread(limiter, work, 21))
            assert running == 0  # it went on only once the thread had returned
            await trio.sleep(0)  # and the cancel lands at the next checkpoint
        timer.join()
        assert finished == [42] and scope.cancelled_caught and limiter.borrowed_tokens == 0

    trio.run(main)


def test_the_hop_s_first_step_runs_in_the_loop_with_a_token_held_and_a_failing_one_starts_no_thread() -> None:
    """What must not wait for the thread to be scheduled (a reader's request) runs in the event
    loop, once a thread is granted; if it fails, no thread starts and the token goes back."""
    loop_thread = threading.get_ident()

    async def main() -> None:
        limiter = trio.CapacityLimiter(1)
        seen: list[tuple[str, int, int]] = []

        def first() -> None:
            seen.append(("first", threading.get_ident(), limiter.borrowed_tokens))

        def work() -> int:
            seen.append(("work", threading.get_ident(), limiter.borrowed_tokens))
            return 5

        assert await in_thread(limiter, work, first=first) == 5
        assert [step for step, _, _ in seen] == ["first", "work"]
        assert seen[0][1:] == (loop_thread, 1) and seen[1][1] != loop_thread

        def refuse() -> None:
            raise BrokenPipeError("gone")

        ran: list[int] = []
        with pytest.raises(BrokenPipeError):
            await in_thread(limiter, ran.append, 1, first=refuse)
        assert ran == [] and limiter.borrowed_tokens == 0

    trio.run(main)
