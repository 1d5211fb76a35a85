"""Connection setup on real sockets: what holds a connection before it is authenticated (a
deadline, limits on connections in setup, refusals counted and logged within a budget, peer
text escaped) and what a refused client is told."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import trio

from conftest import Cluster, load_tls
from kvfs.clock import ManualClock
from kvfs.cluster.master import MetadataService
from kvfs.config import split_address
from kvfs.net.handshake import REFUSALS_LOGGED, Gate, LogBudget, connect
from kvfs.net.rpc import MetadataServer, RemoteMaster
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m
from kvfs.wire.auth import AuthError

MASTER = load_tls("master", "master")
NODE = load_tls("node1")
CLIENT = load_tls("reader", "client")


async def _until_closed(stream: trio.SocketStream) -> bytes:
    """What the server sent until it hung up."""
    received = b""
    with trio.fail_after(10):  # the server hangs up; it never leaves a refused peer waiting
        while True:
            try:
                data = await stream.receive_some(65536)
            except trio.BrokenResourceError:  # reset: hung up too
                break
            if not data:
                break
            received += data
    await stream.aclose()
    return received


def serve_and(test, timeout_s: float = 0.5, **limits: int) -> MetadataServer:
    service = MetadataService(ManualClock(), LruPolicy())
    server = MetadataServer(service.handle, MASTER, service, handshake_timeout_s=timeout_s)
    for name, value in limits.items():
        setattr(server.gate, name, value)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            with trio.fail_after(60):
                await test(port, nursery)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return server


async def _legitimate_client_works(port: int, nursery: trio.Nursery) -> None:
    master = await RemoteMaster.connect("127.0.0.1", port, CLIENT, nursery)
    assert (await master.call(m.Stats())).inodes >= 1
    await master.aclose()


@pytest.mark.parametrize("sent", [b"", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"])  # nothing, half a hello
def test_a_silent_or_stalled_peer_is_dropped_at_the_handshake_deadline(sent: bytes,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    async def test(port: int, nursery: trio.Nursery) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(sent)
        started = trio.current_time()
        await _until_closed(stream)
        assert trio.current_time() - started < 5
        await _legitimate_client_works(port, nursery)

    server = serve_and(test)
    assert server.refused == 1 and server.gate.refusals["timeout"] == 1
    assert "no TLS handshake within 0.5 s" in caplog.text


def test_plaintext_frames_are_refused_by_tls(caplog: pytest.LogCaptureFixture) -> None:
    """An old kvfs, or anyone without TLS: refused at its first bytes, answered nothing."""
    from kvfs.wire.protocol import PREFIX, VERSION, FrameKind

    async def test(port: int, nursery: trio.Nursery) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(PREFIX.pack(b"KV", VERSION, FrameKind.REQUEST, 1000, 0, 1) + b"\0" * 1000)
        answer = await _until_closed(stream)
        assert answer == b"" or answer[0] == 0x15, answer[:16]  # at most a TLS alert record, never a frame
        await _legitimate_client_works(port, nursery)

    server = serve_and(test)
    assert server.gate.refusals["tls"] == 1
    assert "wrong version number" in caplog.text or "record" in caplog.text, caplog.text


def test_a_role_the_server_does_not_serve_is_told_why() -> None:
    """A master's certificate is no client of a master, a client's none of a peer server: the
    TLS handshake passes (the CA is right) and the refusal says what was wrong."""
    from kvfs.net.streams import serve_tcp

    gate = Gate(NODE, frozenset({"node"}), "peer connection")

    async def peer(stream: trio.SocketStream) -> None:
        admitted = await gate.admit(stream)
        if admitted is not None:
            await admitted[0].aclose()

    async def test(port: int, nursery: trio.Nursery) -> None:
        with pytest.raises(AuthError, match=r"does not serve master 'master' \(only admin, client, node\)"):
            await connect("127.0.0.1", port, MASTER, "master")
        peer_port = await nursery.start(serve_tcp, peer, "127.0.0.1", 0)
        with pytest.raises(AuthError, match=r"peer connection does not serve client 'reader' \(only node\)"):
            await connect("127.0.0.1", peer_port, CLIENT, "node")
        with pytest.raises(AuthError, match="is master 'master', not a node"):  # and the other way round
            await connect("127.0.0.1", port, NODE, "node")
        await _legitimate_client_works(port, nursery)

    server = serve_and(test)
    assert server.gate.refusals["role"] == 1 and gate.refusals["role"] == 1


def test_refusals_are_logged_within_a_budget_and_counted_all() -> None:
    budget = LogBudget(burst=3, window_s=10.0)
    assert [budget.take(t) for t in (0.0, 1.0, 2.0, 3.0, 4.0)] == [(True, 0)] * 3 + [(False, 0)] * 2
    assert budget.take(10.5) == (True, 2)  # a new window: the line says what was held back
    assert budget.take(11.0) == (True, 0)


def test_a_flood_of_bad_connections_does_not_flood_the_log(caplog: pytest.LogCaptureFixture) -> None:
    async def test(port: int, nursery: trio.Nursery) -> None:
        for _ in range(12):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(b"GARBAGE\nINFO forged line" * 3)
            await _until_closed(stream)
        await _legitimate_client_works(port, nursery)

    server = serve_and(test)
    assert server.refused == 12  # every one counted (the metric), ...
    lines = [r.getMessage() for r in caplog.records if "refused connection from" in r.getMessage()]
    assert len(lines) == REFUSALS_LOGGED  # ... a budget of them logged
    assert all("\n" not in line for line in lines)


def test_connections_in_setup_are_bounded_per_source_and_in_all() -> None:
    """Half-open connections from one address take at most `max_per_source` places: a client
    from another address still gets in at once. Beyond `max_handshakes` in all, a new
    connection is closed at once (and counted), so none of them can hold memory or a task."""

    async def test(port: int, nursery: trio.Nursery) -> None:
        held = [await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.3") for _ in range(12)]
        with trio.fail_after(5):
            await _legitimate_client_works(port, nursery)  # from 127.0.0.1
        for stream in held:
            await stream.aclose()

    server = serve_and(test, timeout_s=30, max_per_source=4, max_handshakes=100)
    assert server.gate.refusals["busy"] == 8


def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_500_half_open_connections_neither_lock_out_a_client_nor_grow_the_master(cluster: Cluster) -> None:
    """500 connections from one address that start a TLS handshake and stall, all open at once
    against a live master: a legitimate client still connects and is answered, and the
    master's memory stays bounded (its setup places are few and each is dropped at the
    deadline or refused at once)."""
    assert cluster.master.process is not None
    pid = cluster.master.process.pid
    host, port = split_address(cluster.master.address)
    before = _rss_bytes(pid)
    client_hello_start = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(32)

    async def flood() -> tuple[int, float]:
        streams: list[trio.SocketStream] = []

        async def one() -> None:
            stream = await trio.open_tcp_stream(host, port, local_address="127.0.0.5")
            streams.append(stream)
            try:
                await stream.send_all(client_hello_start)  # then nothing more
            except trio.BrokenResourceError:
                pass  # refused at once

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                for _ in range(500):
                    nursery.start_soon(one)
        started = trio.current_time()
        with trio.fail_after(30):  # generous: it is answered at once, well within the handshake deadline
            async with trio.open_nursery() as nursery:
                master = await RemoteMaster.connect(host, port, CLIENT, nursery)
                status = await master.call(m.ClusterStatus())
                await master.aclose()
        took = trio.current_time() - started
        assert status is not None
        peak = _rss_bytes(pid)  # with every half-open connection still open on this side
        for stream in streams:
            await stream.aclose()
        return peak, took

    peak, took = trio.run(flood)
    grown = peak - before
    print(f"\n500 half-open connections: a client was answered in {took:.2f} s; the master grew by "
          f"{grown / 2**20:.1f} MiB")
    assert grown < 64 << 20, f"the master grew by {grown >> 20} MiB"
    assert "connections in setup" in cluster.master.log_text()  # refused at once, and said so
    status = subprocess.run([sys.executable, "-m", "kvfs", "status", "--master", cluster.master.address, "--json"],
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 0, status.stderr


def test_a_status_command_with_a_foreign_certificate_says_so(cluster: Cluster, tmp_path) -> None:
    from kvfs.security import ca

    ca.init_ca(tmp_path / "other-ca")
    ca.issue(tmp_path / "other-ca", "mallory", "admin", tmp_path / "mallory")
    status = subprocess.run([sys.executable, "-m", "kvfs", "status", "--master", cluster.master.address,
                             "--tls-dir", str(tmp_path / "mallory")], capture_output=True, text=True, timeout=30)
    assert status.returncode == 1
    assert status.stderr.startswith(f"kvfs: error: master {cluster.master.address} refused this client "
                                    f"(admin 'mallory' of {tmp_path / 'mallory'}; is it issued by the master's CA?)")
    assert "certificate verify failed" in status.stderr


def test_new_connections_from_one_address_are_rate_limited() -> None:
    from kvfs.net.handshake import SourceRate

    rate = SourceRate(rate=10.0, burst=3, tracked=2)
    assert [rate.take("a", 0.0) for _ in range(4)] == [True, True, True, False]  # the burst, then none
    assert [rate.take("b", 0.0) for _ in range(3)] == [True] * 3  # another address has a bucket of its own
    assert not rate.take("a", 0.05) and rate.take("a", 0.11)  # one token back per 0.1 s
    assert rate.take("c", 0.2)  # a third address: "b" (idle longest) is forgotten, ...
    assert [rate.take("b", 0.2) for _ in range(4)] == [True, True, True, False]  # ... and starts full again


def test_a_flood_of_connections_from_one_address_is_cut_at_its_rate() -> None:
    async def test(port: int, nursery: trio.Nursery) -> None:
        for _ in range(8):
            stream = await trio.open_tcp_stream("127.0.0.1", port, local_address="127.0.0.7")
            await stream.aclose()
        with trio.fail_after(5):
            await _legitimate_client_works(port, nursery)  # from 127.0.0.1

    service = MetadataService(ManualClock(), LruPolicy())
    server = MetadataServer(service.handle, MASTER, service, handshake_timeout_s=0.5)
    server.gate.source_rate.burst = 5
    server.gate.source_rate.rate = 0.01

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            with trio.fail_after(30):
                await test(port, nursery)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert server.gate.refusals["busy"] == 3  # 8 from one address, a burst of 5


# Peer connections move to kvfs's records after admission; an older node speaks none -------

PEER_TLS = load_tls("owner")


def serve_peer_gate(gate: Gate, test) -> None:
    """GATE on a port; each admitted connection answers one request with a RESPONSE frame."""
    from kvfs.net.streams import serve_tcp
    from kvfs.wire.protocol import FrameKind

    async def peer(stream: trio.SocketStream) -> None:
        admitted = await gate.admit(stream)
        if admitted is None:
            return
        frames, _ = admitted
        async with frames.stream:
            try:
                request = await frames.receive()
                await frames.send(FrameKind.RESPONSE, request.prefix.request_id, m.Stats())
            except (EOFError, trio.BrokenResourceError):
                pass

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_tcp, peer, "127.0.0.1", 0)
            with trio.fail_after(30):
                await test(port)
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("client_off", [False, True])
def test_a_peer_connection_moves_to_records_unless_both_ends_are_off(client_off: bool) -> None:
    from kvfs.wire.protocol import FrameKind

    for server_off in (False, True):
        gate = Gate(PEER_TLS, frozenset({"node"}), "peer connection", plaintext=server_off)

        async def test(port: int) -> None:
            frames = await connect("127.0.0.1", port, NODE, "node", plaintext=client_off, sealed=True)
            plain = server_off and client_off
            assert (frames.plaintext, frames.sealed) == (plain, not plain)
            await frames.send(FrameKind.REQUEST, 3, m.Stats())
            assert (await frames.receive()).prefix.request_id == 3  # frames go on, in records or plain
            await frames.aclose()

        serve_peer_gate(gate, test)
        assert (gate.sealed_admitted, gate.plaintext_admitted) == ((0, 1) if server_off and client_off else (1, 0))


def test_a_node_without_records_is_refused_by_a_client_that_requires_them() -> None:
    """An older node's peer port offers no records: a node of this kvfs refuses it and says why
    (its fetch fails with ENOENT, peer unreachable, and that reason); two ends with peer
    encryption off still meet, in plain frames."""
    old_node = Gate(PEER_TLS, frozenset({"node"}), "peer connection", sealed=False)

    async def test(port: int) -> None:
        with pytest.raises(AuthError, match=r"\(owner\) speaks no kvfs peer records.*upgraded together"):
            await connect("127.0.0.1", port, NODE, "node", sealed=True)
        frames = await connect("127.0.0.1", port, NODE, "node")  # not required (a master's client): TLS
        assert not frames.sealed and not frames.plaintext
        await frames.aclose()

    serve_peer_gate(old_node, test)
    old_off = Gate(PEER_TLS, frozenset({"node"}), "peer connection", plaintext=True, sealed=False)

    async def both_off(port: int) -> None:
        frames = await connect("127.0.0.1", port, NODE, "node", plaintext=True, sealed=True)
        assert frames.plaintext
        await frames.aclose()

    serve_peer_gate(old_off, both_off)


@pytest.mark.parametrize("answer", ["none", "no secret"])
def test_a_client_without_records_gets_its_request_refused_with_the_reason(answer: str) -> None:
    """An older node as a client: with peer encryption on it does not answer the Welcome and
    sends its request in TLS; with it off it answers without a secret. Either way its request
    is answered with an ERROR frame that says why, and the refusal is counted."""
    from kvfs.net.handshake import _wrap
    from kvfs.net.streams import FrameStream
    from kvfs.wire.auth import Encryption, Welcome
    from kvfs.wire.protocol import ErrorReply, FrameKind, HeaderDecoder

    gate = Gate(PEER_TLS, frozenset({"node"}), "peer connection", plaintext=answer == "no secret")

    async def test(port: int) -> None:
        tls_stream = _wrap(await trio.open_tcp_stream("127.0.0.1", port), NODE.client, server_side=False)
        await tls_stream.handshake()
        frames = FrameStream(tls_stream)
        welcome = HeaderDecoder(Welcome).decode((await frames.receive()).header)
        assert len(welcome.sealed) == 32
        if answer == "no secret":  # what an older kvfs with peer encryption on answers an offer of plain frames
            await frames.send(FrameKind.HELLO, 0, Encryption(False))
        await frames.send(FrameKind.REQUEST, 9, m.Stats())
        reply = await frames.receive()
        assert (reply.prefix.kind, reply.prefix.request_id) == (FrameKind.ERROR, 9)
        error = HeaderDecoder(ErrorReply).decode(reply.header)
        assert "speaks no kvfs peer records" in error.message and "node1" in error.message
        await frames.aclose()

    serve_peer_gate(gate, test)
    assert gate.refusals["version"] == 1 and gate.sealed_admitted == 0
