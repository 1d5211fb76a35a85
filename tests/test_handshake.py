"""The handshake on real sockets: the reflection attack against a live master and a live peer
port, and what holds a connection before it is authenticated (tiny frames, a deadline, log
lines that a peer's strings cannot forge)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import trio

from conftest import CLUSTER_SECRET, Cluster
from kvfs.clock import ManualClock
from kvfs.cluster.master import MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.config import split_address
from kvfs.net.rpc import MetadataServer, RemoteMaster
from kvfs.net.handshake import REFUSALS_LOGGED, LogBudget, connect
from kvfs.net.transport import FetchChunks
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m
from kvfs.wire.auth import HandshakeMessage, Hello, Proof, new_nonce
from kvfs.wire.protocol import PREFIX, VERSION, ErrorReply, Frame, FrameKind, FrameParser, HeaderDecoder, encode_frame

SECRET = b"a-cluster-secret-for-tests"
HANDSHAKE = HeaderDecoder(HandshakeMessage)


async def _next(stream: trio.SocketStream, parser: FrameParser) -> Frame | None:
    """The server's next frame, or None once it hung up."""
    while (frame := parser.next_frame()) is None:
        try:
            data = await stream.receive_some(65536)
        except trio.BrokenResourceError:  # reset: hung up too
            return None
        if not data:
            return None
        parser.feed(data)
    return frame


async def _until_closed(stream: trio.SocketStream, parser: FrameParser) -> list[Frame]:
    frames = []
    with trio.fail_after(10):  # the server hangs up; it never leaves a refused peer waiting
        while (frame := await _next(stream, parser)) is not None:
            frames.append(frame)
    await stream.aclose()
    return frames


@dataclass
class Attack:
    frames: list[Frame]  # everything the server sent on both connections
    answered: bool  # the server answered the request sent after the attacker's "proof"


async def reflection_attack(address: str, request: object) -> Attack:
    """The reflection across two concurrent connections, without the secret: the server's hello
    on B becomes the attacker's hello on A, so that under the old proofs the server's proof on
    A (over its nonce and B's) was the very proof it expected from the client on B. The
    attacker needs the server to prove something first; whatever it gets on A it replays on B,
    then asks B for something."""
    host, port = split_address(address)
    a, b = await trio.open_tcp_stream(host, port), await trio.open_tcp_stream(host, port)
    on_a, on_b = FrameParser(), FrameParser()
    await b.send_all(encode_frame(FrameKind.HELLO, 0, Hello("node", new_nonce())))
    hello_b = await _next(b, on_b)
    assert hello_b is not None
    server_b = HANDSHAKE.decode(hello_b.header)
    await a.send_all(encode_frame(FrameKind.HELLO, 0, Hello("node", server_b.nonce)))
    hello_a = await _next(a, on_a)
    assert hello_a is not None
    server_a = HANDSHAKE.decode(hello_a.header)
    # The server proves nothing before the client has; the attacker has no proof to give, so it
    # gives the best it can make (the server's own nonce), hoping for the server's proof back.
    await a.send_all(encode_frame(FrameKind.HELLO, 0, Proof(server_a.nonce)))
    rest_a = await _until_closed(a, on_a)
    stolen = [HANDSHAKE.decode(f.header) for f in rest_a if f.prefix.kind == FrameKind.HELLO]
    reflected = next((p for p in stolen if isinstance(p, Proof)), Proof(server_b.nonce))
    await b.send_all(encode_frame(FrameKind.HELLO, 0, reflected))
    try:
        await b.send_all(encode_frame(FrameKind.REQUEST, 1, request))
    except trio.BrokenResourceError:
        pass
    rest_b = await _until_closed(b, on_b)
    answered = any(f.prefix.kind == FrameKind.RESPONSE for f in rest_b)
    return Attack([hello_a, hello_b, *rest_a, *rest_b], answered)


def assert_refused(attack: Attack) -> None:
    kinds = [f.prefix.kind for f in attack.frames]
    assert not attack.answered
    # Two hellos, then at most a refusal on each connection: never a proof, never an answer.
    assert kinds[:2] == [FrameKind.HELLO, FrameKind.HELLO] and set(kinds[2:]) <= {FrameKind.ERROR}, kinds
    assert not any(isinstance(HANDSHAKE.decode(f.header), Proof) for f in attack.frames if f.prefix.kind == FrameKind.HELLO)


def _peer_address(cluster: Cluster) -> str:
    status = subprocess.run([sys.executable, "-m", "kvfs", "status", "--master", cluster.master.address, "--json"],
                            capture_output=True, text=True, timeout=30,
                            env={**os.environ, "KVFS_SECRET": CLUSTER_SECRET})
    return next(n["address"] for n in json.loads(status.stdout)["nodes"] if n["live"])


def test_the_reflection_attack_fails_against_a_live_master_and_peer_port(cluster: Cluster) -> None:
    node = cluster.add_node("64M")
    (node.path / "secret.bin").write_bytes(b"kv" * 1000)
    peer = _peer_address(cluster)
    secret = CLUSTER_SECRET.encode()

    async def main() -> None:
        assert_refused(await reflection_attack(cluster.master.address, m.ReadDir(ROOT_INO, 0, 100)))
        assert_refused(await reflection_attack(peer, FetchChunks(1, 0, 1)))
        # Legitimate clients still get in, on both.
        async with trio.open_nursery() as nursery:
            host, port = split_address(cluster.master.address)
            master = await RemoteMaster.connect(host, port, secret, nursery, role="client")
            listing = await master.call(m.ReadDir(ROOT_INO, 0, 100))
            assert b"secret.bin" in [entry.name for entry in listing.entries]
            await master.aclose()
        host, port = split_address(peer)
        frames = await connect(host, port, secret, "node", "peer")
        await frames.send(FrameKind.REQUEST, 1, FetchChunks(10**9, 0, 1))  # a version it does not hold
        answer = await frames.receive()
        assert answer.prefix.kind == FrameKind.ERROR and HeaderDecoder(ErrorReply).decode(answer.header).errno
        await frames.aclose()

    trio.run(main)
    master_log, node_log = cluster.master.log_text(), node.log_text()
    assert master_log.count("refused connection from") == 2, master_log
    assert master_log.count("failed to prove the cluster secret") == 2
    assert node_log.count("refused peer connection from") == 2
    assert (node.path / "secret.bin").read_bytes() == b"kv" * 1000


# Before authentication, on an in-process master (real loopback sockets) -------------------


def serve_and(test, timeout_s: float = 0.5) -> MetadataServer:
    service = MetadataService(ManualClock(), LruPolicy())
    server = MetadataServer(service.handle, SECRET, service, handshake_timeout_s=timeout_s)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            with trio.fail_after(20):
                await test(port, nursery)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return server


async def _legitimate_client_works(port: int, nursery: trio.Nursery) -> None:
    master = await RemoteMaster.connect("127.0.0.1", port, SECRET, nursery)
    assert (await master.call(m.GetAttr(ROOT_INO))).ino == ROOT_INO
    await master.aclose()


@pytest.mark.parametrize("sent", [b"", PREFIX.pack(b"KV", VERSION, FrameKind.HELLO, 60, 0, 0) + b"\x82"])
def test_a_silent_or_stalled_peer_is_dropped_at_the_handshake_deadline(sent: bytes,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    async def test(port: int, nursery: trio.Nursery) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(sent)  # nothing, or half a hello; then silence
        started = trio.current_time()
        assert await _until_closed(stream, FrameParser()) == []  # hung up, having said nothing
        assert trio.current_time() - started < 5
        await _legitimate_client_works(port, nursery)

    server = serve_and(test)
    assert server.refused == 1
    assert "no handshake within 0.5 s" in caplog.text


@pytest.mark.parametrize("frame, reason", [
    (PREFIX.pack(b"KV", VERSION, FrameKind.HELLO, 64 << 10, 0, 0), "header of 65536 bytes exceeds 1024"),
    (PREFIX.pack(b"KV", VERSION, FrameKind.REQUEST, 1000, 0, 1), "expected a hello, got a REQUEST frame"),
    (PREFIX.pack(b"KV", 1, FrameKind.HELLO, 50, 0, 0), "protocol version 1 (this side speaks 2)"),  # an older kvfs
    (encode_frame(FrameKind.HELLO, 0, Hello("node", new_nonce()), payload_length=1) + b"x",
     "payload of 1 bytes exceeds 0"),
])
def test_before_authentication_only_tiny_handshake_frames_pass(frame: bytes, reason: str,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """A prefix announcing more than a hello needs is refused before its header is read (the
    connection buffers about a KiB at most); so is any other frame where a hello belongs."""

    async def test(port: int, nursery: trio.Nursery) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(frame + b"\0" * 1000)
        answer = await _until_closed(stream, FrameParser())
        assert [f.prefix.kind for f in answer] == [FrameKind.ERROR]  # only the refusal, no hello
        await _legitimate_client_works(port, nursery)

    server = serve_and(test)
    assert server.refused == 1
    assert reason in caplog.text


def test_a_peers_claimed_role_is_escaped_and_cut_in_the_log(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    roles = ["node\nINFO node connected", "\x1b[2J" * 6 + "x" * 2]

    async def test(port: int, nursery: trio.Nursery) -> None:
        for role in roles:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(encode_frame(FrameKind.HELLO, 0, Hello(role, new_nonce())))
            await _until_closed(stream, FrameParser())
        await _legitimate_client_works(port, nursery)

    server = serve_and(test)
    assert server.refused == 2
    refusals = [r.getMessage() for r in caplog.records if "refused connection" in r.getMessage()]
    assert len(refusals) == 2
    assert all("\n" not in line and "\x1b" not in line for line in refusals)
    assert "claims role 'node\\nINFO node connected'" in refusals[0]
    assert "claims role '\\x1b[2J\\x1b[2J" in refusals[1] and "... (" in refusals[1]


def test_refusals_are_logged_within_a_budget_and_counted_all() -> None:
    budget = LogBudget(burst=3, window_s=10.0)
    assert [budget.take(t) for t in (0.0, 1.0, 2.0, 3.0, 4.0)] == [(True, 0)] * 3 + [(False, 0)] * 2
    assert budget.take(10.5) == (True, 2)  # a new window: the line says what was held back
    assert budget.take(11.0) == (True, 0)


def test_a_flood_of_bad_connections_does_not_flood_the_log(caplog: pytest.LogCaptureFixture) -> None:
    async def test(port: int, nursery: trio.Nursery) -> None:
        for _ in range(12):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"GARBAGE" * 3)
            await _until_closed(stream, FrameParser())
        await _legitimate_client_works(port, nursery)

    server = serve_and(test)
    assert server.refused == 12  # every one counted (the metric), ...
    assert caplog.text.count("refused connection from") == REFUSALS_LOGGED  # ... a budget of them logged


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_unauthenticated_connections_cannot_grow_the_masters_memory(cluster: Cluster) -> None:
    """150 connections that each announce a 1 MiB hello and send it: refused at the prefix, so
    the master buffers none of it (it used to take up to 9 MiB per connection before any check)."""
    assert cluster.master.process is not None
    pid = cluster.master.process.pid
    host, port = split_address(cluster.master.address)
    before = _rss_bytes(pid)

    async def flood() -> int:
        streams: list[trio.SocketStream] = []

        async def one() -> None:
            stream = await trio.open_tcp_stream(host, port)
            streams.append(stream)
            try:
                await stream.send_all(PREFIX.pack(b"KV", VERSION, FrameKind.HELLO, 1 << 20, 0, 0) + bytes(1 << 20))
            except trio.BrokenResourceError:
                pass  # refused and closed before all of it was taken

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for _ in range(150):
                    nursery.start_soon(one)
        peak = _rss_bytes(pid)  # with every connection still open on this side
        for stream in streams:
            await stream.aclose()
        return peak

    grown = trio.run(flood) - before
    print(f"\n150 connections announcing 1 MiB hellos: the master grew by {grown / 2**20:.1f} MiB")
    assert grown < 32 << 20, f"the master grew by {grown >> 20} MiB"
    assert "header of 1048576 bytes exceeds 1024" in cluster.master.log_text()
    # ... and it still serves.
    status = subprocess.run([sys.executable, "-m", "kvfs", "status", "--master", cluster.master.address, "--json"],
                            capture_output=True, text=True, timeout=30,
                            env={**os.environ, "KVFS_SECRET": CLUSTER_SECRET})
    assert status.returncode == 0, status.stderr
