"""kvfs's own records on peer connections (kvfs.net.sealed): the key schedule and the record
counter on their own, a sealed socket pair, and a real peer server and transport on loopback
with an attacker on the path who flips, replays, reorders, drops and cuts records."""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
from typing import Callable

import pytest
import trio
import trio.testing

from conftest import load_tls
from kvfs.checksum import PIECE_SIZE, chunk_checksum
from kvfs.errors import StorageError
from kvfs.net.sealed import (HEADER, MAX_PLAINTEXT, MAX_RECORD, SECRET_SIZE, TAG_SIZE, Opener, SealedRecordError,
                             SealedSocket, Sealer, derive_keys, record_length)
from kvfs.net.streams import serve_tcp
from kvfs.net.transport import PeerServer, TcpTransport
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.dram import DramTier
from kvfs.store.tiered import TieredStore
from kvfs.wire.protocol import ProtocolError

MiB = 1 << 20


# The key schedule and the counter, no sockets --------------------------------------------

def test_both_ends_derive_the_same_keys_only_from_both_secrets() -> None:
    server, client = os.urandom(SECRET_SIZE), os.urandom(SECRET_SIZE)
    to_server, to_client = derive_keys(server, client)
    assert derive_keys(server, client) == (to_server, to_client)  # the other end, the same two secrets
    assert len(to_server) == len(to_client) == 32 and to_server != to_client  # a key per direction
    # One secret known is not enough: change either one and both keys change.
    for other in (derive_keys(os.urandom(SECRET_SIZE), client), derive_keys(server, os.urandom(SECRET_SIZE))):
        assert other[0] != to_server and other[1] != to_client
    assert derive_keys(client, server) != (to_server, to_client)  # the roles are part of it
    with pytest.raises(ProtocolError, match="16 bytes"):
        derive_keys(server, client[:16])


def test_records_open_in_order_and_only_in_order() -> None:
    key = os.urandom(32)
    sealer, opener = Sealer(key), Opener(key)
    out = memoryview(bytearray(MAX_RECORD))
    records = []
    for size in (1, 1000, MAX_PLAINTEXT):
        end = sealer.seal_into(os.urandom(size), out)
        assert end == HEADER.size + size + TAG_SIZE and record_length(out[: HEADER.size]) == size + TAG_SIZE
        records.append(bytes(out[:end]))

    def open_(opener: Opener, record: bytes) -> bytes:
        plain = memoryview(bytearray(len(record) - HEADER.size - TAG_SIZE))
        opener.open_into(record[: HEADER.size], record[HEADER.size:], plain)
        return bytes(plain)

    assert [len(open_(opener, r)) for r in records] == [1, 1000, MAX_PLAINTEXT]
    for tampered in (lambda r: r[:-1] + bytes([r[-1] ^ 1]),  # a flipped byte of the tag
                     lambda r: r[:HEADER.size] + bytes([r[HEADER.size] ^ 0x80]) + r[HEADER.size + 1:]):  # of the text
        with pytest.raises(SealedRecordError, match="fails authentication"):
            open_(Opener(key), tampered(records[0]))
    with pytest.raises(SealedRecordError):  # replayed: the second record's nonce is 1, not 0
        open_(Opener(key), records[1])
    second = Opener(key)
    open_(second, records[0])
    with pytest.raises(SealedRecordError):  # the first one again
        open_(second, records[0])
    with pytest.raises(SealedRecordError):  # a different key (the other direction)
        open_(Opener(os.urandom(32)), records[0])


def test_the_record_counter_never_repeats_and_stops_before_it_wraps() -> None:
    sealer = Sealer(os.urandom(32))
    nonces = [sealer.next_nonce() for _ in range(10000)]
    assert len(set(nonces)) == len(nonces) and nonces == sorted(nonces)
    assert all(len(nonce) == 12 for nonce in nonces)
    last = Sealer(os.urandom(32), counter=(1 << 64) - 2)
    assert last.next_nonce() == b"\0" * 4 + ((1 << 64) - 2).to_bytes(8, "big")
    assert last.next_nonce() == b"\0" * 4 + b"\xff" * 8
    with pytest.raises(SealedRecordError, match="nonces are spent"):
        last.next_nonce()  # 2**64 would wrap to 0: the connection closes instead
    with pytest.raises(SealedRecordError, match="nonces are spent"):
        last.seal_into(b"x", memoryview(bytearray(MAX_RECORD)))


def test_a_header_is_bounded_before_anything_trusts_it() -> None:
    for length in (0, TAG_SIZE, MAX_PLAINTEXT + TAG_SIZE + 1, 1 << 31):
        with pytest.raises(SealedRecordError):
            record_length(HEADER.pack(length))
    assert record_length(HEADER.pack(MAX_PLAINTEXT + TAG_SIZE)) == MAX_PLAINTEXT + TAG_SIZE


# A sealed socket pair ---------------------------------------------------------------------

def sealed_pair() -> tuple[SealedSocket, SealedSocket]:
    a, b = socket.socketpair()
    to_server, to_client = derive_keys(os.urandom(SECRET_SIZE), os.urandom(SECRET_SIZE))
    return SealedSocket(a, to_server, to_client), SealedSocket(b, to_client, to_server)


def test_bytes_cross_in_records_and_reads_of_any_size_get_them() -> None:
    client, server = sealed_pair()
    data = os.urandom(2 * MAX_PLAINTEXT + 777)
    sender = threading.Thread(target=client.sendall, args=(data,))
    sender.start()
    received = bytearray()
    buffer = memoryview(bytearray(MAX_PLAINTEXT))
    sizes = iter([5, MAX_PLAINTEXT, 100, 3 * MAX_PLAINTEXT] * 10)
    while len(received) < len(data):
        count = server.recv_into(buffer, min(next(sizes), len(buffer)))
        assert count > 0
        received += buffer[:count]
    sender.join()
    assert received == data and client.records_sent == server.records_received == 3
    server.sendall(b"the other way")
    assert client.recv(4) + client.recv(100) == b"the other way"
    client.close()
    assert server.recv(10) == b""  # closed at a record's end: the end of the stream
    server.close()


def test_a_non_blocking_send_is_whole_records_retried_with_the_same_bytes() -> None:
    """As an SSL socket: a record the socket took part of is finished by the next send of
    the same bytes, before anything new; each record is encrypted once."""
    client, server = sealed_pair()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 * 1024)
    client.setblocking(False)
    data = memoryview(os.urandom(6 * MAX_PLAINTEXT))
    received = bytearray()

    def receive() -> None:
        buffer = bytearray(MAX_PLAINTEXT)
        while len(received) < len(data):
            count = server.recv_into(buffer)
            assert count > 0
            received.extend(buffer[:count])

    reader = threading.Thread(target=receive)
    sent = refused = 0
    reader.start()
    while sent < len(data):
        try:
            count = client.send(data[sent:])
        except BlockingIOError:
            refused += 1
            socket_ready = __import__("select").select([], [client], [], 10)[1]
            assert socket_ready
            continue
        assert count in (MAX_PLAINTEXT, len(data) - sent)
        sent += count
    reader.join(30)
    assert bytes(received) == bytes(data)
    assert client.records_sent == 6 and refused > 0  # the socket was full at times


# A real peer server and transport, an attacker on the path ---------------------------------

TLS_TYPES = (0x14, 0x15, 0x16, 0x17)
Tamper = Callable[[int, bytes], list[bytes]]


class RecordProxy:
    """Forwards connections to UPSTREAM. On the first TAMPERED connections, the records of
    kvfs's layer one side sends (once TLS has ended) go through `tamper(index, record)`,
    which returns what to send instead; TLS records pass untouched. Records all the bytes."""

    def __init__(self, upstream: int, tamper: Tamper, from_server: bool = True, tampered: int = 1) -> None:
        self.upstream = upstream
        self.tamper = tamper
        self.from_server = from_server
        self.tampered = tampered
        self.connections = 0
        self.server_bytes: list[bytearray] = []  # server -> client, per connection
        self.server_records: list[int] = []  # kvfs records the server sent, per connection
        self.client_closed: list[trio.Event] = []  # the client hung up
        self.server_closed: list[trio.Event] = []  # the server hung up

    async def handle(self, client: trio.SocketStream) -> None:
        number = self.connections
        self.connections += 1
        server = await trio.open_tcp_stream("127.0.0.1", self.upstream)
        self.server_bytes.append(bytearray())
        self.server_records.append(0)
        self.client_closed.append(trio.Event())
        self.server_closed.append(trio.Event())

        async def pump(source: trio.SocketStream, target: trio.SocketStream, from_server: bool) -> None:
            pending = bytearray()
            records = 0
            tamper = number < self.tampered and from_server == self.from_server
            try:
                while data := await source.receive_some(65536):
                    if from_server:
                        self.server_bytes[number] += data
                    pending += data
                    while len(pending) >= 5:
                        if pending[0] in TLS_TYPES and pending[1] == 0x03:  # a TLS record (a length never starts so)
                            end = 5 + int.from_bytes(pending[3:5], "big")
                            sealed = False
                        else:  # kvfs's: a 4-byte length, then that much
                            end = HEADER.size + int.from_bytes(pending[: HEADER.size], "big")
                            sealed = True
                        if len(pending) < end:
                            break
                        unit = bytes(pending[:end])
                        del pending[:end]
                        if sealed:
                            if from_server:
                                self.server_records[number] += 1
                            out = self.tamper(records, unit) if tamper else [unit]
                            records += 1
                        else:
                            out = [unit]
                        for piece in out:
                            await target.send_all(piece)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            finally:
                (self.server_closed if from_server else self.client_closed)[number].set()
                nursery.cancel_scope.cancel()

        async with client, server:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, client, server, False)
                nursery.start_soon(pump, server, client, True)


def flipped(at: int) -> Tamper:
    return lambda index, record: [record[:-40] + bytes([record[-40] ^ 0x01]) + record[-39:]] if index == at \
        else [record]


def replayed(at: int) -> Tamper:
    held: list[bytes] = []

    def tamper(index: int, record: bytes) -> list[bytes]:
        if index == at - 1:
            held.append(record)
        return held + [record] if index == at else [record]  # the record before, once more

    return tamper


def reordered(at: int) -> Tamper:
    held: list[bytes] = []

    def tamper(index: int, record: bytes) -> list[bytes]:
        if index == at:
            held.append(record)
            return []
        return [record] + held if index == at + 1 else [record]

    return tamper


def dropped(at: int) -> Tamper:
    return lambda index, record: [] if index == at else [record]


def truncated(at: int) -> Tamper:
    """The record cut to half its bytes (its header unchanged), the stream going on."""
    return lambda index, record: [record[: len(record) // 2]] if index == at else [record]


BIG = 4 * PIECE_SIZE  # a chunk of four pieces: a frame header record, then one record per piece


def with_proxy(data: bytes, tamper: Tamper, test, from_server: bool = True) -> None:
    store = TieredStore(DramTier(4 * BIG, chunk_size=BIG), None, read_buffers=ReadBufferPool(4, BIG))
    store.create(7)
    store.dram.write(7, 0, data)
    store.seal(7, len(data))
    server = PeerServer(store, load_tls("owner"))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            port = await nursery.start(server.serve, "127.0.0.1", 0)
            proxy = RecordProxy(port, tamper, from_server)
            proxy_port = await nursery.start(serve_tcp, proxy.handle, "127.0.0.1", 0)
            with trio.fail_after(30):
                await test(f"127.0.0.1:{proxy_port}", f"127.0.0.1:{port}", server, proxy)
            nursery.cancel_scope.cancel()

    trio.run(main)


def marked(size: int) -> tuple[bytes, bytes]:
    marker = b"KVFS-PLAIN-" + os.urandom(12).hex().encode()
    block = marker + os.urandom(4096 - len(marker))
    return marker, (block * (size // len(block) + 1))[:size]


def test_a_recorded_session_shows_no_plaintext_and_the_chunk_arrives_whole() -> None:
    marker, data = marked(BIG)

    async def test(address: str, direct: str, server: PeerServer, proxy: RecordProxy) -> None:
        transport = TcpTransport(load_tls("reader"))
        for _ in range(2):  # the second fetch on the same connection: the counters go on
            target = memoryview(bytearray(BIG))
            await transport.fetch(address, 7, 0, [target], [BIG], [chunk_checksum(data)], lambda index: None)
            assert bytes(target) == data
        assert transport.connections == transport.sealed_connections == server.sealed_connections == 1
        wire = bytes(proxy.server_bytes[0])
        assert len(wire) > 2 * BIG and marker not in wire and data[:64] not in wire
        assert proxy.server_records[0] == 2 * (1 + BIG // MAX_PLAINTEXT)  # a header record and a record per piece
        await transport.aclose()

    with_proxy(data, lambda index, record: [record], test)


@pytest.mark.parametrize("attack", [flipped, replayed, reordered, dropped, truncated])
def test_a_record_altered_on_the_path_fails_the_load_with_eio_and_nothing_of_it_is_served(attack) -> None:
    """The owner's fourth record (the chunk's third piece) altered on its way: the fetch fails
    with EIO, only the two pieces before it were handed on, the reader closes the connection,
    and the owner serves the next connection as before."""
    data = os.urandom(BIG)
    checksums = [chunk_checksum(data)]

    async def test(address: str, direct: str, server: PeerServer, proxy: RecordProxy) -> None:
        transport = TcpTransport(load_tls("reader"))
        target = memoryview(bytearray(BIG))
        whole: list[int] = []
        pieces: list[int] = []
        with pytest.raises(StorageError) as raised:
            await transport.fetch(address, 7, 0, [target], [BIG], checksums, whole.append,
                                  on_piece=lambda index, verified: pieces.append(verified))
        await trio.testing.wait_all_tasks_blocked()  # the thread's last hand-ons have run
        assert raised.value.errno == errno.EIO and "fails authentication" in str(raised.value), raised.value
        assert transport.checksum_failures == 0  # caught by the records, before any checksum
        assert whole == [] and pieces == [PIECE_SIZE, 2 * PIECE_SIZE]
        await proxy.client_closed[0].wait()  # the reader hung up on the connection
        # The owner is fine: the next connection, untouched, gets the chunk.
        again = memoryview(bytearray(BIG))
        await transport.fetch(address, 7, 0, [again], [BIG], checksums, lambda index: None)
        assert bytes(again) == data and server.sealed_connections == 2
        await transport.aclose()

    with_proxy(data, attack(3), test)


def test_a_request_altered_on_the_path_is_not_served_and_its_connection_closed(
        caplog: pytest.LogCaptureFixture) -> None:
    """The reader's second request on a connection (its second record) altered: the owner
    serves nothing more on that connection and closes it; the fetch goes again on a new one
    (as on any pooled connection closed before an answer) and gets the chunk."""
    data = os.urandom(BIG)

    async def test(address: str, direct: str, server: PeerServer, proxy: RecordProxy) -> None:
        transport = TcpTransport(load_tls("reader"))
        with caplog.at_level(logging.WARNING, logger="kvfs.net.transport"):
            for _ in range(2):
                target = memoryview(bytearray(BIG))
                await transport.fetch(address, 7, 0, [target], [BIG], [chunk_checksum(data)], lambda index: None)
                assert bytes(target) == data
        await proxy.server_closed[0].wait()
        assert proxy.server_records[0] == 1 + BIG // MAX_PLAINTEXT  # the first fetch's answer, nothing after
        assert proxy.connections == transport.connections == 2
        assert "fails authentication" in caplog.text
        await transport.aclose()

    with_proxy(data, flipped(1), test, from_server=False)
