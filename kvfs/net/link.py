"""A node's connection to the master: connect, register, reconnect after a failure.

Every request is bounded by the link's wait (`--master-wait`), whatever the master
does: while the link is down a request waits for it, but never past the wait since the
master was last heard, so a master restart of a few seconds is invisible to writers and a
master gone for longer fails every request at once with EIO. A master that stops
answering without closing the connection (frozen, or behind a silent partition) fails the
request that waited the whole budget and the connection is replaced. A request in flight
when the connection broke fails with EIO (it may or may not have been applied, and only
the node's re-registration, which reports everything it holds, settles that).

With `etcd://H:P[,H:P][/CLUSTER]` the master is whoever etcd says leads CLUSTER: every
(re)connection first asks etcd for the leader's address and epoch, and the link follows
changes (it polls etcd while connected and leaves a master that is no longer the leader).
A master whose Welcome carries an epoch lower than the highest this node has seen is a
deposed leader that has not noticed yet (a frozen process resumed): it is refused and
the leader is looked up again. etcd unreachable counts as the master unreachable: the
same bounded waits, then EIO, while files held here are still read.
"""

from __future__ import annotations

import errno
import logging
from typing import Any, Awaitable, Callable

import trio

from kvfs import progress
from kvfs.wire import messages as m
from kvfs.wire.auth import AuthError
from kvfs.wire.protocol import ProtocolError
from kvfs.net.rpc import MasterUnavailable, RemoteMaster
from kvfs.config import MasterTarget, parse_master, split_address
from kvfs.net.etcd import EtcdClient, EtcdError, find_leader, parse_endpoints
from kvfs.errors import KvfsError, reason_of
from kvfs.histogram import OperationStats
from kvfs.security.credentials import Tls

log = logging.getLogger(__name__)

RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 1.0
CONNECT_TIMEOUT_S = 5.0  # a connection attempt (TCP and handshake); SYNs into a partition are not waited out
WARN_EVERY_S = 5.0  # an unreachable master is reported this often, not at every retry
FOLLOW_S = 0.5  # how often a connected node asks etcd who leads (a frozen leader is left this soon)
ETCD_MEMBER_TIMEOUT_S = 1.0  # one etcd member's answer; a frozen one is passed over for the next this soon


class Stale(Exception):
    """The master reached is not (or no longer) the leader: look it up again."""


class MasterLink:
    """A `MasterClient` that survives master restarts.

    `join(remote)` runs on every new connection before any other request is let
    through: the node registers and reports what it holds."""

    def __init__(self, address: str, tls: Tls, join: Callable[[RemoteMaster], Awaitable[None]],
                 wait_s: float = 10.0, on_notify: Callable[[m.NameChanges], None] | None = None) -> None:
        self.target: MasterTarget = parse_master(address)
        self.etcd = (EtcdClient(parse_endpoints(self.target.etcd_url), timeout_s=ETCD_MEMBER_TIMEOUT_S)
                     if self.target.etcd else None)
        self.address = address  # what the node was configured with; `leader` is where it connects
        self.leader = self.target.address or ""
        self.epoch = 0  # the highest leader epoch seen, from etcd or a master's Welcome
        self.refused_stale = 0  # masters refused for an epoch below `epoch` (deposed leaders)
        self.tls = tls
        self.join = join
        self.on_notify = on_notify
        self.wait_s = wait_s
        self._remote: RemoteMaster | None = None
        self._up = trio.Event()
        self._heard_at = trio.current_time()  # when the master last answered (on any connection)
        self._warned_at = -WARN_EVERY_S  # trio time of the last warning
        self._why = ""  # why the last connection attempt failed, for the requests that fail meanwhile
        self.calls = OperationStats()  # requests by type: round trip to the master

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keeps the link up; reports started after the first successful registration."""
        delay = RECONNECT_MIN_S
        started = False
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    remote = await self._connect_and_join(nursery, first=not started)
                    if remote is None:
                        await trio.sleep(delay)
                        delay = min(RECONNECT_MAX_S, delay * 2)
                        continue
                    self._remote = remote
                    self._why = ""
                    delay = RECONNECT_MIN_S
                    self._warned_at = -WARN_EVERY_S
                    self._up.set()
                    log.info("%s to master %s%s", "reconnected" if started else "connected", self.leader,
                             self._epoch_text())
                    if not started:
                        started = True
                        task_status.started()
                    async with trio.open_nursery() as following:
                        if self.etcd is not None:
                            following.start_soon(self._follow, remote)
                        await remote.closed.wait()
                        following.cancel_scope.cancel()
                    self._up = trio.Event()
                    self._remote = None
                    self._heard_at = remote.heard_at
                    log.warning("lost the connection to master %s: %s", self.leader, remote.broken)
        finally:
            if self.etcd is not None:
                await self.etcd.aclose()

    def _epoch_text(self) -> str:
        return f" (leader of {self.target.cluster}, epoch {self.epoch})" if self.etcd is not None else ""

    async def _locate(self) -> tuple[str, int]:
        """The master to connect to: the fixed address, or the leader etcd names now. Raises
        Stale when etcd names none, EtcdError/OSError when etcd cannot be asked."""
        if self.etcd is None:
            return split_address(self.leader)
        found = await find_leader(self.etcd, self.target.cluster)  # bounded by the client's timeouts
        if found is None:
            raise Stale(f"etcd {self.target.etcd_url} names no leader of cluster {self.target.cluster!r}")
        address, epoch = found
        if epoch < self.epoch:  # a lagging member's answer: never go back to a deposed leader
            raise Stale(f"etcd names {address} with epoch {epoch}, older than epoch {self.epoch} seen already")
        if (address, epoch) != (self.leader, self.epoch):
            log.info("etcd: the leader of cluster %s is %s, epoch %d", self.target.cluster, address, epoch)
        self.leader, self.epoch = address, epoch
        return split_address(address)

    def _admit(self, remote: RemoteMaster) -> None:
        """Refuses a master whose Welcome epoch is below the highest seen: a leader that lost
        its lease (a frozen process that resumed) must not be used, whatever it believes."""
        epoch = remote.epoch
        if epoch < self.epoch:
            self.refused_stale += 1
            log.warning("refused master %s: its epoch %d is below epoch %d of the current leader (a deposed "
                        "leader); looking the leader up again", self.leader, epoch, self.epoch)
            raise Stale(f"master {self.leader} has epoch {epoch}, below {self.epoch}")
        self.epoch = epoch

    async def _follow(self, remote: RemoteMaster) -> None:
        """While connected: leaves the master once etcd names another leader or a newer
        epoch (a frozen leader's connection would otherwise be held until a request times
        out). etcd unreachable changes nothing here: the master answers or it does not."""
        assert self.etcd is not None
        while True:
            await trio.sleep(FOLLOW_S)
            try:
                found = await find_leader(self.etcd, self.target.cluster)
            except (EtcdError, OSError) as error:
                log.debug("etcd: cannot look up the leader: %s", reason_of(error))
                continue
            if found is None or found[1] <= self.epoch:
                continue  # none elected yet (the master may be ours, stepping down), or no change
            log.warning("etcd: the leader of cluster %s is now %s (epoch %d); leaving master %s (epoch %d)",
                        self.target.cluster, found[0], found[1], self.leader, self.epoch)
            await remote.aclose()
            return

    async def _connect_and_join(self, nursery: trio.Nursery, first: bool) -> RemoteMaster | None:
        """A registered connection, or None (logged) to try again later."""
        remote = None
        where = f"cluster {self.target.cluster} in etcd" if self.etcd is not None else f"master {self.leader}"
        try:
            host, port = await self._locate()
            where = f"master {self.leader}"
            with trio.fail_after(CONNECT_TIMEOUT_S):
                remote = await RemoteMaster.connect(host, port, self.tls, nursery,
                                                    on_notify=self.on_notify, request_timeout_s=self.wait_s)
            self._admit(remote)
            await self.join(remote)  # each request bounded by the link's wait
            if remote.broken is None:
                return remote
            error: BaseException = remote.broken
        except (AuthError, ProtocolError) as refused:
            if first:  # a wrong certificate or an incompatible master: say so rather than retry forever
                raise KvfsError(errno.EACCES, f"cannot authenticate with master {self.leader} (are both "
                                              f"certificates issued by the same cluster CA?): {refused}") from None
            error = refused
        except (OSError, EOFError, trio.BrokenResourceError, trio.TooSlowError, KvfsError, EtcdError,
                Stale) as failed:
            if first and isinstance(failed, KvfsError) and failed.errno == errno.EPERM:
                # Its certificate does not allow this registration (another name, an address it
                # does not list): retrying cannot help.
                if remote is not None:
                    await remote.aclose()
                raise KvfsError(errno.EPERM, f"master {self.leader} refused this node: {failed}") from None
            error = failed
        self._why = reason_of(error)
        if trio.current_time() - self._warned_at >= WARN_EVERY_S:
            self._warned_at = trio.current_time()
            message = f"{where}: cannot register ({reason_of(error)}); retrying"
            if first:  # the node is still starting: tell the terminal and systemd too
                progress.report(message, log, logging.WARNING)
            else:
                log.warning("%s", message)
        if remote is not None:
            await remote.aclose()
        return None

    @property
    def connected(self) -> bool:
        """Connected to the master and registered (on a connection not known to be broken)."""
        return self._up.is_set() and self._remote is not None and self._remote.broken is None

    async def reconnect(self) -> None:
        """Drops the connection (the master no longer knows this node): register again."""
        if self._remote is not None:
            await self._remote.aclose()

    async def call(self, request: m.Request, wait_s: float | None = None) -> Any:
        """The master's answer within the link's wait, or MasterUnavailable (EIO). While the
        link is down the request waits for it up to `wait_s` (default: the link's wait; 0 for
        callers with an answer of their own), and never past the link's wait since the master
        was last heard: a node cut off for longer fails at once."""
        started = trio.current_time()
        link_wait = self.wait_s if wait_s is None else wait_s
        while not self.connected:
            heard_at = self._remote.heard_at if self._remote is not None else self._heard_at
            until = min(started + link_wait, heard_at + self.wait_s)
            if trio.current_time() >= until:
                why = f"; {self._why}" if self._why else ""
                raise MasterUnavailable(f"master {self.leader or self.address} is unreachable (last heard "
                                        f"{trio.current_time() - heard_at:.1f} s ago{why})")
            with trio.move_on_at(until):
                if self._up.is_set():  # broken, and the run loop has yet to see it
                    await trio.sleep(0.01)
                else:
                    await self._up.wait()
        assert self._remote is not None
        left = started + self.wait_s - trio.current_time()
        return await self.calls.measure(type(request).__name__, self._remote.call(request, timeout_s=left))
