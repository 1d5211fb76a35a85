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

A leader whose renewals go unanswered until its deadline (kvfs.cluster.election: TTL
minus a margin after the last renewal sent; etcd electing a leader of its own, or
unreachable) *pauses*: it answers nothing and writes nothing, but keeps its state. A
renewal answered later, with the leader key still holding its lease and epoch, resumes
it at the same epoch, without a load: no other master can have led while its key
existed. A leader steps down, closing every connection and dropping its state, when its
pause outlasts the limit (three TTLs: etcd's quorum lost, or this master cut off from it),
when etcd says its lease is gone or the key is another's, or when a write is fenced. It
then revokes its lease (so nobody waits out the TTL) and stands by again. A standby
polls the leader key; when the key goes (the leader's lease ended), it campaigns.
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
from kvfs.daemons.heap import keep_heap_out_of_full_collections
from kvfs.daemons.master import MasterConfig, expire_forever, new_service, owner_finder, until_stopped
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
WATCH_S = 0.05  # how often the leader looks at its deadline
HOLD = object()  # a commit round with nothing to write, held while the leader is paused (Term._take)
RENEWALS_IN_FLIGHT = 8  # more waiting on an etcd without a leader would only be sent earlier, not answered sooner


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
        self.group = GroupCommit(self._take, self._write)
        self.server = self._server()
        self.caught_up = -1  # records the copy applied at the election (-1: the state was loaded)
        self.ended = ""  # why the term ended
        self.serving = False
        self._connections: set[trio.CancelScope] = set()  # each served connection's, cancelled at the end
        self._scope = trio.CancelScope()
        self._retry_log = Every(5.0)
        self._renew_log = Every(5.0)
        self._renewing = 0  # keepalives in flight
        self._renew_failures = 0  # keepalives failed since the last one answered
        self._checking = False  # a paused leader is reading the leader key
        self._pause_noted = False  # the current pause was logged

    def _server(self) -> MetadataServer:
        return MetadataServer(self.handle, self.config.tls, self.service, owner_of=owner_finder(self.service),
                              group=self.group, may_act=self.may_act, resumed=self.resumed,
                              epoch=lambda: self.leadership.epoch,
                              temp_suffix=self.service.settings.temp_suffix)

    def may_act(self) -> bool:
        return self.leadership.may_act(time.monotonic())

    @property
    def paused(self) -> bool:
        return self.serving and self.leadership.paused_since is not None

    def _note_pause(self) -> None:
        """Logs a pause once, however it was noticed (the watch, or a late renewal)."""
        lead = self.leadership
        if lead.paused_since is None or self._pause_noted or lead.lost:
            return
        self._pause_noted = True
        log.warning("master paused (epoch %d): no lease renewal answered for %.1f s (etcd electing a leader, or "
                    "unreachable); answering nothing until one is, stepping down if none is within %g s",
                    lead.epoch, time.monotonic() - lead.renewed_at, lead.pause_limit_s)
        systemd.notify(f"STATUS=paused (epoch {lead.epoch}): no lease renewal answered")

    def end(self, reason: str) -> None:
        if not self.ended:
            self.ended = reason
        self.serving = False
        self._scope.cancel()
        for scope in self._connections:
            scope.cancel()

    def _take(self) -> Batch | object | None:
        """The changes to commit; while the leader may not act, HOLD even when there are none,
        so that the replies and pushes this round releases wait in `_write` for the pause's
        end instead of meeting a closed connection."""
        batch = self.state.take(self.service)
        return HOLD if batch is None and not self.may_act() else batch

    def handle(self, request: m.Request, caller: int) -> Any:
        """A request the server decoded from a frame (the structs' bounds checked by the decoder)."""
        return self.requests.timed(type(request).__name__, lambda: self.service.handle(request, caller, True))

    async def _write(self, batch: Batch | object) -> None:
        """Commits a batch (HOLD: none), or ends the term (and never returns). It returns, and
        so releases the replies waiting for it, only while the leader may act: a pause that
        began during the commit holds them until it ends."""
        failures = 0
        while True:
            if self.leadership.lost:
                self.end(f"may no longer lead: {self.leadership.lost}")
                break
            if not self.may_act():  # paused (the watch ends the term if it lasts): nothing written or released
                await trio.sleep(RETRY_S)
                continue
            if not isinstance(batch, Batch):  # HOLD
                return
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
            batch = HOLD  # committed: returns once the leader may act
        await trio.sleep_forever()  # cancelled: the term is over

    async def _renew_forever(self) -> None:
        """A keepalive every TTL/12, each in a task of its own: one stuck on a frozen etcd
        member (each attempt bounded by the client's timeout, then the next member) does not
        hold back the next."""
        async with trio.open_nursery() as nursery:
            while True:
                await trio.sleep(renew_interval(self.leadership.ttl_s))
                if self._renewing < RENEWALS_IN_FLIGHT:
                    nursery.start_soon(self._renew_once)

    async def _renew_once(self) -> None:
        self._renewing += 1
        sent = time.monotonic()
        try:
            ttl = await self.master.renewer.keepalive(self.leadership.lease)
        except EtcdError as error:
            self._renew_failures += 1
            if self._renew_log.due():
                log.warning("renewing the leader lease failed: %s", error)
            return
        finally:
            self._renewing -= 1
        if self._renew_failures:
            log.warning("renewed the leader lease again after %d failed tries: %.1f s between the renewals sent",
                        self._renew_failures, sent - self.leadership.renewed_at)
            self._renew_failures = 0
        self.leadership.renewed(sent, ttl, time.monotonic())
        if self.leadership.lost:
            self.end(self.leadership.lost)
            return
        self._note_pause()
        if self.leadership.paused_since is not None:
            await self._confirm_and_resume()

    async def _confirm_and_resume(self) -> None:
        """A paused leader whose lease lives: resumes if the leader key still holds its lease
        and epoch (then no other master can have led, and its state is current), else steps
        down. A failed read leaves it paused, for the next renewal to try again."""
        if self._checking:
            return
        self._checking = True
        try:
            held = await self.master.client.holder(self.master.key)
        except EtcdError as error:
            if self._renew_log.due():
                log.warning("paused: reading the leader key failed (trying again at the next renewal): %s", error)
            return
        finally:
            self._checking = False
        lead = self.leadership
        if lead.lost:
            return
        if held != (lead.epoch, lead.lease):
            lead.lose("the leader key is gone" if held is None else
                      f"the leader key is another's (epoch {held[0]}, lease {held[1]:x}): another master leads")
            self.end(lead.lost)
            return
        now = time.monotonic()
        since = lead.paused_since
        if since is not None and lead.resume(now):
            self._pause_noted = False
            log.warning("master resumed (epoch %d) after %.1f s paused: its lease lived and the leader key is still "
                        "its own, so its state is current", lead.epoch, now - since)
            systemd.notify(f"STATUS=leading (epoch {lead.epoch}) as {self.master.address}")

    async def _watch(self) -> None:
        """Pauses the leader once its deadline passed unrenewed; ends the term once it lost
        its leadership or its pause outlasted the limit."""
        while True:
            lead = self.leadership
            now = time.monotonic()
            if lead.lost:
                self.end(f"may no longer lead: {lead.lost}")
                return
            lead.pause(now)
            self._note_pause()
            if lead.pause_over(now):
                lead.lose(f"no lease renewal answered for {now - lead.renewed_at:.1f} s, paused past the limit of "
                          f"{lead.pause_limit_s:g} s (etcd without quorum, or this master cut off from it)")
                self.end(lead.lost)
                return
            if lead.paused_since is not None:
                # Nodes cannot heartbeat a paused leader (their connections wait, or close): its
                # own pause convicts nobody, as for a stall of its loop (kvfs.cluster.liveness).
                self.service.liveness.grace(now)
            await trio.sleep(WATCH_S)

    async def resumed(self) -> bool:
        """Waits while the leader is paused (at most the pause's limit, then the term ends):
        True if it may act after, False if it no longer serves. Connections in the middle of
        a request wait here too (kvfs.net.rpc), so a short pause closes none of them."""
        # (Past its deadline a leader may not act before the watch has noted the pause: it
        # waits then too, unless the leadership is lost.)
        while not self.ended and not self.leadership.lost and not self.may_act():
            await trio.sleep(WATCH_S)
        return self.serving and self.may_act()

    async def serve(self, stream: trio.SocketStream) -> bool:
        """Serves a new connection until it closes or the term ends (False: not serving). One
        that comes while the leader is paused waits for the pause to end (at most its limit)."""
        if not await self.resumed():
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
        attempt_s = min(2.0, max(0.5, config.lease_ttl_s / 3))  # one member's answer; then the next member's
        self.client = EtcdClient(config.etcd, timeout_s=attempt_s)
        # Renewals have a client (threads, connections) of their own: commits retrying against
        # an etcd without a leader never hold back the keepalive that would find it back.
        self.renewer = EtcdClient(config.etcd, timeout_s=attempt_s)
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
                await self.renewer.aclose()
                await self.reader.aclose()

    def _describe(self, out: Families) -> None:
        term = self.term
        leading = term is not None and term.serving
        describe_election(out, term.leadership.epoch if term is not None and leading else 0, self.follower,
                          self.caught_up, paused=term is not None and term.paused)
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
