"""The metadata service over real loopback TCP and TLS: calls, errors, bad peers."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import load_tls
from kvfs.clock import ManualClock
from kvfs.wire import messages as m
from kvfs.wire.auth import AuthError
from kvfs.cluster.master import MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.wire.protocol import PREFIX, VERSION, FrameKind
from kvfs.net.handshake import connect
from kvfs.net.rpc import MetadataServer, RemoteMaster
from kvfs.errors import MetadataError
from kvfs.policy import LruPolicy

MASTER = load_tls("master", "master")
NODE = load_tls("node1")


async def registered(port: int, nursery: trio.Nursery) -> tuple[RemoteMaster, int]:
    """A node's connection, registered under its certificate's name: (it, the node id)."""
    master = await RemoteMaster.connect("127.0.0.1", port, NODE, nursery)
    node = (await master.call(m.Register("node1", "127.0.0.1:1"))).node
    await master.call(m.Report([]))
    await master.call(m.FinishRegistration())
    return master, node


def serve_and(test) -> MetadataServer:
    service = MetadataService(ManualClock(), LruPolicy())
    server = MetadataServer(service.handle, MASTER, service)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            with trio.fail_after(20):
                await test(port, nursery)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return server


def test_calls_and_errors_cross_the_wire() -> None:
    async def test(port: int, nursery: trio.Nursery) -> None:
        master, node = await registered(port, nursery)
        opened = await master.call(m.Create(ROOT_INO, b"k.bin", 0o644, 0, 0, node, True))
        await master.call(m.Seal(opened.version, 4096, 7, [1]))
        await master.call(m.Release(opened.version, writer=True))
        entry = await master.call(m.Lookup(ROOT_INO, b"k.bin"))
        assert entry.attr.size == 4096 and entry.attr.sealed
        with pytest.raises(MetadataError) as raised:
            await master.call(m.Create(ROOT_INO, b"k.bin", 0o644, 0, 0, node, True))
        assert raised.value.errno == errno.EEXIST
        listing = await master.call(m.ReadDir(ROOT_INO, 0, 10))
        assert [e.name for e in listing.entries] == [b"k.bin"]
        await master.aclose()

    serve_and(test)


def test_a_certificate_of_another_ca_is_refused_and_logged(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    from kvfs.security import ca
    from kvfs.security.credentials import Tls

    caplog.set_level(logging.INFO)
    ca.init_ca(tmp_path / "other-ca")
    ca.issue(tmp_path / "other-ca", "node1", "node", tmp_path / "stranger", ["127.0.0.1"])
    stranger = Tls.load(tmp_path / "stranger")

    async def test(port: int, nursery: trio.Nursery) -> None:
        with pytest.raises((AuthError, trio.BrokenResourceError, EOFError)):
            await RemoteMaster.connect("127.0.0.1", port, stranger, nursery)
        master, _ = await registered(port, nursery)  # others still get in
        assert (await master.call(m.Stats())).inodes == 1
        await master.aclose()

    server = serve_and(test)
    assert server.refused == 1 and server.gate.refusals["tls"] == 1
    assert "refused connection" in caplog.text and "unknown ca" in caplog.text


@pytest.mark.parametrize("garbage", [
    os.urandom(64),
    PREFIX.pack(b"KV", 9, FrameKind.HELLO, 0, 0, 0),  # wrong version
    PREFIX.pack(b"KV", VERSION, FrameKind.HELLO, 1 << 30, 0, 0),  # oversized header
    PREFIX.pack(b"KV", VERSION, FrameKind.HELLO, 100, 0, 0) + b"\x01" * 10,  # truncated, then closed
])
def test_bad_frames_close_only_that_connection(garbage: bytes, caplog: pytest.LogCaptureFixture) -> None:
    async def test(port: int, nursery: trio.Nursery) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        try:  # TLS refuses it at its first bytes (the server may hang up before the EOF is sent)
            await stream.send_all(garbage)
            await stream.send_eof()
            with trio.fail_after(5):  # the server hangs up
                while await stream.receive_some(4096):
                    pass
        except trio.BrokenResourceError:
            pass
        await stream.aclose()
        master = await RemoteMaster.connect("127.0.0.1", port, NODE, nursery)
        assert (await master.call(m.GetAttr(ROOT_INO))).ino == ROOT_INO
        await master.aclose()

    server = serve_and(test)
    assert server.refused == 1


def test_invalid_request_after_handshake_closes_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    async def test(port: int, nursery: trio.Nursery) -> None:
        master = await RemoteMaster.connect("127.0.0.1", port, NODE, nursery)
        await master._frames.send(FrameKind.REQUEST, 1, m.Done([1]))  # a response type as a request
        with trio.fail_after(5):
            await master.closed.wait()  # the server hung up
        with pytest.raises(MetadataError) as raised:
            await master.call(m.Stats())
        assert raised.value.errno == errno.EIO
        other = await RemoteMaster.connect("127.0.0.1", port, NODE, nursery)
        assert (await other.call(m.Stats())).files == 0
        await other.aclose()

    serve_and(test)
    assert "closing connection" in caplog.text and "invalid header" in caplog.text


@settings(max_examples=40, deadline=None)
@given(frames=st.lists(st.tuples(st.sampled_from(list(FrameKind)), st.binary(max_size=64)), min_size=1, max_size=4))
def test_random_frames_after_the_handshake_never_take_the_master_down(frames) -> None:
    async def test(port: int, nursery: trio.Nursery) -> None:
        stream = (await connect("127.0.0.1", port, NODE, "master")).stream
        try:  # well-formed prefixes around arbitrary headers; the master may hang up at any point
            for kind, header in frames:
                await stream.send_all(PREFIX.pack(b"KV", VERSION, kind, len(header), 0, 1) + header)
            with trio.move_on_after(0.2):  # an answer, a hang-up, or waiting for the rest of a frame
                while await stream.receive_some(65536):
                    pass
        except trio.BrokenResourceError:
            pass
        await stream.aclose()
        master = await RemoteMaster.connect("127.0.0.1", port, NODE, nursery)
        assert (await master.call(m.GetAttr(ROOT_INO))).ino == ROOT_INO
        await master.aclose()

    serve_and(test)


def test_an_answer_too_large_for_a_frame_is_an_error_not_a_hang_up() -> None:
    async def test(port: int, nursery: trio.Nursery) -> None:
        master, node = await registered(port, nursery)
        for i in range(6000):  # 6,000 entries of 200-byte names: a listing of them is over 1 MiB
            opened = await master.call(m.Create(ROOT_INO, b"%0200d" % i, 0o644, 0, 0, node, True))
            await master.call(m.Release(opened.version, writer=True))
        with pytest.raises(MetadataError) as raised:
            await master.call(m.ReadDir(ROOT_INO, 0, 10**6))
        assert raised.value.errno == errno.EFBIG
        assert len((await master.call(m.ReadDir(ROOT_INO, 0, 100))).entries) == 100  # still connected
        await master.aclose()

    serve_and(test)


def test_a_nodes_waiting_name_changes_come_with_its_answers_in_the_order_made() -> None:
    """The changes queued for a node that watches a directory, its own among them, arrive
    with the answer to its change (applied before the call returns), after those of other
    nodes made before it: vLLM's store costs no push frame."""

    async def test(port: int, nursery: trio.Nursery) -> None:
        seen: list[m.NameChange] = []
        a = await RemoteMaster.connect("127.0.0.1", port, NODE, nursery,
                                       on_notify=lambda changes: seen.extend(changes.changes))
        node_a = (await a.call(m.Register("node1", "127.0.0.1:1"))).node
        await a.call(m.Report([]))
        await a.call(m.FinishRegistration())
        b, node_b = await registered_as(port, nursery, "node2")
        await a.call(m.WatchNames(ROOT_INO, 1000))

        # Another node's create, queued for A, then A's own: in that order, both by A's answer.
        await b.call(m.Create(ROOT_INO, b"other.bin", 0o644, 0, 0, node_b, True))
        opened = await a.call(m.Create(ROOT_INO, b"k.bin.tmp", 0o644, 0, 0, node_a, True))
        assert seen[-2:] == [(ROOT_INO, b"other.bin", True, None), (ROOT_INO, b"k.bin.tmp", True, None)]
        assert opened.changes == seen[-2:] or opened.changes == seen[-1:]  # (B's may have been pushed first)

        sealed = await a.call(m.Seal(opened.version, 4096, 7, [1], release=True))
        name, present, entry = seen[-1][1:]
        assert (name, present) == (b"k.bin.tmp", True) and entry is not None and entry.attr.size == 4096
        assert sealed.changes == seen[-1:]

        done = await a.call(m.Rename(ROOT_INO, b"k.bin.tmp", ROOT_INO, b"k.bin", False))
        assert [change[:3] for change in seen[-2:]] == [(ROOT_INO, b"k.bin.tmp", False), (ROOT_INO, b"k.bin", True)]
        assert seen[-1][3] is not None and seen[-1][3].attr.ino == opened.attr.ino
        assert done.changes == seen[-2:]

        # A change of B alone still reaches A, pushed.
        before = len(seen)
        await b.call(m.Unlink(ROOT_INO, b"other.bin"))
        with trio.fail_after(5):
            while len(seen) == before:
                await trio.sleep(0.01)
        assert seen[before:] == [(ROOT_INO, b"other.bin", False, None)]
        await a.aclose()
        await b.aclose()

    serve_and(test)


async def registered_as(port: int, nursery: trio.Nursery, name: str) -> tuple[RemoteMaster, int]:
    master = await RemoteMaster.connect("127.0.0.1", port, load_tls(name), nursery)
    node = (await master.call(m.Register(name, "127.0.0.1:2"))).node
    await master.call(m.Report([]))
    await master.call(m.FinishRegistration())
    return master, node


def test_concurrent_callers_sent_and_answered_together_each_get_their_own_answer() -> None:
    """Frames of callers that come while another is being written leave together, and the
    master answers the requests it already has in one write: every caller still gets the
    answer to its own request (and an error stays with its request)."""

    async def test(port: int, nursery: trio.Nursery) -> None:
        master, node = await registered(port, nursery)
        answers: dict[int, m.Opened] = {}

        async def create(i: int) -> None:
            answers[i] = await master.call(m.Create(ROOT_INO, b"k%03d.bin" % i, 0o644, 0, 0, node, True))

        async def refused() -> None:
            with pytest.raises(MetadataError) as raised:
                await master.call(m.Lookup(12345678, b"x"))  # no such directory
            assert raised.value.errno == errno.ENOENT

        async with trio.open_nursery() as callers:
            for i in range(100):
                callers.start_soon(create, i)
                if i % 10 == 0:
                    callers.start_soon(refused)
        for i, opened in answers.items():
            entry = await master.call(m.Lookup(ROOT_INO, b"k%03d.bin" % i))
            assert entry.attr.ino == opened.attr.ino and entry.attr.version == opened.version
        assert len({opened.attr.ino for opened in answers.values()}) == 100
        await master.aclose()

    serve_and(test)
