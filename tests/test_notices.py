"""A fetch's reports from its worker thread reach the event loop when a reader waits for
them, or when the fetch ends (kvfs.notices; the last chunk's on the thread's return): in order, each once, and at once for a
reader that waits while the bytes still arrive. On real worker threads, a real peer server
over loopback, and a real master and nodes."""

from __future__ import annotations

import json
import os
import threading

import trio

from conftest import Cluster, wait_until
from kvfs.checksum import PIECE_SIZE, chunk_checksum
from kvfs.notices import Notices
from kvfs.net.transport import TcpTransport
from test_batching import CHUNK, READER, owner_store, serve

MiB = 1 << 20


def test_reports_wait_until_a_reader_waits_and_wake_the_loop_only_while_it_waits() -> None:
    async def main() -> None:
        notices = Notices()
        seen: list[int] = []
        first_two_posted = threading.Event()
        waiting = threading.Event()  # the loop's reader waits from now on
        third_seen = threading.Event()  # set by the loop: the thread waits for it

        def third(n: int) -> None:  # in the loop: the waiting reader wakes with it
            seen.append(n)
            notices.unwant()
            third_seen.set()

        def worker() -> None:
            notices.post(seen.append, 1)
            notices.post(seen.append, 2)
            first_two_posted.set()
            assert waiting.wait(10)
            notices.post(third, 3)
            # A reader waits by now: the loop must get report 3 while this thread still runs.
            assert third_seen.wait(10), "a report did not reach the waiting loop while the thread ran"
            notices.post(seen.append, 4)  # nobody waits any more: it waits too

        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.to_thread.run_sync, worker)
                await trio.to_thread.run_sync(first_two_posted.wait)
                assert seen == []  # posted, nobody waiting: nothing woke the loop for them
                notices.want()
                assert seen == [1, 2]  # taken at once, in order
                waiting.set()
        assert seen == [1, 2, 3]  # the thread has ended; report 4 waits for the fetch's end
        notices.deliver()  # (the fetch's task does this once the thread's call has ended)
        assert seen == [1, 2, 3, 4]
        assert notices.posted == 4 and notices.wakeups == 1

    trio.run(main)


def test_a_fetch_nobody_waits_for_reports_everything_at_its_end_in_order() -> None:
    data = os.urandom(CHUNK + PIECE_SIZE + 99)
    lengths = [CHUNK, len(data) - CHUNK]
    checksums = [chunk_checksum(data[:CHUNK]), chunk_checksum(data[CHUNK:])]

    async def fetch(transport: TcpTransport, address: str, notices: Notices | None) -> tuple[list[object], bytes]:
        targets = [memoryview(bytearray(CHUNK)) for _ in lengths]
        events: list[object] = []
        extra = {"notices": notices} if notices is not None else {}
        await transport.fetch(address, 7, 0, targets, lengths, checksums, events.append,
                              lambda: events.append("answer"), lambda index, verified: events.append((index, verified)),
                              **extra)
        return events, b"".join(bytes(t[:n]) for t, n in zip(targets, lengths))

    async def test(address: str) -> None:
        transport = TcpTransport(READER)
        direct, received = await fetch(transport, address, None)
        assert received == data
        notices = Notices()
        deferred, received = await fetch(transport, address, notices)
        # Every report arrives on the one wake-up that ends the fetch: the ones the thread posted
        # first, in order, then the last chunk's (reported on the thread's return, never posted).
        assert received == data
        assert deferred == direct == ["answer", (0, PIECE_SIZE), (0, 2 * PIECE_SIZE), (0, 3 * PIECE_SIZE), 0,
                                      (1, PIECE_SIZE), 1]
        assert notices.wakeups == 0 and notices.posted == len(direct) - 1
        await transport.aclose()

    serve(owner_store({7: data}), test)


def _stats(node) -> dict:  # type: ignore[no-untyped-def]
    return json.loads(os.getxattr(node.path, "user.kvfs.stats"))


def test_prefetched_files_are_read_whole_and_their_reports_woke_the_reader_less(cluster: Cluster) -> None:
    """vLLM's pattern across nodes: lookups start the transfers; the files are read once
    they are in, and while they still arrive; every byte as written."""
    writer, reader = cluster.add_node("256M"), cluster.add_node("256M")
    size, count = 2 * MiB, 12
    contents = [os.urandom(size) for _ in range(count)]
    (writer.path / "kv").mkdir()
    for i, data in enumerate(contents):
        (writer.path / "kv" / f"{i}.bin").write_bytes(data)
    for i in range(count):  # the lookup thread: every name exists, each lookup starts a prefetch
        wait_until(lambda: os.access(reader.path / "kv" / f"{i}.bin", os.F_OK), timeout=5, what=f"{i}.bin on B")
    # The first file right away (its transfer may still run), the rest once all are in.
    assert (reader.path / "kv" / "0.bin").read_bytes() == contents[0]
    wait_until(lambda: _stats(reader)["fetched_bytes"] >= count * size, timeout=20, what="the prefetches")
    for i, data in enumerate(contents[1:], 1):
        assert (reader.path / "kv" / f"{i}.bin").read_bytes() == data, f"{i}.bin"
    after = _stats(reader)
    assert after["prefetches_claimed"] == count and after["remote_reads"] == count
    # Two reports per file posted by its thread at least (answered, a piece; its one chunk, the
    # last, is reported on the thread's return); only a reader waiting woke the loop.
    assert after["fetch_reports"] >= 2 * count
    assert after["fetch_report_wakeups"] < after["fetch_reports"]
