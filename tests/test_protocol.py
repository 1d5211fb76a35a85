"""The wire protocol and the setup's welcome, driven with plain bytes (no sockets)."""

from __future__ import annotations

import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvfs.wire import messages as m
from kvfs.wire.auth import HandshakeMessage, Welcome
from kvfs.wire.protocol import (MAX_HEADER, MAX_PAYLOAD, PREFIX, PREFIX_SIZE, ErrorReply, FrameKind, FrameParser,
                                VERSION, HeaderDecoder, ProtocolError, encode_frame, parse_prefix)
from kvfs.wire.text import printable

ANY_REQUEST = typing.Union[tuple(m.Request.__subclasses__())]  # type: ignore[misc]


def test_frames_round_trip_through_a_split_stream() -> None:
    requests = [m.Lookup(1, b"a" * 200), m.Seal(7, 4096, 5, [1, 2, 3]), m.CollectOrphans()]
    stream = b"".join(encode_frame(FrameKind.REQUEST, i, r) for i, r in enumerate(requests))
    stream += encode_frame(FrameKind.RESPONSE, 9, m.Done([4]), payload_length=5) + b"hello"
    parser, frames = FrameParser(), []
    for i in range(0, len(stream), 7):  # arbitrary cuts
        frames += parser.frames(stream[i : i + 7])
    decoder = HeaderDecoder(ANY_REQUEST)
    assert [decoder.decode(f.header) for f in frames[:3]] == requests
    assert [f.prefix.request_id for f in frames] == [0, 1, 2, 9]
    assert frames[3].payload == b"hello"
    assert HeaderDecoder(m.Done).decode(frames[3].header) == m.Done([4])


@pytest.mark.parametrize("mutate, reason", [
    (lambda p: b"XX" + p[2:], "bad magic"),
    (lambda p: p[:2] + bytes([9]) + p[3:], "protocol version 9"),
    (lambda p: p[:3] + bytes([77]) + p[4:], "unknown frame kind 77"),
    (lambda p: PREFIX.pack(b"KV", VERSION, 2, MAX_HEADER + 1, 0, 1), "header of"),
    (lambda p: PREFIX.pack(b"KV", VERSION, 2, 10, MAX_PAYLOAD + 1, 1), "payload of"),
])
def test_bad_prefixes_are_refused_before_allocating(mutate, reason: str) -> None:
    good = encode_frame(FrameKind.REQUEST, 1, m.GetAttr(1))[:PREFIX_SIZE]
    with pytest.raises(ProtocolError, match=reason):
        parse_prefix(mutate(good))


def test_a_failed_parser_stays_failed() -> None:
    parser = FrameParser()
    with pytest.raises(ProtocolError):
        parser.frames(b"GARBAGE-GARBAGE-GARBAGE")
    with pytest.raises(ProtocolError):
        parser.frames(encode_frame(FrameKind.REQUEST, 1, m.GetAttr(1)))


def test_the_callers_limits_are_enforced_at_the_prefix() -> None:
    """Before authentication a connection parses with tiny limits; a prefix announcing more is
    refused before a byte of its header is buffered, and `limit` lifts them afterwards."""
    big = encode_frame(FrameKind.REQUEST, 1, m.Lookup(1, b"n" * 2000))
    parser = FrameParser(max_header=1024, max_payload=0)
    with pytest.raises(ProtocolError, match="header of 20.. bytes exceeds 1024"):
        parser.frames(big[:PREFIX_SIZE])
    with pytest.raises(ProtocolError, match="payload of 1 bytes exceeds 0"):
        FrameParser(1024, 0).frames(encode_frame(FrameKind.HELLO, 0, m.GetAttr(1), payload_length=1))
    lifted = FrameParser(max_header=1024, max_payload=0)
    assert lifted.frames(encode_frame(FrameKind.HELLO, 0, m.GetAttr(1)))[0].prefix.kind == FrameKind.HELLO
    lifted.limit(MAX_HEADER, MAX_PAYLOAD)
    assert HeaderDecoder(m.Lookup).decode(lifted.frames(big)[0].header) == m.Lookup(1, b"n" * 2000)


def test_a_payload_can_bypass_the_parser_into_the_callers_buffer() -> None:
    """The chunk reader's way: read exactly what `wanted` says, take the head, then move the
    payload into its own buffer (what was buffered, then the rest received outside)."""
    payload = bytes(range(256)) * 40
    stream = encode_frame(FrameKind.RESPONSE, 5, m.Done([1]), payload_length=len(payload)) + payload
    stream += encode_frame(FrameKind.RESPONSE, 6, m.Done([2]))
    parser = FrameParser()
    assert parser.wanted() == PREFIX_SIZE and parser.next_head() is None
    parser.feed(stream[:PREFIX_SIZE])
    assert parser.next_head() is None  # the prefix is parsed; the header is missing
    header_length = parser.wanted()
    parser.feed(stream[PREFIX_SIZE : PREFIX_SIZE + header_length + 100])  # 100 payload bytes with it
    head = parser.next_head()
    assert head is not None and head.prefix.request_id == 5 and head.prefix.payload_length == len(payload)
    assert parser.wanted() == len(payload) - 100
    target = memoryview(bytearray(len(payload)))
    assert parser.drain_payload(target) == 100
    start = PREFIX_SIZE + header_length + 100
    target[100:] = stream[start : start + len(payload) - 100]  # what a recv_into would do
    parser.payload_received(len(payload) - 100)
    assert bytes(target) == payload
    with pytest.raises(RuntimeError):
        parser.payload_received(1)  # nothing more is owed
    (last,) = parser.frames(stream[start + len(payload) - 100 :])
    assert last.prefix.request_id == 6 and last.payload == b""


def test_a_head_with_its_payload_untaken_blocks_the_next_one() -> None:
    parser = FrameParser()
    parser.feed(encode_frame(FrameKind.RESPONSE, 1, m.Done([1]), payload_length=3) + b"abc")
    assert parser.next_head() is not None
    with pytest.raises(RuntimeError, match="payload has not been taken"):
        parser.next_head()


def test_headers_of_the_wrong_type_are_refused() -> None:
    frame = encode_frame(FrameKind.REQUEST, 1, m.Done([1]))
    with pytest.raises(ProtocolError, match="invalid header"):
        HeaderDecoder(ANY_REQUEST).decode(frame[PREFIX_SIZE:])
    with pytest.raises(ProtocolError):
        HeaderDecoder(ErrorReply).decode(b"\xc1")


@settings(max_examples=300)
@given(st.binary(max_size=200), st.integers(1, 50))
def test_random_bytes_never_escape_as_anything_but_protocol_errors(data: bytes, cut: int) -> None:
    parser, decoder = FrameParser(), HeaderDecoder(ANY_REQUEST)
    try:
        for i in range(0, len(data), cut):
            for frame in parser.frames(data[i : i + cut]):
                decoder.decode(frame.header)
    except ProtocolError:
        pass


@settings(max_examples=200)
@given(st.binary(max_size=120))
def test_random_headers_behind_a_valid_prefix(header: bytes) -> None:
    frame = PREFIX.pack(b"KV", VERSION, FrameKind.REQUEST, len(header), 0, 1) + header
    frames = FrameParser().frames(frame)
    assert len(frames) == 1
    try:
        HeaderDecoder(ANY_REQUEST).decode(frames[0].header)
    except ProtocolError:
        pass


def test_a_welcome_round_trips() -> None:
    frame = encode_frame(FrameKind.HELLO, 0, Welcome("master", "master"))
    (parsed,) = FrameParser().frames(frame)
    assert HeaderDecoder(HandshakeMessage).decode(parsed.header) == Welcome("master", "master")


@pytest.mark.parametrize("message", [
    {"type": "Welcome", "name": "n" * 256, "role": "master"},
    {"type": "Welcome", "name": "master", "role": "r" * 17},
    {"type": "Hello", "role": "node", "nonce": bytes(32)},  # the secret's handshake is gone
])
def test_welcome_messages_out_of_bounds_are_protocol_errors(message: dict) -> None:
    with pytest.raises(ProtocolError, match="invalid header"):
        HeaderDecoder(HandshakeMessage).decode(msgspec.msgpack.encode(message))


def test_peer_text_is_escaped_and_cut_for_the_log() -> None:
    assert printable("node\nFAKE\x1b[31m\x00") == "node\\nFAKE\\x1b[31m\\x00"
    assert printable("gr\u00fc\u00dfe \\n") == "gr\u00fc\u00dfe \\n"  # printable text and backslashes stay
    assert printable(printable("a\nb")) == printable("a\nb")
    assert printable("x" * 300, 10) == "xxxxxxxxxx... (300 characters)"
