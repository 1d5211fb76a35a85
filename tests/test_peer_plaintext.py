"""Peer encryption off (`kvfs node --peer-encryption off`): chunk connections between two
nodes that both have it off are set up and authenticated in TLS, then carry their frames in
the clear; every other pairing moves to kvfs's encrypted records (kvfs.net.sealed). Seen on
the wire (a capture on loopback, a proxy on the path), in the nodes' metrics, and against an
unauthenticated client and a corrupted byte."""

from __future__ import annotations

import errno
import os
import re
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Callable

import pytest
import trio
import trio.testing

from conftest import Cluster, KvfsMount, load_tls, tls_dir
from kvfs.checksum import PIECE_SIZE, chunk_checksum
from kvfs.errors import StorageError
from kvfs.net.handshake import connect
from kvfs.net.streams import serve_tcp
from kvfs.net.transport import PeerServer, TcpTransport
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.dram import DramTier
from kvfs.store.tiered import TieredStore

MiB = 1 << 20
ETH_P_ALL = 0x0003
SO_RCVBUFFORCE = 33
SO_TIMESTAMPNS = 35


def marked(size: int) -> tuple[bytes, bytes]:
    """(a random marker, SIZE bytes of random blocks that each hold it): the marker shows up on
    the wire wherever the file's bytes cross it in the clear, and nowhere else."""
    marker = b"KVFS-PLAIN-" + os.urandom(12).hex().encode()
    block = marker + os.urandom(4096 - len(marker))
    return marker, (block * (size // len(block) + 1))[:size]


class LoopbackCapture:
    """Every packet on the loopback interface, as the kernel hands them to a packet socket:
    counts the packets' bytes and the packets that hold MARKER, until stopped: the packets the
    kernel received until then are all read, and the first one it received after ends it (on
    a loopback that never goes quiet, other processes' traffic, as well as on a quiet one)."""

    def __init__(self, marker: bytes) -> None:
        self.marker = marker
        self.captured = 0
        self.hits = 0
        self._stop = threading.Event()
        self._stopped_at = 0.0
        self._socket = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        # Room for the whole transfer (as root, past net.core.rmem_max): a packet the thread
        # had no time for is queued, not dropped.
        self._socket.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 256 * MiB)
        self._socket.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)  # when the kernel got each packet
        self._socket.bind(("lo", 0))
        self._socket.settimeout(0.2)
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        buffer = bytearray(1 << 20)
        while True:
            try:
                count, ancillary, _, _ = self._socket.recvmsg_into([buffer], 64)
            except TimeoutError:  # all queued packets read: done, once stopped
                if self._stop.is_set():
                    return
                continue
            if self._stop.is_set() and self._received(ancillary) > self._stopped_at:
                return  # a packet of after the stop: the ones before it are all read
            self.captured += count
            if buffer.find(self.marker, 0, count) >= 0:
                self.hits += 1

    @staticmethod
    def _received(ancillary: list[tuple[int, int, bytes]]) -> float:
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                seconds, nanoseconds = struct.unpack("qq", data[:16])
                return seconds + nanoseconds / 1e9
        return 0.0

    def __enter__(self) -> LoopbackCapture:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopped_at = time.time()  # the packets' timestamps are wall-clock time
        self._stop.set()
        self._thread.join()
        self._socket.close()


def scrape(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, f"{url} has no {name}"
    return float(found.group(1))


def peer_address(node: KvfsMount) -> tuple[str, int]:
    found = re.findall(r"peer server on (\S+):(\d+);", node.log_text())
    assert found, "the node did not announce its peer server"
    return found[-1][0], int(found[-1][1])


def read_across(cluster: Cluster, owner_flags: tuple[str, ...],
                reader_flags: tuple[str, ...]) -> tuple[KvfsMount, KvfsMount, LoopbackCapture]:
    """An 8 MiB file written on a node with OWNER_FLAGS, read on one with READER_FLAGS while
    loopback is captured; the bytes read must be the bytes written."""
    owner, reader = cluster.add_node("256M", *owner_flags), cluster.add_node("256M", *reader_flags)
    marker, data = marked(8 * MiB)
    (owner.path / "f.bin").write_bytes(data)
    with LoopbackCapture(marker) as capture:
        assert (reader.path / "f.bin").read_bytes() == data
    assert capture.captured > len(data)  # the capture saw the transfer (and more) go by
    return owner, reader, capture


def test_both_nodes_off_read_across_in_the_clear(cluster: Cluster) -> None:
    owner, reader, capture = read_across(cluster, ("--peer-encryption", "off"), ("--peer-encryption", "off"))
    assert capture.hits > 0, "the file's bytes should cross loopback in the clear"
    assert scrape(owner.metrics_url, "kvfs_peer_connections_plaintext_total") >= 1
    status = subprocess.run([sys.executable, "-m", "kvfs", "status", "--master", cluster.master.address],
                            capture_output=True, text=True, timeout=60)  # as the tests' admin (KVFS_TLS_DIR)
    assert status.returncode == 0, status.stderr
    assert status.stdout.count(" tcp-plain ") == 2, status.stdout  # each node's TRANSPORT
    for node in (owner, reader):
        assert "peer encryption is off" in node.log_text()  # told at start, as a WARNING
        assert re.search(r"WARNING.*peer encryption is off", node.log_text())


def test_both_nodes_on_read_across_in_encrypted_records(cluster: Cluster) -> None:
    """The default: a capture of the whole transfer holds none of the file's bytes."""
    owner, reader, capture = read_across(cluster, (), ())
    assert capture.hits == 0, "nodes with peer encryption on must get the file's bytes encrypted"
    assert scrape(owner.metrics_url, "kvfs_peer_connections_plaintext_total") == 0
    for node in (owner, reader):
        assert "peer encryption is off" not in node.log_text()


def test_one_node_on_keeps_the_connection_encrypted(cluster: Cluster) -> None:
    owner, reader, capture = read_across(cluster, ("--peer-encryption", "off"), ())
    assert capture.hits == 0, "a node with peer encryption on must get the file's bytes encrypted"
    assert scrape(owner.metrics_url, "kvfs_peer_connections_plaintext_total") == 0
    assert "peer encryption is off" not in reader.log_text()


def test_an_off_node_still_refuses_clients_without_a_certificate(cluster: Cluster) -> None:
    """The peer port of a node with peer encryption off still admits only certificates of the
    cluster's CA with a peer's role: a TLS client without a certificate and a client that
    speaks no TLS get nothing, and are counted as refused."""
    node = cluster.add_node("64M", "--peer-encryption", "off")
    (node.path / "f.bin").write_bytes(b"secret" * 1000)
    host, port = peer_address(node)
    refused_before = scrape(node.metrics_url, "kvfs_peer_connections_refused_total")
    anonymous = ssl.create_default_context(cafile=os.path.join(tls_dir("node1"), "ca.crt"))
    anonymous.check_hostname = False
    anonymous.minimum_version = ssl.TLSVersion.TLSv1_3
    with socket.create_connection((host, port), timeout=10) as raw:
        with anonymous.wrap_socket(raw) as tls:
            with pytest.raises((ssl.SSLError, ConnectionError)):  # the alert arrives with the first read
                tls.sendall(b"\0" * 64)
                assert tls.recv(65536) == b""
                raise ConnectionError("closed without a word")
    with socket.create_connection((host, port), timeout=10) as plain:  # frames without any TLS
        plain.sendall(b"\x4b\x56" + b"\0" * 62)
        try:
            assert b"secret" not in plain.recv(65536)
        except ConnectionError:
            pass
    deadline = time.monotonic() + 10
    while scrape(node.metrics_url, "kvfs_peer_connections_refused_total") < refused_before + 2:
        assert time.monotonic() < deadline, "both clients should be counted as refused"
        time.sleep(0.05)
    assert scrape(node.metrics_url, "kvfs_peer_connections_plaintext_total") == 0


# In process: a real peer server and transport over loopback TCP, a proxy between them.

class FlippingProxy:
    """Forwards connections to UPSTREAM and flips one byte of the first occurrence of MARKER
    in what the server sends (None: forwards untouched); records the server's bytes."""

    def __init__(self, upstream: int, marker: bytes | None) -> None:
        self.upstream = upstream
        self.marker = marker
        self.flipped = 0
        self.received = bytearray()

    async def handle(self, client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream("127.0.0.1", self.upstream)

        async def pump(source: trio.SocketStream, target: trio.SocketStream, from_server: bool) -> None:
            tail = b""  # the end of what went before: a marker split between two reads is found too
            try:
                while data := await source.receive_some(65536):
                    if from_server:
                        self.received += data
                        if self.marker is not None and not self.flipped:
                            at = (tail + data).find(self.marker)
                            if at >= 0:  # flip the marker's last byte, which is in this read
                                last = at + len(self.marker) - 1 - len(tail)
                                data = data[:last] + bytes([data[last] ^ 0x01]) + data[last + 1:]
                                self.flipped += 1
                            tail = (tail + data)[-(len(self.marker) - 1):]
                    await target.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                nursery.cancel_scope.cancel()

        async with client, server:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, client, server, False)
                nursery.start_soon(pump, server, client, True)


def with_proxy(data: bytes, chunk: int, marker: bytes | None, server_plain: bool,
               test: Callable[[str, PeerServer, FlippingProxy], object]) -> None:
    store = TieredStore(DramTier(4 * len(data) + 4 * chunk, chunk_size=chunk), None,
                        read_buffers=ReadBufferPool(4, chunk))
    store.create(7)
    store.dram.write(7, 0, data)
    store.seal(7, len(data))
    server = PeerServer(store, load_tls("owner"), plaintext=server_plain)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            proxy = FlippingProxy(port, marker)
            proxy_port = await nursery.start(serve_tcp, proxy.handle, "127.0.0.1", 0)
            with trio.fail_after(20):
                await test(f"127.0.0.1:{proxy_port}", server, proxy)  # type: ignore[misc]
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("server_plain,client_plain", [(True, True), (True, False), (False, True), (False, False)])
def test_plain_only_when_both_ends_say_off(server_plain: bool, client_plain: bool) -> None:
    chunk = MiB
    marker, data = marked(3 * chunk)
    checksums = [chunk_checksum(data[i : i + chunk]) for i in range(0, len(data), chunk)]

    async def test(address: str, server: PeerServer, proxy: FlippingProxy) -> None:
        transport = TcpTransport(load_tls("reader"), plaintext=client_plain)
        for _ in range(2):  # the second fetch reuses the connection, in the same mode
            targets = [memoryview(bytearray(chunk)) for _ in range(3)]
            await transport.fetch(address, 7, 0, targets, [chunk] * 3, checksums, lambda index: None)
            assert b"".join(bytes(t) for t in targets) == data
        plain = server_plain and client_plain
        assert transport.connections == 1
        assert transport.plaintext_connections == server.plaintext_connections == int(plain)
        assert transport.sealed_connections == server.sealed_connections == int(not plain)
        assert (marker in proxy.received) == plain
        await transport.aclose()

    with_proxy(data, chunk, None, server_plain, test)


def test_a_corrupted_byte_on_a_plain_connection_fails_its_checksum_and_is_not_served() -> None:
    """A byte flipped on the path, in the third of a chunk's four pieces: the fetch fails with
    EIO, the two pieces before it (verified) are all that was handed on, and the chunk is
    never reported whole."""
    chunk = 4 * PIECE_SIZE
    data = bytearray(os.urandom(chunk))
    marker = b"FLIP-" + os.urandom(12).hex().encode()
    data[2 * PIECE_SIZE + 100 : 2 * PIECE_SIZE + 100 + len(marker)] = marker
    checksums = [chunk_checksum(data)]

    async def test(address: str, server: PeerServer, proxy: FlippingProxy) -> None:
        transport = TcpTransport(load_tls("reader"), plaintext=True)
        target = memoryview(bytearray(chunk))
        whole: list[int] = []
        pieces: list[int] = []
        with pytest.raises(StorageError) as raised:
            await transport.fetch(address, 7, 0, [target], [chunk], checksums, whole.append,
                                  on_piece=lambda index, verified: pieces.append(verified))
        await trio.testing.wait_all_tasks_blocked()  # the thread's last hand-ons have run
        assert raised.value.errno == errno.EIO and "fails its checksum" in str(raised.value)
        assert proxy.flipped == 1 and transport.plaintext_connections == 1
        assert transport.checksum_failures == 1
        assert whole == [] and max(pieces, default=0) <= 2 * PIECE_SIZE
        assert bytes(target[: max(pieces, default=0)]) == bytes(data[: max(pieces, default=0)])
        await transport.aclose()

    with_proxy(bytes(data), chunk, marker, True, test)


def test_an_rdma_request_on_a_plain_connection_is_refused() -> None:
    """Memory keys are never sent in the clear: a plain connection that asks for RDMA is closed."""
    from kvfs.wire.protocol import FrameKind
    from kvfs.wire.rdma_messages import Locate

    async def test(address: str, server: PeerServer, proxy: FlippingProxy) -> None:
        host, port = address.rsplit(":", 1)
        frames = await connect(host, int(port), load_tls("reader"), "node", plaintext=True)
        assert frames.plaintext
        try:
            await frames.send(FrameKind.REQUEST, 1, Locate(7, 0, 1))
            with pytest.raises((EOFError, trio.BrokenResourceError)):
                await frames.receive()
        finally:
            await frames.aclose()

    with_proxy(b"x" * MiB, MiB, None, True, test)
