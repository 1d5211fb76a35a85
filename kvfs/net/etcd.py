"""A small etcd v3 client for trio, over etcd's gRPC-JSON gateway (HTTP/1.1 + JSON).

The gateway answers on every member's client port (`/v3/kv/range`, `/v3/kv/txn`,
`/v3/lease/...`); keys and values travel base64-encoded and 64-bit numbers as strings.
Each call runs blocking `http.client` in a worker thread with a socket timeout, so
nothing here can hang the event loop. The client keeps the endpoint that answered last
and moves on to the next one on a connection error or a timeout (a dead, frozen or
partitioned member); when every endpoint failed, the call raises `EtcdError`, whose
message names each endpoint and its cause.

`txn` takes the gateway's JSON form of compares and operations; byte strings in them
(keys, values, range ends) are base64-encoded here, so callers write bytes:
`put(key, value)`, `delete(key)` and `create_revision_is(key, n)` build the usual ones.

`watch` streams the changes under a prefix from a revision on (the gateway's
/v3/watch: one HTTP response, chunked, a JSON message a line), read with trio's own
socket so that cancelling it is immediate; a start revision that etcd compacted away
raises `Compacted`.

The leader of a kvfs cluster is the key `leader_key(cluster)`, held by the leader's
lease; its value is JSON {"address": "HOST:PORT", "name": "<cert name>"} and its
create_revision is the leader's epoch (every new leadership creates the key anew, so
epochs only grow).
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator
from urllib.parse import urlsplit

import trio

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 2.0
MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
WATCH_CONNECT_S = 2.0  # a member that does not take a watch this soon is passed over (frozen, partitioned)
_BYTES_FIELDS = {"key", "value", "range_end"}


class EtcdError(Exception):
    """etcd could not be asked: unreachable, too slow, or an answer that makes no sense."""


class Compacted(EtcdError):
    """The revision asked for is older than etcd's history keeps (compacted away)."""

    def __init__(self, message: str, revision: int) -> None:
        super().__init__(message)
        self.revision = revision  # the oldest revision etcd still has (0: not said)


@dataclass(frozen=True, slots=True)
class Event:
    """One key's change, as a watch sees it."""

    key: bytes
    value: bytes | None  # None: the key was deleted
    revision: int  # the change's revision (every change of one txn has the same)


def parse_endpoints(text: str) -> list[str]:
    """"http://h:p,h:p" or "etcd://h:p,h:p" -> ["http://h:p", ...] (etcd:// means plain
    http; a scheme may precede any entry)."""
    endpoints: list[str] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if "://" in item:
            given, _, item = item.partition("://")
            if given not in ("http", "etcd"):
                raise ValueError(f"etcd endpoint {given}://{item}: only http:// (or etcd://) is supported")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint {item!r}: expected HOST:PORT")
        endpoints.append(f"http://{host}:{int(port)}")
    if not endpoints:
        raise ValueError(f"no etcd endpoint in {text!r}")
    return endpoints


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _encode(value: Any) -> Any:
    """The gateway's JSON form of an operation: bytes fields base64-encoded, recursively."""
    if isinstance(value, dict):
        return {k: _b64(v) if k in _BYTES_FIELDS and isinstance(v, (bytes, bytearray)) else _encode(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    return value


def prefix_end(prefix: bytes) -> bytes:
    """The range end that covers every key starting with `prefix`."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


# The usual operations and compares of a txn.
def put(key: bytes, value: bytes, lease: int = 0) -> dict:
    request: dict[str, Any] = {"key": key, "value": value}
    if lease:
        request["lease"] = str(lease)
    return {"request_put": request}


def delete(key: bytes) -> dict:
    return {"request_delete_range": {"key": key}}


def create_revision_is(key: bytes, revision: int) -> dict:
    """True while KEY's create_revision is REVISION (0: the key does not exist)."""
    return {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)}


class EtcdClient:
    """Calls to an etcd cluster through any of its members' gateways (`endpoints`,
    "http://HOST:PORT"); each attempt is bounded by `timeout_s`, and a call tries each
    endpoint at most once."""

    def __init__(self, endpoints: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        self.endpoints = list(endpoints)
        self.timeout_s = timeout_s
        self._current = 0  # the endpoint that answered last
        self._idle: dict[str, list[http.client.HTTPConnection]] = {e: [] for e in self.endpoints}
        self._limiter = trio.CapacityLimiter(16)
        self.calls = 0
        self.failovers = 0
        self.read_revision = 0  # the revision `pages` read at, last

    # -- transport -----------------------------------------------------------

    def _new_connection(self, endpoint: str) -> http.client.HTTPConnection:
        parts = urlsplit(endpoint)
        return http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout_s)

    def _post_blocking(self, endpoint: str, path: str, body: bytes) -> dict:
        """One attempt at one endpoint (in a worker thread). Raises OSError or
        http.client.HTTPException when the endpoint cannot answer, EtcdError for an answer
        that is an error."""
        idle = self._idle[endpoint]
        connection = idle.pop() if idle else None
        if connection is not None:
            try:
                response, data = self._exchange(connection, path, body)
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
                # An idle connection the member closed (it restarted, or timed it out): it never
                # saw the request. Once more on a new connection.
                connection = None
        if connection is None:
            connection = self._new_connection(endpoint)
            response, data = self._exchange(connection, path, body)
        if response.status != 200 or response.will_close:
            connection.close()
        else:
            idle.append(connection)
        try:
            answer = json.loads(data) if data else {}
        except ValueError:
            raise EtcdError(f"etcd {endpoint}{path}: not JSON (HTTP {response.status}): {data[:200]!r}") from None
        # A keepalive answers as a stream: {"result": {...}} (or {"error": {...}}).
        if isinstance(answer, dict) and "result" in answer and len(answer) == 1:
            answer = answer["result"]
        if response.status != 200 or (isinstance(answer, dict) and "error" in answer and "header" not in answer):
            message = answer.get("message") or answer.get("error") if isinstance(answer, dict) else answer
            raise _Refused(f"etcd {endpoint}{path}: HTTP {response.status}: {message}", response.status)
        if not isinstance(answer, dict):
            raise EtcdError(f"etcd {endpoint}{path}: unexpected answer {data[:200]!r}")
        return answer

    @staticmethod
    def _exchange(connection: http.client.HTTPConnection, path: str,
                  body: bytes) -> tuple[http.client.HTTPResponse, bytes]:
        try:
            connection.request("POST", path, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response, response.read()
        except BaseException:
            connection.close()
            raise

    def _call_blocking(self, path: str, request: dict) -> dict:
        body = json.dumps(request).encode()
        causes = []
        for attempt in range(len(self.endpoints)):
            index = (self._current + attempt) % len(self.endpoints)
            endpoint = self.endpoints[index]
            try:
                answer = self._post_blocking(endpoint, path, body)
            except _Refused as refused:
                if 400 <= refused.status < 500:  # a definite answer (a lease not found): the same everywhere
                    raise EtcdError(str(refused)) from None
                # No leader, a timeout inside etcd: another member may do better (a partitioned one answers so).
                causes.append(str(refused))
                continue
            except (OSError, http.client.HTTPException) as error:
                causes.append(f"{endpoint}: {type(error).__name__}: {error or 'timed out'}")
                continue
            if index != self._current:
                self._current = index
                self.failovers += 1
            return answer
        self._current = (self._current + 1) % len(self.endpoints)
        raise EtcdError(f"etcd {path} failed on every endpoint: " + "; ".join(causes))

    async def _call(self, path: str, request: dict) -> dict:
        self.calls += 1
        # The thread's own socket timeouts end it; the trio bound is the backstop.
        with trio.move_on_after(self.timeout_s * len(self.endpoints) + 1.0) as scope:
            return await trio.to_thread.run_sync(self._call_blocking, path, request, abandon_on_cancel=True,
                                                 limiter=self._limiter)
        assert scope.cancelled_caught
        raise EtcdError(f"etcd {path}: no answer from {', '.join(self.endpoints)} in time")

    # -- the API -------------------------------------------------------------

    async def get(self, key: bytes) -> tuple[bytes, int] | None:
        """(value, create_revision) of KEY, or None when it does not exist."""
        answer = await self._call("/v3/kv/range", {"key": _b64(key)})
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        entry = kvs[0]
        return _unb64(entry.get("value", "")), int(entry.get("create_revision", 0))

    async def holder(self, key: bytes) -> tuple[int, int] | None:
        """(create_revision, lease id) of KEY (lease 0: none), or None when it does not exist."""
        answer = await self._call("/v3/kv/range", {"key": _b64(key), "keys_only": True})
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        try:
            return int(kvs[0].get("create_revision", 0)), int(kvs[0].get("lease", 0))
        except (TypeError, ValueError):
            raise EtcdError(f"etcd {key.decode(errors='replace')}: bad revision or lease in {kvs[0]!r}") from None

    async def get_revisions(self, key: bytes) -> tuple[int, int] | None:
        """(KEY's mod_revision, etcd's revision now), or None when KEY does not exist."""
        answer = await self._call("/v3/kv/range", {"key": _b64(key)})
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        return int(kvs[0].get("mod_revision", 0)), int(answer.get("header", {}).get("revision", 0))

    async def get_prefix(self, prefix: bytes, limit: int = 10000) -> AsyncIterator[tuple[bytes, bytes]]:
        """Every (key, value) under PREFIX in key order, LIMIT a page, all pages read at the
        revision of the first (one consistent snapshot)."""
        async for page in self.pages(prefix, limit):
            for entry in page:
                yield entry

    async def pages(self, prefix: bytes, limit: int = 10000,
                    revision: int = 0) -> AsyncIterator[list[tuple[bytes, bytes]]]:
        """`get_prefix`, a page at a time; at REVISION when given (Compacted when etcd no
        longer has it), else at the revision of the first page (`self.read_revision`)."""
        end = _b64(prefix_end(prefix))
        start = prefix
        while True:
            request: dict[str, Any] = {"key": _b64(start), "range_end": end, "limit": str(limit)}
            if revision:
                request["revision"] = str(revision)
            try:
                answer = await self._call("/v3/kv/range", request)
            except EtcdError as error:
                if "compacted" in str(error):
                    raise Compacted(f"etcd range at revision {revision}: {error}", 0) from None
                raise
            if not revision:
                revision = int(answer.get("header", {}).get("revision", 0))
            self.read_revision = revision
            kvs = answer.get("kvs") or []
            yield [(_unb64(entry["key"]), _unb64(entry.get("value", ""))) for entry in kvs]
            if not answer.get("more") or not kvs:
                return
            start = _unb64(kvs[-1]["key"]) + b"\0"

    async def grant(self, ttl_s: int) -> int:
        answer = await self._call("/v3/lease/grant", {"TTL": str(ttl_s)})
        try:
            return int(answer["ID"])
        except (KeyError, ValueError):
            raise EtcdError(f"etcd lease grant: no lease id in {answer!r}") from None

    async def keepalive(self, lease: int) -> int:
        """Renews LEASE; its remaining TTL in seconds (0: it expired or was revoked)."""
        answer = await self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(answer.get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        try:
            await self._call("/v3/lease/revoke", {"ID": str(lease)})
        except EtcdError as error:
            if "not found" not in str(error):  # expired already: nothing to revoke
                raise

    async def txn(self, compare: list[dict], success: list[dict],
                  failure: list[dict] = []) -> tuple[bool, int, dict]:  # noqa: B006 (never mutated)
        """(whether COMPARE held and SUCCESS ran, the header's revision, the raw answer)."""
        answer = await self._call("/v3/kv/txn", {"compare": _encode(compare), "success": _encode(success),
                                                 "failure": _encode(failure)})
        return bool(answer.get("succeeded", False)), int(answer.get("header", {}).get("revision", 0)), answer

    async def compact(self, revision: int) -> None:
        """Drops etcd's history before REVISION (every write keeps the key's old value until
        then, and the database has a quota). One compacted already is no error."""
        try:
            await self._call("/v3/kv/compaction", {"revision": str(revision)})
        except EtcdError as error:
            if "compacted" not in str(error):
                raise

    async def watch(self, prefix: bytes, start_revision: int) -> AsyncIterator[list[Event]]:
        """Every change under PREFIX from START_REVISION on, in revision order, as etcd
        sends them (each list holds whole txns). Runs until cancelled; raises Compacted
        when START_REVISION is gone from etcd's history, EtcdError when no member takes the
        watch or the stream breaks (watch again from the revision after the last seen)."""
        body = json.dumps({"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                              "start_revision": str(start_revision)}}).encode()
        causes = []
        for attempt in range(len(self.endpoints)):
            endpoint = self.endpoints[(self._current + attempt) % len(self.endpoints)]
            parts = urlsplit(endpoint)
            try:
                with trio.fail_after(min(self.timeout_s, WATCH_CONNECT_S)):
                    stream = await trio.open_tcp_stream(parts.hostname, parts.port)
                    reader = _ChunkedReader(stream)
                    try:
                        await stream.send_all(b"POST /v3/watch HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json"
                                              b"\r\nContent-Length: %d\r\n\r\n%s"
                                              % (parts.netloc.encode(), len(body), body))
                        await reader.headers()
                    except BaseException:
                        await trio.aclose_forcefully(stream)
                        raise
            except (OSError, trio.TooSlowError, trio.BrokenResourceError, EtcdError) as error:
                causes.append(f"{endpoint}: {type(error).__name__}: {error or 'timed out'}")
                continue
            break
        else:
            raise EtcdError("etcd /v3/watch failed on every endpoint: " + "; ".join(causes))
        try:
            async for line in reader.lines():
                yield _watch_events(endpoint, line)
        except trio.BrokenResourceError as error:
            raise EtcdError(f"etcd {endpoint}/v3/watch: {error}") from None
        finally:
            await trio.aclose_forcefully(stream)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()


class _Refused(EtcdError):
    """A member answered with an error (HTTP status or a gateway error body)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _ChunkedReader:
    """The gateway's streamed answer: an HTTP/1.1 response with a chunked body."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = bytearray()

    async def _more(self) -> None:
        data = await self.stream.receive_some(1 << 16)
        if not data:
            raise EtcdError("the watch stream was closed")
        self.buffer += data

    async def _line(self) -> bytes:
        while (at := self.buffer.find(b"\r\n")) < 0:
            if len(self.buffer) > 1 << 16:
                raise EtcdError("a line of the watch stream is too long")
            await self._more()
        line = bytes(self.buffer[:at])
        del self.buffer[:at + 2]
        return line

    async def headers(self) -> None:
        status = await self._line()
        chunked = False
        while line := await self._line():
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        if not status.startswith(b"HTTP/1.1 200") or not chunked:
            raise EtcdError(f"the watch was refused: {status[:200]!r}")

    async def lines(self) -> AsyncIterator[bytes]:
        """The body's newline-separated messages."""
        pending = b""
        while True:
            size_line = await self._line()
            try:
                size = int(size_line.split(b";")[0], 16)
            except ValueError:
                raise EtcdError(f"the watch stream is not chunked HTTP: {size_line[:100]!r}") from None
            if size == 0:
                raise EtcdError("the watch stream ended")
            while len(self.buffer) < size + 2:
                await self._more()
            pending += bytes(self.buffer[:size])
            del self.buffer[:size + 2]
            *messages, pending = pending.split(b"\n")
            for message in messages:
                if message.strip():
                    yield message


def _watch_events(endpoint: str, line: bytes) -> list[Event]:
    """One message of a watch: its events; Compacted or EtcdError when the watch ended."""
    try:
        message = json.loads(line)
        result = message.get("result", message)
        if "error" in message and "result" not in message:
            raise EtcdError(f"etcd {endpoint}/v3/watch: {message.get('message') or message['error']}")
        if result.get("canceled"):
            compacted = int(result.get("compact_revision", 0))
            if compacted:
                raise Compacted(f"etcd {endpoint}/v3/watch: compacted to revision {compacted}", compacted)
            raise EtcdError(f"etcd {endpoint}/v3/watch: canceled: {result.get('cancel_reason', '')}")
        return [Event(_unb64(event["kv"]["key"]),
                      None if event.get("type") == "DELETE" else _unb64(event["kv"].get("value", "")),
                      int(event["kv"]["mod_revision"])) for event in result.get("events") or ()]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise EtcdError(f"etcd {endpoint}/v3/watch: bad message {line[:200]!r}: {error}") from None


def leader_key(cluster: str) -> bytes:
    return f"/kvfs/{cluster}/leader".encode()


def leader_value(address: str, name: str) -> bytes:
    return json.dumps({"address": address, "name": name}).encode()


async def find_leader(client: EtcdClient, cluster: str) -> tuple[str, int] | None:
    """(the leader's HOST:PORT, its epoch), or None while no master leads."""
    found = await client.get(leader_key(cluster))
    if found is None:
        return None
    value, epoch = found
    try:
        address = json.loads(value)["address"]
    except (ValueError, KeyError, TypeError):
        raise EtcdError(f"etcd {leader_key(cluster).decode()}: not a leader record: {value[:200]!r}") from None
    if not isinstance(address, str):
        raise EtcdError(f"etcd {leader_key(cluster).decode()}: bad address {address!r}")
    return address, epoch


__all__ = ["Compacted", "EtcdClient", "EtcdError", "Event", "MAX_TXN_OPS", "create_revision_is", "delete", "find_leader", "leader_key",
           "leader_value", "parse_endpoints", "prefix_end", "put"]
