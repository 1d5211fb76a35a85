"""What TLS gives every cluster connection, seen by an on-path attacker: a proxy between a
client and a real server that records, injects and replays bytes. It reads nothing, its
injected frame is never applied (the connection breaks instead), and a recorded session
replayed on a new connection does not authenticate."""

from __future__ import annotations

import os

import pytest
import trio

from conftest import load_tls
from kvfs.checksum import chunk_checksum
from kvfs.clock import ManualClock
from kvfs.cluster.master import MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.net.rpc import MasterUnavailable, MetadataServer, RemoteMaster
from kvfs.net.streams import serve_tcp
from kvfs.net.transport import PeerServer, TcpTransport
from kvfs.policy import LruPolicy
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.dram import DramTier
from kvfs.store.tiered import TieredStore
from kvfs.wire import messages as m
from kvfs.wire.protocol import FrameKind, encode_frame

MASTER = load_tls("master", "master")
NODE = load_tls("node1")
CHUNK = 1 << 20


class Proxy:
    """Forwards connections to UPSTREAM, recording what the client sent on each; `inject`
    writes bytes of its own into the last connection's upstream side."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.sent: list[bytearray] = []  # client -> server, per connection
        self.received: list[bytearray] = []  # server -> client
        self._upstream_streams: list[trio.SocketStream] = []

    async def handle(self, client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream("127.0.0.1", self.upstream)
        sent, received = bytearray(), bytearray()
        self.sent.append(sent)
        self.received.append(received)
        self._upstream_streams.append(server)

        async def pump(source: trio.SocketStream, target: trio.SocketStream, record: bytearray) -> None:
            try:
                while data := await source.receive_some(65536):
                    record += data
                    await target.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                nursery.cancel_scope.cancel()

        async with client, server:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, client, server, sent)
                nursery.start_soon(pump, server, client, received)

    async def inject(self, data: bytes) -> None:
        await self._upstream_streams[-1].send_all(data)


def with_master(test) -> MetadataServer:
    service = MetadataService(ManualClock(), LruPolicy())
    server = MetadataServer(service.handle, MASTER, service)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            proxy = Proxy(port)
            proxy_port = await nursery.start(serve_tcp, proxy.handle, "127.0.0.1", 0)
            with trio.fail_after(20):
                await test(proxy, proxy_port, port, nursery, service)
            nursery.cancel_scope.cancel()

    trio.run(main)
    return server


def test_an_on_path_proxy_reads_nothing_and_cannot_inject_or_replay(caplog: pytest.LogCaptureFixture) -> None:
    async def test(proxy: Proxy, proxy_port: int, port: int, nursery: trio.Nursery, service) -> None:
        master = await RemoteMaster.connect("127.0.0.1", proxy_port, NODE, nursery)
        await master.call(m.MkDir(ROOT_INO, b"visible-directory-name", 0o755, 0, 0))
        listing = await master.call(m.ReadDir(ROOT_INO, 0, 10))
        assert [e.name for e in listing.entries] == [b"visible-directory-name"]
        wire = bytes(proxy.sent[0] + proxy.received[0])
        assert b"visible-directory-name" not in wire and b"MkDir" not in wire  # encrypted both ways
        # A plaintext frame injected into the session: the master's TLS refuses the record and
        # drops the connection; nothing of it is applied.
        frame = encode_frame(FrameKind.REQUEST, 99, m.MkDir(ROOT_INO, b"injected", 0o755, 0, 0))
        await proxy.inject(b"\x17\x03\x03" + len(frame).to_bytes(2, "big") + frame)  # as an application data record
        with trio.fail_after(5):
            await master.closed.wait()
        with pytest.raises(MasterUnavailable):
            await master.call(m.Stats())
        # The whole recorded session, replayed on a new connection: it fails the TLS handshake
        # (the server's fresh randomness makes every recorded message stale).
        replay = await trio.open_tcp_stream("127.0.0.1", port)
        try:
            await replay.send_all(bytes(proxy.sent[0]))
            with trio.fail_after(10):
                while await replay.receive_some(65536):
                    pass
        except trio.BrokenResourceError:
            pass
        await replay.aclose()
        other = await RemoteMaster.connect("127.0.0.1", port, NODE, nursery)  # the master still serves
        names = [e.name for e in (await other.call(m.ReadDir(ROOT_INO, 0, 10))).entries]
        assert names == [b"visible-directory-name"]  # neither the injected nor a replayed MkDir
        await other.aclose()

    server = with_master(test)
    assert server.gate.refusals["tls"] == 1  # the replay
    assert "TLS connection failed" in caplog.text
    injection = [r.getMessage() for r in caplog.records if "closing connection from node 'node1'" in r.getMessage()]
    assert len(injection) == 1 and "bad record mac" in injection[0]  # the injection, logged as what it is


def test_chunk_bytes_cross_the_wire_encrypted() -> None:
    data = os.urandom(2 * CHUNK)
    store = TieredStore(DramTier(8 * CHUNK, chunk_size=CHUNK), None, read_buffers=ReadBufferPool(4, CHUNK))
    store.create(7)
    store.dram.write(7, 0, data)
    store.seal(7, len(data))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            port = await nursery.start(PeerServer(store, load_tls("owner")).serve, "127.0.0.1", 0)
            proxy = Proxy(port)
            proxy_port = await nursery.start(serve_tcp, proxy.handle, "127.0.0.1", 0)
            targets = [memoryview(bytearray(CHUNK)) for _ in range(2)]
            with trio.fail_after(20):
                await TcpTransport(load_tls("reader")).fetch(
                    f"127.0.0.1:{proxy_port}", 7, 0, targets, [CHUNK, CHUNK],
                    [chunk_checksum(data[:CHUNK]), chunk_checksum(data[CHUNK:])], lambda index: None)
            assert b"".join(bytes(t) for t in targets) == data
            wire = bytes(proxy.received[0])
            assert len(wire) > len(data)  # it all went through the proxy, ...
            assert data[:64] not in wire and data[CHUNK : CHUNK + 64] not in wire  # ... none of it readable
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_client_without_a_certificate_gets_nothing_from_a_master_or_a_peer() -> None:
    """Issue 16's first attack needed no secret; now nothing is served before a certificate
    of the cluster's CA is shown: a TLS client that trusts the CA but shows none is refused
    in the handshake by the master and by a node's peer port, which keep serving others."""
    import ssl

    from conftest import tls_dir

    anonymous = ssl.create_default_context(cafile=os.path.join(tls_dir("node1"), "ca.crt"))
    anonymous.check_hostname = False
    anonymous.minimum_version = ssl.TLSVersion.TLSv1_3
    store = TieredStore(DramTier(8 * CHUNK, chunk_size=CHUNK), None, read_buffers=ReadBufferPool(4, CHUNK))

    async def refused(port: int) -> bool:
        stream = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), anonymous, server_hostname="kvfs")
        try:
            await stream.send_all(encode_frame(FrameKind.REQUEST, 1, m.ReadDir(ROOT_INO, 0, 10)))
            with trio.fail_after(10):
                return await stream.receive_some(65536) == b""
        except trio.BrokenResourceError:
            return True
        finally:
            await stream.aclose()

    async def test(proxy: Proxy, proxy_port: int, port: int, nursery: trio.Nursery, service) -> None:
        assert await refused(port)
        peer_port = await nursery.start(PeerServer(store, load_tls("owner")).serve, "127.0.0.1", 0)
        assert await refused(peer_port)
        master = await RemoteMaster.connect("127.0.0.1", port, NODE, nursery)  # a node still is served
        assert (await master.call(m.ReadDir(ROOT_INO, 0, 10))).entries == []
        await master.aclose()

    server = with_master(test)
    assert server.gate.refusals["tls"] == 1
