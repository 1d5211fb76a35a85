"""A real `kvfs master` saves the requests a connection sent together in one lmdb
transaction, before any of them is answered; a hostile frame among them closes the
connection without losing the requests before it (saved and answered)."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import trio

from conftest import MasterDaemon, load_tls
from master_view import names_on_disk
from kvfs.cluster.namespace import ROOT_INO
from kvfs.net.handshake import connect
from kvfs.net.rpc import RemoteMaster
from kvfs.net.streams import FrameStream
from kvfs.wire import messages as m
from kvfs.wire.protocol import FrameKind, HeaderDecoder, encode_frame

NODE = load_tls("node1")
OPENED = HeaderDecoder(m.Opened)



def saves(master: MasterDaemon) -> float:
    text = urllib.request.urlopen(master.metrics_url, timeout=10).read().decode()
    found = re.search(r'^kvfs_master_saves_total\{result="ok",store="lmdb"\} (\S+)$', text, re.M) or \
        re.search(r'^kvfs_master_saves_total\{store="lmdb",result="ok"\} (\S+)$', text, re.M)
    assert found, "the master exports no count of its saves"
    return float(found.group(1))


async def registered(port: int) -> tuple[FrameStream, int]:
    frames = await connect("127.0.0.1", port, NODE, "master")
    node = 0
    for request_id, request in enumerate((m.Register("node1", "127.0.0.1:1"), m.Report([]),
                                          m.FinishRegistration()), 1):
        await frames.send(FrameKind.REQUEST, request_id, request)
        frame = await frames.receive()
        assert frame.prefix.kind == FrameKind.RESPONSE, frame.prefix
        if request_id == 1:
            node = HeaderDecoder(m.Registered).decode(frame.header).node
    return frames, node


def creates(node: int, names: list[bytes], first_id: int) -> list[bytes]:
    return [encode_frame(FrameKind.REQUEST, first_id + i, m.Create(ROOT_INO, name, 0o644, 0, 0, node, True))
            for i, name in enumerate(names)]


def test_requests_sent_together_are_saved_in_one_transaction_before_the_first_answer(tmp_path: Path) -> None:
    master = MasterDaemon(tmp_path)
    master.start()
    names = [b"k%02d.bin" % i for i in range(40)]
    try:
        async def main() -> None:
            frames, node = await registered(master.port)
            await frames.send_encoded(b"".join(creates(node, names, 100)))  # one write: one TLS record
            with trio.fail_after(10):
                first = await frames.receive()
            assert first.prefix.kind == FrameKind.RESPONSE and first.prefix.request_id == 100
            assert OPENED.decode(first.header).attr.ino > ROOT_INO
            master.kill()  # at the first answer: every request of the batch must be on disk already
            await frames.aclose()

        trio.run(main)
        assert names_on_disk(master.data) == set(names)
    finally:
        master.stop()


def test_the_batch_is_one_transaction(tmp_path: Path) -> None:
    master = MasterDaemon(tmp_path)
    master.start()
    names = [b"k%02d.bin" % i for i in range(40)]
    try:
        async def main() -> float:
            frames, node = await registered(master.port)
            before = await trio.to_thread.run_sync(saves, master)
            await frames.send_encoded(b"".join(creates(node, names, 100)))
            with trio.fail_after(10):
                answered = [await frames.receive() for _ in names]
            assert [frame.prefix.request_id for frame in answered] == list(range(100, 140))
            after = await trio.to_thread.run_sync(saves, master)
            await frames.aclose()
            return after - before

        saved = trio.run(main)
        # One for the batch; at most one more from a timer (the node declared dead meanwhile).
        assert 1 <= saved <= 2, saved
    finally:
        master.stop()
    assert names_on_disk(master.data) == set(names)


def test_a_hostile_frame_in_a_batch_closes_the_connection_after_saving_and_answering_those_before(
        tmp_path: Path) -> None:
    master = MasterDaemon(tmp_path)
    master.start()
    before_names = [b"a%02d.bin" % i for i in range(10)]
    after_names = [b"b%02d.bin" % i for i in range(10)]
    try:
        async def main() -> list[int]:
            frames, node = await registered(master.port)
            hostile = encode_frame(FrameKind.REQUEST, 110, m.Done([1]))  # a response type as a request
            await frames.send_encoded(b"".join(creates(node, before_names, 100) + [hostile]
                                               + creates(node, after_names, 111)))
            answered = []
            with trio.fail_after(10):
                try:
                    while True:
                        frame = await frames.receive()
                        assert frame.prefix.kind == FrameKind.RESPONSE, frame.prefix
                        answered.append(frame.prefix.request_id)
                except (EOFError, trio.BrokenResourceError):
                    pass  # the master hung up after the answers
            await frames.aclose()
            # The master serves on: another connection is answered (unregistered: registering
            # node1 again with an empty report would drop the files it created).
            async with trio.open_nursery() as nursery:
                other = await RemoteMaster.connect("127.0.0.1", master.port, NODE, nursery)
                assert (await other.call(m.GetAttr(ROOT_INO))).ino == ROOT_INO
                await other.aclose()
            return answered

        assert trio.run(main) == list(range(100, 110))
        master.kill()
        assert names_on_disk(master.data) == set(before_names)
        assert "closing connection" in master.log_text() and "invalid header" in master.log_text()
    finally:
        master.stop()
