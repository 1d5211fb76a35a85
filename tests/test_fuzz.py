"""A structured fuzzer of the master (hypothesis).

In-process: random sequences of every request type, their fields drawn from the message
structs' own types (kvfs.wire.messages, read with msgspec.inspect) with valid, malformed and
extreme values, against the metadata service saving to a real lmdb after every request. Only
MetadataError may come out, and the saved state always reloads equal to memory.

Live: a real `kvfs master`; an authenticated client sends the same requests, and sockets that
never authenticate send random, truncated and oversized frames. Afterwards the master answers a
legitimate client, its RSS stays under RSS_LIMIT, and its log holds no traceback and no error.

KVFS_FUZZ_EXAMPLES=N runs N examples of each part instead of the default.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import UNEXPECTED, MasterDaemon, load_tls
from kvfs.clock import ManualClock
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.persist import MasterState
from kvfs.errors import MetadataError
from kvfs.net.rpc import _ANY_REQUEST, MasterUnavailable, RemoteMaster
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m
from kvfs.wire.protocol import MAGIC, PREFIX, VERSION, FrameKind, HeaderDecoder, ProtocolError, encode_frame
from master_view import reloaded_view, saved_view

EXAMPLES = int(os.environ.get("KVFS_FUZZ_EXAMPLES", "0"))
RSS_LIMIT = 256 << 20  # the master's resident memory after the live run (it starts near 40 MiB)

# Field values --------------------------------------------------------------------------------

EXTREME_INTS = [-1, -(2**63), -(2**63) - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                2**70, 0o177777, 0o200000, 1 << 50, 1 << 60]
# Mostly values a correct peer sends (small ids that exist), so that requests get past the
# checks into the handlers; now and then an extreme or malformed one.
def mostly(valid: st.SearchStrategy[Any], *others: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """`valid` three times in four, else one of `others`."""
    rare = st.one_of(*others)
    return st.sampled_from(range(4)).flatmap(lambda roll: rare if roll == 0 else valid)


INTS = mostly(st.integers(1, 6), st.integers(0, 12), st.sampled_from(EXTREME_INTS), st.integers(-(2**66), 2**66))
NAMES = [b"a", b"b", b"c.tmp", b"d", b"user.a", b"user.b"]
BAD_BYTES = [b"", b".", b"..", b"a/b", b"\0", b"x" * 256, b"user.", b"user." + b"x" * 251, b"x" * 5000]
BYTES = mostly(st.sampled_from(NAMES), st.sampled_from(BAD_BYTES), st.binary(max_size=12))
TEXTS = mostly(st.sampled_from(["n1", "n2", "127.0.0.1:1"]), st.sampled_from(["", "a\nb", "n" * 300]),
               st.text(max_size=8))


def values(kind: Any, top: bool = False) -> st.SearchStrategy[Any]:
    """Values for one field type, valid or not (its declared bounds are ignored on purpose).
    Only a request's own lists (`top`) are drawn one over their bound: nested, the sizes multiply."""
    if isinstance(kind, mi.IntType):
        return INTS
    if isinstance(kind, mi.BytesType):
        return BYTES
    if isinstance(kind, mi.StrType):
        return TEXTS
    if isinstance(kind, mi.BoolType):
        return st.booleans()
    if isinstance(kind, mi.NoneType):
        return st.none()
    if isinstance(kind, mi.LiteralType):
        return mostly(st.sampled_from(kind.values), st.just("tape"))
    if isinstance(kind, mi.UnionType):
        return st.one_of(*(values(t, top) for t in kind.types))
    if isinstance(kind, mi.ListType):
        if not top:
            return st.lists(values(kind.item_type), max_size=4)
        return mostly(st.lists(values(kind.item_type), max_size=4),
                      st.lists(values(kind.item_type), min_size=1, max_size=1).map(
                          lambda items: items * ((kind.max_length or 4) + 1)))  # one over the bound
    if isinstance(kind, mi.TupleType):
        return st.tuples(*(values(t) for t in kind.item_types))
    if isinstance(kind, mi.DictType):
        return st.dictionaries(values(kind.key_type), values(kind.value_type), max_size=2)
    if isinstance(kind, mi.StructType):
        return struct_of(kind.cls)
    raise AssertionError(f"no strategy for {kind}")


# Fields whose valid values are not small ints.
MODES = mostly(st.sampled_from([0o100644, 0o40755, 0o644, 0o755, 0o4777]), INTS)
BY_NAME = {
    "mode": MODES,
    "node": mostly(st.sampled_from([1, 2]), INTS),
    "path": mostly(st.lists(st.sampled_from(NAMES[:4]), min_size=1, max_size=3), st.lists(BYTES, max_size=3)),
    "xattrs": mostly(st.just({}), st.dictionaries(BYTES, BYTES, max_size=2)),
}


def struct_of(cls: type, top: bool = False) -> st.SearchStrategy[Any]:
    fields = mi.type_info(cls).fields  # type: ignore[attr-defined]
    return st.builds(cls, **{f.name: BY_NAME[f.name] if f.name in BY_NAME else values(f.type, top) for f in fields})


REQUEST_TYPES = sorted(m.Request.__subclasses__(), key=lambda cls: cls.__name__)
REQUESTS = st.one_of(*(struct_of(cls, top=True) for cls in REQUEST_TYPES))

# (caller, request) or a tick of the clock with an expiry pass (nodes go down, come back).
STEPS = st.one_of(st.tuples(st.sampled_from([0, 1, 2, 3]), REQUESTS), st.just("tick"))


def _examples(default: int) -> int:
    return EXAMPLES or default


# In-process ------------------------------------------------------------------------------------


def _service(cluster: bool) -> MetadataService:
    service = MetadataService(ManualClock(), LruPolicy(), MasterSettings(cluster=cluster, temp_grace_s=5))
    if cluster:
        for name in ("n1", "n2"):
            node = service.handle(m.Register(name, f"{name}:1"), 0).node
            service.handle(m.Report([]), node)
            service.handle(m.FinishRegistration(), node)
    # A little namespace for requests to find: inodes 2..4, versions 1..2.
    d = service.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), 1)
    for parent, name in ((ROOT_INO, b"a"), (d.ino, b"c.tmp")):
        opened = service.handle(m.Create(parent, name, 0o644, 0, 0, 1, True), 1)
        service.handle(m.Seal(opened.version, 5, 1, [7]), 1)
        service.handle(m.Release(opened.version, True), 1)
    return service


@pytest.fixture(scope="module")
def lmdb_state(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """One lmdb environment for every example (opening one per example costs more than the
    example), emptied at the start of each."""
    state = MasterState(tmp_path_factory.mktemp("fuzz-state"), map_size=64 << 20)
    yield state
    state.close()


def _emptied(state: MasterState) -> MasterState:
    with state.env.begin(write=True) as txn:
        for db in (state._inodes, state._versions, state._meta):
            txn.drop(db, delete=False)
    return state


@settings(max_examples=_examples(2000), deadline=None, suppress_health_check=list(HealthCheck))
@given(cluster=st.booleans(), steps=st.lists(STEPS, min_size=4, max_size=30))
def test_random_requests_fail_only_with_an_errno_and_the_state_reloads_equal(lmdb_state: MasterState, cluster: bool,
                                                                            steps: list[Any]) -> None:
    service = _service(cluster)
    state = _emptied(lmdb_state)
    state.save(service)
    for step in steps:
        if step == "tick":
            service.clock.advance(2)  # type: ignore[attr-defined]
            service.expire_nodes()
        else:
            caller, request = step
            try:
                service.handle(request, caller)
            except MetadataError as error:
                assert 0 < error.errno < 200, error
        state.save(service)  # never fails: nothing unencodable got in
    assert reloaded_view(service, state) == saved_view(service)


# Live ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live_master(tmp_path_factory: pytest.TempPathFactory) -> Any:
    master = MasterDaemon(tmp_path_factory.mktemp("fuzz-master"))
    master.start()
    yield master
    master.stop()


def _host_port(master: MasterDaemon) -> tuple[str, int]:
    host, port = master.address.rsplit(":", 1)
    return host, int(port)


async def _connect(host: str, port: int, nursery: trio.Nursery) -> RemoteMaster:
    """The fuzzer's client reconnects after every request that closed its connection: more new
    connections a second than the master takes from one address (SOURCE_RATE), so a refused
    connection is tried again, bounded, as a client backing off would."""
    with trio.fail_after(30):
        while True:
            try:
                return await RemoteMaster.connect(host, port, load_tls("fuzzer"), nursery)
            except (trio.BrokenResourceError, OSError):
                await trio.sleep(0.05)


_decode_request = HeaderDecoder(_ANY_REQUEST)


def _decodes(request: m.Request) -> bool:
    """Whether the master's decoder takes the request (else it closes the connection)."""
    try:
        frame = encode_frame(FrameKind.REQUEST, 1, request)
    except (ProtocolError, OverflowError, msgspec.EncodeError):
        return False
    try:
        _decode_request.decode(frame[PREFIX.size:])
    except ProtocolError:
        return False
    return True


@settings(max_examples=_examples(600), deadline=None, suppress_health_check=list(HealthCheck))
@given(requests=st.lists(REQUESTS, min_size=1, max_size=20))
def test_an_authenticated_client_gets_an_answer_or_an_errno(live_master: MasterDaemon,
                                                           requests: list[m.Request]) -> None:
    """Every request that decodes is answered (a response or an errno); one that does not
    decode closes that connection only."""
    host, port = _host_port(live_master)

    async def run() -> None:
        async with trio.open_nursery() as nursery:
            client = await _connect(host, port, nursery)
            for request in requests:
                if not _decodes(request):
                    if request_encodes(request):
                        with pytest.raises(MasterUnavailable), trio.fail_after(10):
                            await client.call(request)
                        client = await _connect(host, port, nursery)
                    continue
                try:
                    with trio.fail_after(10):
                        await client.call(request)
                except MetadataError as error:
                    assert not isinstance(error, MasterUnavailable), f"{request!r}: {error}"
            await client.aclose()
            nursery.cancel_scope.cancel()

    trio.run(run)


def request_encodes(request: m.Request) -> bool:
    try:
        encode_frame(FrameKind.REQUEST, 1, request)
    except (ProtocolError, OverflowError, msgspec.EncodeError):
        return False
    return True


def _prefix(kind: int, header_length: int, payload_length: int, request_id: int = 0,
            magic: bytes = MAGIC, version: int = VERSION) -> bytes:
    return PREFIX.pack(magic, version, kind, header_length, payload_length, request_id)


# What reaches a port before TLS is set up: noise, kvfs frames sent in the clear (a client
# from before TLS, or an attacker without credentials), and TLS records that lie.
RAW_FRAMES = st.one_of(
    st.binary(max_size=64),  # noise
    st.builds(lambda kind, header: _prefix(kind, len(header), 0) + header,  # a frame of any kind
              st.integers(0, 255), st.binary(max_size=64)),
    st.builds(lambda n, p: _prefix(FrameKind.HELLO, n, p), st.sampled_from([2**32 - 1, 1 << 21, 1 << 20]),
              st.sampled_from([0, 2**32 - 1, 9 << 20])),  # oversized, announced
    st.builds(lambda request: _raw_request(request), REQUESTS),  # a request with no TLS at all
    st.builds(lambda magic, version: _prefix(FrameKind.HELLO, 0, 0, 0, magic, version),
              st.binary(min_size=2, max_size=2), st.integers(0, 255)),
    # TLS records: a handshake record announcing up to 64 KiB with random (or no) contents,
    # a record of any type and version, and a truncated one.
    st.builds(lambda length, body: bytes([0x16, 0x03, 0x01]) + length.to_bytes(2, "big") + body,
              st.integers(0, 0xFFFF), st.binary(max_size=256)),
    st.builds(lambda kind, version, body: bytes([kind]) + version + len(body).to_bytes(2, "big") + body,
              st.integers(0, 255), st.binary(min_size=2, max_size=2), st.binary(max_size=128)),
    st.builds(lambda cut: bytes([0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xFC, 0x03, 0x03])[:cut],
              st.integers(0, 11)),
)


def _raw_request(request: m.Request) -> bytes:
    try:
        return encode_frame(FrameKind.REQUEST, 1, request)
    except (ProtocolError, OverflowError, msgspec.EncodeError):
        return b""


@settings(max_examples=_examples(1000), deadline=None, suppress_health_check=list(HealthCheck))
@given(frames=st.lists(RAW_FRAMES, min_size=1, max_size=4), wait=st.booleans())
def test_unauthenticated_sockets_send_random_truncated_and_oversized_frames(live_master: MasterDaemon,
                                                                            frames: list[bytes], wait: bool) -> None:
    # From an address of its own (the master limits connections per source address): the
    # legitimate clients of the other tests connect from 127.0.0.1.
    with socket.create_connection(_host_port(live_master), timeout=5, source_address=("127.0.0.3", 0)) as sock:
        try:
            for frame in frames:
                sock.sendall(frame)
            if wait:  # read what the master answers, until it closes or goes quiet
                sock.settimeout(0.05)
                while sock.recv(65536):
                    pass
        except (ConnectionError, socket.timeout):
            pass  # the master hung up, as it may


def _vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_after_the_fuzzing_the_master_serves_and_logged_no_traceback(live_master: MasterDaemon) -> None:
    """(Runs after the live fuzz tests of this module, on the same master; then restarts it on
    the state they left, which it loads and serves from.)"""

    async def legitimate() -> None:
        with trio.fail_after(30):
            await legitimate_calls()

    async def legitimate_calls() -> None:
        async with trio.open_nursery() as nursery:
            client = await RemoteMaster.connect(host, port, load_tls("legit"), nursery)
            node = (await client.call(m.Register("legit", "127.0.0.1:9"))).node
            await client.call(m.Report([]))
            await client.call(m.FinishRegistration())
            await client.call(m.Heartbeat(1 << 30, 0))
            name = b"legit-%d" % time.monotonic_ns()
            attr = await client.call(m.MkDir(ROOT_INO, name, 0o755, 0, 0))
            assert (await client.call(m.Lookup(ROOT_INO, name))).attr.ino == attr.ino
            assert node >= 1
            await client.aclose()
            nursery.cancel_scope.cancel()

    host, port = _host_port(live_master)
    trio.run(legitimate)
    assert live_master.process is not None and live_master.process.poll() is None
    rss = _vm_rss(live_master.process.pid)
    print(f"master RSS after fuzzing: {rss >> 20} MiB")
    assert rss < RSS_LIMIT, f"the master holds {rss >> 20} MiB after the fuzzing"
    live_master.stop()
    live_master.start()
    host, port = _host_port(live_master)
    trio.run(legitimate)
    log = live_master.log_text()
    assert not [line for line in log.splitlines() if UNEXPECTED.search(line)], log[-5000:]
    assert "Traceback" not in log
