"""`kvfs master --etcd`: masters that elect a leader through etcd, the state in etcd.

A master stands by until it wins the campaign: a txn that creates the leader key
(kvfs.net.etcd.leader_key) only if it does not exist, held by a lease of the master's
own (--lease-ttl). The key's create_revision is the leadership's epoch. While it stands
by, a master keeps a hot copy of the state (kvfs.net.follow: loaded once, then every
commit of the leader applied as it lands), so that once elected it only catches up
from the last revision it saw; without a copy (still loading, or it fell behind) it
loads the state from etcd. The leader then listens, renews its lease every TTL/12 and
serves; every reply waits until the changes it may show are committed (group commit,
kvfs.net.commit), and every commit is fenced on the epoch (kvfs.net.etcdstate).

A leader steps down at once, closing every connection and dropping its state, when it
may no longer act (kvfs.cluster.election: no renewal for TTL minus a margin, as after a
freeze or with etcd's quorum lost), when etcd says its lease is gone, or when a write is
fenced. It then revokes its lease (so nobody waits out the TTL) and stands by again. A
standby polls the leader key; when the key goes (the leader's lease ended), it campaigns.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

import trio

from kvfs import systemd
from kvfs.cluster.election import Leadership, renew_interval
from kvfs.config import split_address
from kvfs.daemons.master import (MasterConfig, expire_forever, keep_heap_out_of_full_collections, new_service,
                                 owner_finder, until_stopped)
from kvfs.histogram import OperationStats
from kvfs.metrics.exporter import serve_metrics
from kvfs.metrics.families import Families
from kvfs.metrics.master import MasterMetrics, describe_election
from kvfs.net.commit import GroupCommit
from kvfs.net.etcd import EtcdClient, EtcdError, create_revision_is, leader_key, leader_value, put
from kvfs.net.etcdstate import Batch, EtcdState, Fenced
from kvfs.net.follow import Follower, NotCaughtUp
from kvfs.net.rpc import MetadataServer
from kvfs.progress import Every
from kvfs.wire import messages as m

log = logging.getLogger("kvfs.master")

POLL_S = 0.2  # how often a standby looks at the leader key
COMPACT_S = 60.0  # the leader drops etcd's history older than this, every this often
RETRY_S = 0.1  # a commit that failed (etcd unreachable) is tried again this soon, while the lease holds
CATCH_UP_S = 5.0  # an elected standby's copy must reach the epoch's revision this soon, else it loads
LOAD_TIMEOUT_S = 10.0  # a page of a load (10,000 records) may take this long: loads do not hold the lease


async def compact_forever(client: EtcdClient, revision: Callable[[], int], interval_s: float = COMPACT_S) -> None:
    """Every commit leaves the keys' old values in etcd's history until it is compacted;
    without that the database reaches its quota and refuses every write. Each pass drops
    the history before the revision the previous pass saw (`revision()`: the last
    commit's), so what the last INTERVAL_S wrote stays for the standbys' watches."""
    previous = 0
    while True:
        await trio.sleep(interval_s)
        if previous:
            try:
                await client.compact(previous)
            except EtcdError as error:  # the next pass tries again
                log.warning("compacting etcd's history to revision %d failed: %s", previous, error)
        previous = revision()


class Term:
    """One leadership: the service loaded from etcd, its server and its timers."""

    def __init__(self, master: "ElectedMaster", leadership: Leadership, follower: Follower | None) -> None:
        self.master = master
        self.config = master.config
        self.leadership = leadership
        self.follower = follower  # the standby's copy of the state, if it kept one
        self.service = new_service(self.config)  # replaced by the copy, or loaded, in `run`
        self.state = EtcdState(master.client, self.config.cluster)
        self.requests = master.requests
        self.group = GroupCommit(lambda: self.state.take(self.service), self._write)
        self.server = self._server()
        self.caught_up = -1  # records the copy applied at the election (-1: the state was loaded)
        self.ended = ""  # why the term ended
        self.serving = False
        self._connections: set[trio.CancelScope] = set()  # each served connection's, cancelled at the end
        self._scope = trio.CancelScope()
        self._retry_log = Every(5.0)
        self._renew_log = Every(5.0)

    def _server(self) -> MetadataServer:
        return MetadataServer(self.handle, self.config.tls, self.service, owner_of=owner_finder(self.service),
                              group=self.group, may_act=self.may_act, epoch=lambda: self.leadership.epoch,
                              temp_suffix=self.service.settings.temp_suffix)

    def may_act(self) -> bool:
        return self.leadership.may_act(time.monotonic())

    def end(self, reason: str) -> None:
        if not self.ended:
            self.ended = reason
        self.serving = False
        self._scope.cancel()
        for scope in self._connections:
            scope.cancel()

    def handle(self, request: m.Request, caller: int) -> Any:
        return self.requests.timed(type(request).__name__, lambda: self.service.handle(request, caller))

    async def _write(self, batch: Batch) -> None:
        """Commits a batch, or ends the term (and never returns)."""
        failures = 0
        while True:
            why = self.leadership.why_not(time.monotonic())
            if why:
                self.end(f"may no longer lead: {why}")
                break
            try:
                await self.state.commit(batch, self.leadership.epoch)
            except Fenced as fenced:
                self.leadership.lose(str(fenced))
                self.end(str(fenced))
                break
            except EtcdError as error:
                failures += 1
                if self._retry_log.due():
                    log.warning("committing to etcd failed (%d tries so far, replies wait): %s", failures, error)
                await trio.sleep(RETRY_S)
                continue
            if failures:
                log.warning("committed to etcd again after %d failed tries", failures)
            return
        await trio.sleep_forever()  # cancelled: the term is over

    async def _renew_forever(self) -> None:
        """A keepalive every TTL/12, each in a task of its own: one stuck on a frozen etcd
        member does not hold back the next."""
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(renew_interval(self.leadership.ttl_s))
                nursery.start_soon(self._renew_once)

    async def _renew_once(self) -> None:
        sent = time.monotonic()
        try:
            ttl = await self.master.client.keepalive(self.leadership.lease)
        except EtcdError as error:
            if self._renew_log.due():
                log.warning("renewing the leader lease failed: %s", error)
            return
        self.leadership.renewed(sent, ttl)
        if self.leadership.lost:
            self.end(self.leadership.lost)

    async def _watch(self) -> None:
        """Ends the term as soon as the leader may no longer act."""
        while True:
            why = self.leadership.why_not(time.monotonic())
            if why:
                self.end(f"may no longer lead: {why}")
                return
            await trio.sleep(0.05)

    async def serve(self, stream: trio.SocketStream) -> bool:
        """Serves a new connection until it closes or the term ends (False: not serving)."""
        if not self.serving or not self.may_act():
            return False
        with trio.CancelScope() as scope:
            self._connections.add(scope)
            try:
                await self.server.serve_stream(stream)
            finally:
                self._connections.discard(scope)
        return True

    async def run(self, address: str) -> None:
        """Loads, then serves the connections `accept` hands it until the term ends (`ended`
        says why). The lease is renewed from the start: a long load does not lose it."""
        with self._scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch)
                nursery.start_soon(self._renew_forever)
                await self._take_over_or_load()
                nursery.start_soon(self.group.run)
                nursery.start_soon(compact_forever, self.master.client, lambda: self.state.revision)
                nursery.start_soon(expire_forever, self.service, self.server, self.config,
                                   lambda cause: self.group.ticket())
                self.serving = True
                log.info("master leading (epoch %d) as %s", self.leadership.epoch, address)
                systemd.notify(f"STATUS=leading (epoch {self.leadership.epoch}) as {address}")
                await trio.sleep_forever()
        self.end(self.ended or "stopped")

    async def _take_over_or_load(self) -> None:
        """The standby's copy, caught up to the epoch; else the state loaded from etcd."""
        started = time.monotonic()
        follower, self.follower = self.follower, None
        if follower is not None:
            try:
                self.service, self.caught_up = await follower.catch_up(self.leadership.epoch, CATCH_UP_S)
            except NotCaughtUp as why:
                (log.warning if follower.loads else log.info)(
                    "the standby's copy of the state cannot be used (loading it instead): %s", why)
        if self.caught_up >= 0:
            self.service.liveness.last_pass = time.monotonic()  # standing by was no stall of this leader's
            self.state.adopt(self.service)
            self.server = self._server()
            log.info("took over the standby's copy: %d files, %d nodes; caught up %d records at the election in "
                     "%.3f s, %d followed before it (epoch %d)", self.service.ns.files,
                     len(self.service.registry.nodes), self.caught_up, time.monotonic() - started,
                     follower.applied - self.caught_up if follower is not None else 0, self.leadership.epoch)
            self.master.caught_up = self.caught_up
            return
        self.master.caught_up = -1
        try:
            files = await EtcdState(self.master.reader, self.config.cluster).load(self.service)
            self.state.adopt(self.service)
        except EtcdError as error:
            self.end(f"loading the state from etcd failed: {error}")
            await trio.sleep_forever()
        keep_heap_out_of_full_collections(self.service, -1)
        self.service.liveness.last_pass = time.monotonic()  # the load was no stall between expiry passes
        log.info("loaded %d files, %d nodes from etcd in %.2f s (epoch %d)", files,
                 len(self.service.registry.nodes), time.monotonic() - started, self.leadership.epoch)


class ElectedMaster:
    def __init__(self, config: MasterConfig) -> None:
        assert config.etcd is not None
        self.config = config
        self.client = EtcdClient(config.etcd, timeout_s=min(2.0, max(0.5, config.lease_ttl_s / 3)))
        # Loads and the standby's watch: large reads that are slow on a busy etcd, and that no
        # renewal waits for (a renewal must fail fast and move on to the next member).
        self.reader = EtcdClient(config.etcd, timeout_s=LOAD_TIMEOUT_S)
        self.key = leader_key(config.cluster)
        self.requests = OperationStats()
        self.terms = 0
        self.leadership: Leadership | None = None
        self.term: Term | None = None
        self.address = ""  # what the leader key names: --advertise, or the bound --listen
        self.turned_away = 0  # connections closed at once: this master was not leading
        self.follower: Follower | None = None  # the copy of the state kept while standing by
        self.caught_up = -1  # records the copy applied at the latest election (-1: the state was loaded)
        self._etcd_log = Every(10.0)

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        host, port = split_address(self.config.listen)
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()[1]
        self.address = self.config.advertise or f"{host}:{bound}"
        log.info("master listening on %s:%d", host, bound)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trio.serve_listeners, self._dispatch, listeners)
                nursery.start_soon(self._lead_or_stand_by)
                nursery.start_soon(systemd.keep_watchdog_fed)
                if self.config.metrics_listen is not None:  # for the master's whole life: leading or not
                    await nursery.start(serve_metrics, self.config.metrics_listen, self._describe)
                await until_stopped(task_status.started, "standing by")
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._resign()
                await self.client.aclose()
                await self.reader.aclose()

    def _describe(self, out: Families) -> None:
        term = self.term
        leading = term is not None and term.serving
        describe_election(out, term.leadership.epoch if term is not None and leading else 0, self.follower,
                          self.caught_up)
        if term is not None and leading:
            MasterMetrics(term.service, self.requests, term.server).describe(out)

    async def _dispatch(self, stream: trio.SocketStream) -> None:
        """A new connection: served by the leading term, else closed at once (a standby, or a
        leader that lost its lease, answers nothing)."""
        term = self.term
        if term is not None and await term.serve(stream):
            return
        self.turned_away += 1
        await stream.aclose()

    async def _lead_or_stand_by(self) -> None:
        log.info("master standing by: etcd %s, cluster %s, lease TTL %d s", ",".join(self.config.etcd or []),
                 self.config.cluster, self.config.lease_ttl_s)
        while True:
            follower = self.follower = Follower(self.reader, self.config.cluster, lambda: new_service(self.config),
                                                loaded=lambda service: keep_heap_out_of_full_collections(service, -1))
            async with trio.open_nursery() as nursery:
                nursery.start_soon(follower.run)  # until the term takes the copy over (or this ends)
                leadership = await self._campaign()
                self.follower = None
                self.leadership = leadership
                self.terms += 1
                term = self.term = Term(self, leadership, follower)
                try:
                    await term.run(self.address)
                except Exception:  # a bug in a leadership's task: this master steps down, it does not exit
                    log.exception("the leadership (epoch %d) failed", leadership.epoch)
                    term.end("a task of the leadership failed")
                finally:
                    self.term = None
                    follower.stop()
            log.error("master stepped down (epoch %d): %s; its connections are closed, its state dropped; "
                      "standing by", leadership.epoch, term.ended)
            systemd.notify("STATUS=standing by")
            await self._resign()

    async def _campaign(self) -> Leadership:
        """Waits until this master wins the leader key."""
        announced: tuple[str, int] | None = None
        while True:
            try:
                found = await self.client.get(self.key)
                if found is None:
                    won = await self._try_to_lead()
                    if won is not None:
                        return won
                else:
                    leader = (json.loads(found[0]).get("address", "?"), found[1])
                    if leader != announced:
                        log.info("master standing by: %s leads (epoch %d)", *leader)
                        announced = leader
            except EtcdError as error:
                if self._etcd_log.due():
                    log.warning("standing by, etcd unreachable: %s", error)
            except ValueError as error:  # a leader value that is not JSON: someone else's key
                if self._etcd_log.due():
                    log.warning("standing by: %s holds %r", self.key.decode(), error)
            await trio.sleep(POLL_S)

    async def _try_to_lead(self) -> Leadership | None:
        sent = time.monotonic()
        lease = await self.client.grant(self.config.lease_ttl_s)
        address = self.address
        try:
            won, epoch, _ = await self.client.txn([create_revision_is(self.key, 0)],
                                                  [put(self.key, leader_value(address, self.config.tls.identity.name),
                                                       lease)])
        except EtcdError:
            await self._revoke(lease)
            raise
        if not won:
            await self._revoke(lease)
            return None
        return Leadership(lease=lease, epoch=epoch, ttl_s=float(self.config.lease_ttl_s), renewed_at=sent)

    async def _revoke(self, lease: int) -> None:
        try:
            await self.client.revoke(lease)
        except EtcdError as error:  # it expires by itself
            log.warning("revoking lease %x failed (it expires within its TTL): %s", lease, error)

    async def _resign(self) -> None:
        """Gives up the lease of the last leadership (the standbys need not wait out its TTL)."""
        leadership, self.leadership = self.leadership, None
        if leadership is not None:
            leadership.lose("resigned")
            with trio.move_on_after(2.0):
                await self._revoke(leadership.lease)
