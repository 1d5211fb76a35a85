"""The embedded master: the metadata service called in-process.

`EmbeddedMaster` is a single-node mount's master. `EmbeddedCluster` shares one service
between several nodes in one process (the in-process tests): each node's client
(`EmbeddedMember`) speaks for the node that registered through it, as the master's server
does for a node's connection, and name changes for watched directories are pushed to the
nodes that watch them.
"""

from __future__ import annotations

import errno
from typing import Any, Callable, Protocol

import msgspec

from kvfs.cluster.master import MetadataService
from kvfs.errors import MetadataError
from kvfs.wire import messages as m
from kvfs.wire.messages import Request
from kvfs.histogram import OperationStats


class MasterClient(Protocol):
    """How a node talks to the master, in-process or (later) over the network."""

    async def call(self, request: Request, wait_s: float | None = None) -> Any:
        """Sends one request, returns its response or raises MetadataError. A remote client
        waits up to `wait_s` (None: its default) for an unreachable master."""


class DirectorySaver(Protocol):
    """Saves the directories a request changed (kvfs.node.dirrecords)."""

    def note(self, request: Request, dirty: set[int]) -> bool:
        """Takes the changes among the inodes the request changed; True if any wait to be saved."""

    async def save(self) -> None: ...


class EmbeddedMaster:
    """The single-node mount's master: nothing saves its state, so what each request changed
    is forgotten at once (the dirty sets would otherwise grow with every file ever made).
    With an SSD tier, its directories are the exception: `directories` saves those a request
    changed, before the request is answered or, for a mkdir, just after (kvfs.node.dirrecords)."""

    def __init__(self, service: MetadataService) -> None:
        self.service = service
        self.calls = OperationStats()  # by request type: the master's part of each operation
        self.directories: DirectorySaver | None = None

    async def call(self, request: Request, wait_s: float | None = None) -> Any:
        saving = False
        try:
            answer = self.calls.timed(type(request).__name__, lambda: self.service.handle(request))
        finally:
            if self.directories is not None:
                saving = self.directories.note(request, self.service.ns.dirty)
            self.service.ns.dirty.clear()
            self.service.objects.dirty.clear()
        if saving:
            await self.directories.save()  # type: ignore[union-attr]
        return answer


Notify = Callable[[m.NameChanges], None]


class EmbeddedCluster:
    """One metadata service and the in-process clients of the nodes that share it.

    Like the master's server, it pushes the name changes queued for each node after every
    request and expiry pass: `wake()` runs then, and `push()` delivers them. By default
    `wake` pushes at once; a caller with an event loop sets it to schedule `push()`, so
    that a push follows the reply, as it does over the network."""

    def __init__(self, service: MetadataService) -> None:
        self.service = service
        self.members: dict[int, EmbeddedMember] = {}  # by the node id each registered as
        self.wake: Callable[[], None] = self.push
        self.pushed = 0  # NameChanges messages delivered

    def connect(self, on_notify: Notify | None = None) -> EmbeddedMember:
        """A new client, speaking for no node until a Register through it succeeds."""
        return EmbeddedMember(self, on_notify)

    def expire_nodes(self) -> list[int]:
        """One expiry pass of the master's timer: nodes silent too long are declared dead."""
        dead = self.service.expire_nodes()
        self.wake()
        return dead

    def push(self) -> None:
        """Delivers the name changes queued for each node to its client's `on_notify`."""
        waiting, self.service.notify = self.service.notify, set()
        for node_id in sorted(waiting):
            changes = self.service.take_notifications(node_id)
            member = self.members.get(node_id)
            if changes and member is not None and member.on_notify is not None:
                member.on_notify(m.NameChanges(changes))
                self.pushed += 1


class EmbeddedMember:
    """One node's `MasterClient` of an `EmbeddedCluster`. Requests and responses pass
    through msgpack as they would over the wire: the node and the service never share an
    object, and a field the wire cannot carry fails the request (EINVAL) as it would in
    the node's remote client."""

    def __init__(self, cluster: EmbeddedCluster, on_notify: Notify | None) -> None:
        self.cluster = cluster
        self.on_notify = on_notify
        self.caller = 0  # the node this client speaks for: 0 until it registers
        self.calls = OperationStats()

    async def call(self, request: Request, wait_s: float | None = None) -> Any:
        name = type(request).__name__
        return self.calls.timed(name, lambda: self._handle(request))

    def _handle(self, request: Request) -> Any:
        try:
            request = msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=type(request))
        except (OverflowError, TypeError, ValueError, msgspec.EncodeError, msgspec.ValidationError) as error:
            raise MetadataError(errno.EINVAL, f"{type(request).__name__}: a field the protocol cannot carry "
                                              f"({error})") from None
        try:
            response = self.cluster.service.handle(request, self.caller)
        finally:
            self.cluster.wake()
        if isinstance(response, m.Registered):  # this client now speaks for that node
            self.caller = response.node
            self.cluster.members[response.node] = self
        return msgspec.msgpack.decode(msgspec.msgpack.encode(response), type=type(response))
