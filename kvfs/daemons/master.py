"""`kvfs master`: the metadata service as a process, with its state in lmdb.

Every request is answered by the pure `MetadataService`, and what it changed is
written to lmdb before the answer goes out: the requests a connection's loop handles
together (those already received) are saved in one transaction, before any of them is
answered (kvfs.net.rpc). A timer declares nodes that stopped
heartbeating dead (a gap in that timer's own passes is the master's stall, which
convicts nobody: kvfs.cluster.liveness); another syncs the state to disk.

With --etcd, masters elect a leader and keep the state in etcd instead
(kvfs.daemons.leader).
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import trio

from kvfs import systemd
from kvfs.clock import SystemClock
from kvfs.wire import messages as m
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.persist import MasterState
from kvfs.daemons.heap import keep_heap_out_of_full_collections
from kvfs.net.rpc import MetadataServer
from kvfs.config import split_address
from kvfs.config import DEFAULT_MASTER_METRICS
from kvfs.metrics.exporter import serve_metrics
from kvfs.errors import errno_of
from kvfs.histogram import OperationStats
from kvfs.metrics.master import MasterMetrics
from kvfs.policy import DEFAULT_POLICY, make_policy
from kvfs.progress import Every
from kvfs.security.credentials import Tls

log = logging.getLogger("kvfs.master")

SYNC_INTERVAL_S = 1.0  # also how often a failed save is tried again
SLOW_SAVE_S = 0.05  # a save (on the request loop) slower than this is logged
# Slices of long work (kvfs.cluster.backlog) run for about this long before the save of what
# they changed and a turn for requests: the two together stay under ~50 ms (measured at 100K
# files: a 20 ms budget's work and its save take up to 38 ms of CPU; a 50 ms budget's 55 ms).
SLICE_BUDGET_S = 0.02


@dataclass(frozen=True)
class MasterConfig:
    listen: str  # HOST:PORT
    data_dir: str
    tls: Tls  # the master's identity bundle (role master)
    eviction_policy: str = DEFAULT_POLICY
    temp_suffix: str = ".tmp"
    temp_grace_s: float = 300.0
    publish_grace_s: float = 30.0
    dead_after_s: float = 2.5
    forget_dead_after_s: float = 7 * 86400.0  # 0: never
    relocate_slice: int = 1024  # entries a rename's walk looks at per step (kvfs.cluster.relocations)
    metrics_listen: str | None = DEFAULT_MASTER_METRICS  # the Prometheus endpoint; None: off
    etcd: list[str] | None = None  # etcd endpoints: elected, state in etcd (data_dir unused)
    cluster: str = "default"  # the name under /kvfs/ in etcd
    lease_ttl_s: int = 3
    advertise: str | None = None  # HOST:PORT nodes reach the leader at (default: the bound --listen)


def format_duration(seconds: float) -> str:
    return f"{seconds / 86400:g} days" if seconds >= 86400 else f"{seconds:g} s"


def new_service(config: MasterConfig) -> MetadataService:
    settings = MasterSettings(temp_suffix=config.temp_suffix.encode(), temp_grace_s=config.temp_grace_s,
                              publish_grace_s=config.publish_grace_s, cluster=True, dead_after_s=config.dead_after_s,
                              forget_dead_after_s=config.forget_dead_after_s, relocate_slice=config.relocate_slice)
    return MetadataService(SystemClock(), make_policy(config.eviction_policy), settings)


def owner_finder(service: MetadataService) -> Callable[[int], int | None]:
    def owner_of(version_id: int) -> int | None:
        """The node storing a version, for the authority's checks (None: not known here)."""
        version = service.objects.versions.get(version_id)
        return None if version is None else version.node
    return owner_of


async def until_stopped(started: Callable[[], None], status: str) -> None:
    """Tells the caller and systemd that the master is up, then waits for SIGINT or SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        started()
        systemd.notify(f"READY=1\nSTATUS={status}")
        async for signum in signals:
            log.info("received %s, stopping", signal.Signals(signum).name)
            break
    systemd.notify("STOPPING=1")


async def expire_forever(service: MetadataService, server: MetadataServer, config: MasterConfig,
                         changed: Callable[[str], Any]) -> None:
    """Declares silent nodes dead and forgets long-dead ones; `changed(cause)` saves."""
    frozen_at = -1
    while True:
        await trio.sleep(service.settings.expire_interval_s)
        frozen_at = keep_heap_out_of_full_collections(service, frozen_at)
        try:
            stalls = service.liveness.stalls
            known = dict(service.registry.by_name)
            dead = service.expire_nodes()
            while service.pending_work(SLICE_BUDGET_S):  # a dead node's files, in slices: requests run between
                changed("pending work")
                server.wake_pushers()
                await trio.sleep(0)
            for name in known.keys() - service.registry.by_name.keys():
                log.warning("node %s was dead for over %s: forgotten, as by kvfs remove-node (its files left "
                            "the namespace)", name, format_duration(config.forget_dead_after_s))
            if service.liveness.stalls != stalls:
                log.warning("the master stalled for %.1f s (paused, or a slow save): every node gets a fresh "
                            "%.1f s grace before it can be declared dead", service.liveness.last_stall_s,
                            config.dead_after_s)
            for node_id in dead:
                node = service.registry.nodes[node_id]
                log.warning("node %d (%s) stopped heartbeating: declared dead", node_id, node.name)
            changed("expiry")
            server.wake_pushers()
        except Exception:  # a bug here must not stop the master serving
            log.exception("declaring silent nodes dead failed")


class MasterProcess:
    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.service = new_service(config)
        self.state = MasterState(Path(config.data_dir))
        started = time.monotonic()
        files = self.state.load(self.service)
        log.info("loaded %d files, %d nodes from %s in %.2f s", files, len(self.service.registry.nodes),
                 config.data_dir, time.monotonic() - started)
        self.requests = OperationStats()  # by request type, their handling
        self.saves = OperationStats()  # the lmdb transactions, each for a batch of requests or a timer
        self.save_failures = 0  # failed saves in a row; the changes stay dirty meanwhile
        self.slow_saves = 0
        self._slow_save_log = Every(10.0)
        self.server = MetadataServer(self.handle, config.tls, self.service, owner_of=owner_finder(self.service),
                                     temp_suffix=self.service.settings.temp_suffix, save=self.save_requests)

    def handle(self, request: m.Request, caller: int) -> Any:
        """A request the server decoded from a frame (the structs' bounds checked by the decoder)."""
        return self.requests.timed(type(request).__name__, lambda: self.service.handle(request, caller, True))

    def save_requests(self) -> None:
        """After a batch of requests, before any answer leaves: an acknowledged change is never forgotten."""
        if not self.save_failures:  # else the timer tries again, not every batch
            self.save("requests")

    def save(self, cause: str) -> bool:
        """Writes what changed since the last save (a few entries per request: fast).
        A failure keeps every change dirty, so memory is never silently ahead of the disk:
        it is logged, tried again every SYNC_INTERVAL_S, and its end logged too."""
        started = time.monotonic()
        try:
            if not self.state.save(self.service):
                return True  # nothing changed: no transaction
        except Exception as error:  # lmdb.Error, OSError: a full map or disk, an I/O error
            self.saves.record("lmdb", errno_of(error), time.monotonic() - started)
            self.save_failures += 1
            if self.save_failures == 1:
                log.error("saving the master state in %s failed (%s): %r; the changes stay in memory and are "
                          "saved again every %.0f s", self.config.data_dir, cause, error, SYNC_INTERVAL_S)
            return False
        elapsed = time.monotonic() - started
        self.saves.record("lmdb", 0, elapsed)
        if self.save_failures:
            log.warning("saved the master state again after %d failed attempts", self.save_failures)
            self.save_failures = 0
        if elapsed > SLOW_SAVE_S:
            self.slow_saves += 1
            if self._slow_save_log.due():
                log.warning("saving the master state (%s) took %.0f ms; %d slow saves so far", cause,
                            elapsed * 1000, self.slow_saves)
        return True

    async def run(self, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
        host, port = split_address(self.config.listen)
        try:
            async with trio.open_nursery() as nursery:
                if self.config.metrics_listen is not None:
                    metrics = MasterMetrics(self.service, self.requests, self.server, self.saves)
                    await nursery.start(serve_metrics, self.config.metrics_listen, metrics.describe)
                bound = await nursery.start(self.server.serve, host, port)
                log.info("master listening on %s:%d", host, bound)
                nursery.start_soon(expire_forever, self.service, self.server, self.config, self.save)
                nursery.start_soon(self._sync_forever)
                nursery.start_soon(systemd.keep_watchdog_fed)
                await until_stopped(lambda: task_status.started(bound), f"serving on {host}:{bound}")
                nursery.cancel_scope.cancel()
        finally:
            if not self.save("stop"):
                log.error("stopping with changes not saved in %s", self.config.data_dir)
            self.state.close()

    async def _sync_forever(self) -> None:
        while True:
            await trio.sleep(SYNC_INTERVAL_S)
            if not self.save("timer"):  # after a failure: the retry
                continue
            try:
                await trio.to_thread.run_sync(self.state.sync)  # off the loop: an fsync may take seconds
            except Exception as error:  # logged; the next tick syncs again
                log.error("syncing the master state in %s failed: %r", self.config.data_dir, error)
