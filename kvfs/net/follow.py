"""A hot standby's copy of the master state: loaded from etcd once, then kept up with
every commit of the leader, so that a standby elected leader only catches up from the
last revision it saw instead of loading everything (kvfs.daemons.leader).

It follows through an etcd watch on /kvfs/<cluster>/ (kvfs.net.etcd.EtcdClient.watch),
not by polling range reads: a range shows only the records that exist, so a deleted
one would take a diff of the whole state to notice, while a watch hands every put and
delete in revision order, as soon as it commits, over one connection, and replays from
any revision etcd still keeps. The prefix holds the leader key too: its creation by
the elected standby is the marker that every change before the new epoch has arrived.

A leader's commit may span several txns (kvfs.net.etcdstate.split), the counters
record in the first. Records are applied a whole commit at a time
(MetadataService.apply): those since the last counters record wait until the next one
arrives or the election, so the copy never holds half a commit (a rename's entry in
its new directory before the one it replaced is gone). For the same reason the load
reads the state as it was just before the latest commit began (the counters record's
revision minus one) and the watch replays from there.

When etcd compacted away the revision the watch needs (the leader compacts every 60 s:
a standby cut off that long), or a change cannot be applied, the copy is loaded again.
"""

from __future__ import annotations

import logging
import time
from contextlib import aclosing
from typing import Callable

import trio

from kvfs.cluster import records
from kvfs.cluster.master import MetadataService
from kvfs.cluster.records import Kind
from kvfs.net.etcd import Compacted, EtcdClient, EtcdError, Event
from kvfs.net.etcdstate import EtcdState
from kvfs.progress import Every

log = logging.getLogger("kvfs.master")

RETRY_S = 0.5  # a broken watch is opened again this soon


class NotCaughtUp(EtcdError):
    """The copy could not be brought up to the election's revision: load instead."""


class Follower:
    def __init__(self, client: EtcdClient, cluster: str, new_service: Callable[[], MetadataService],
                 loaded: Callable[[MetadataService], None] = lambda service: None) -> None:
        self.client = client
        self.state = EtcdState(client, cluster)
        self.prefix = f"/kvfs/{cluster}/".encode()
        self._new_service = new_service
        self._loaded = loaded  # called after each load (the daemon moves the heap out of the collector's way)
        self.service: MetadataService | None = None  # None until loaded
        self.revision = 0  # every change up to this one is applied or pending
        self.pending: list[Event] = []  # changes of the latest commit, not applied yet
        self.loads = 0
        self.loaded_files = 0
        self.applied = 0  # records applied since the last load
        self.load_s = 0.0
        self.loading = False  # a load is under way
        self._watch_log = Every(10.0)
        self._scope = trio.CancelScope()
        self._stopped = False  # by `stop`: a message `run` already had is not applied
        self._advanced = trio.Event()  # set (and replaced) whenever `revision` moves

    async def run(self) -> None:
        """Loads, then follows until stopped or cancelled (loading again when it must)."""
        self._scope = trio.CancelScope()  # (a scope is entered once: a fresh one for each run)
        if self._stopped:
            return
        with self._scope:
            await self._run()

    def stop(self) -> None:
        """Ends `run`; the copy is left as it is (nothing more is applied by `run`)."""
        self._stopped = True
        self._scope.cancel()
        self._advance()

    async def _run(self) -> None:
        while True:
            self.loading = True
            try:
                await self._load()
            except EtcdError as error:
                if self._watch_log.due():
                    log.warning("standby: loading the state from etcd failed (trying again): %s", error)
                await trio.sleep(RETRY_S)
                continue
            finally:
                self.loading = False
                self._advance()
            try:
                await self._follow()
            except (Compacted, _Diverged) as error:
                log.warning("standby: loading the state again: %s", error)

    async def _load(self) -> None:
        self.service = None
        started = time.monotonic()
        service = self._new_service()
        counters = await self.client.get_revisions(self.state.key(Kind.COUNTERS, 0))
        try:  # just before the latest commit began (see above); else now, when that is compacted away
            files = await self.state.load(service, revision=counters[0] - 1 if counters else 0)
        except Compacted:
            service = self._new_service()
            files = await self.state.load(service)
        self.revision = self.client.read_revision
        self.pending = []
        self.applied = 0
        self.loads += 1
        self.loaded_files = files
        self.load_s = time.monotonic() - started
        self._loaded(service)
        self.service = service
        log.info("standby: loaded %d files from etcd in %.2f s (revision %d); following the leader's commits",
                 files, self.load_s, self.revision)

    async def _follow(self) -> None:
        while True:
            try:
                async with aclosing(self.client.watch(self.prefix, self.revision + 1)) as watch:
                    async for events in watch:
                        if self._stopped:
                            return
                        self._receive(events)
            except Compacted:
                raise
            except EtcdError as error:
                if self._watch_log.due():
                    log.warning("standby: watching etcd failed (watching again from revision %d): %s",
                                self.revision + 1, error)
            await trio.sleep(RETRY_S)

    def _receive(self, events: list[Event]) -> None:
        """Events of whole txns: a txn with the counters record starts a commit, so every
        change before it forms complete commits, applied now."""
        counters = self.state.key(Kind.COUNTERS, 0)
        for event in events:
            if event.key == counters and event.revision > self.revision:
                self._apply()
            self.revision = max(self.revision, event.revision)
            if event.key.startswith(self.state.prefix):
                self.pending.append(event)
        self._advance()

    def _advance(self) -> None:
        advanced, self._advanced = self._advanced, trio.Event()
        advanced.set()

    def _apply(self) -> int:
        """Applies the pending changes; how many records that was."""
        pending, self.pending = self.pending, []
        if not pending or self.service is None:
            return 0
        latest = {event.key: event.value for event in pending}  # the last change of each record
        changed = records.Loaded()
        gone: dict[Kind, list[int]] = {Kind.INODE: [], Kind.VERSION: [], Kind.NODE: [], Kind.COUNTERS: []}
        try:
            for key, value in latest.items():
                kind, number = self.state.parse_key(key)
                if value is None:
                    gone[kind].append(number)
                else:
                    changed.add(kind, number, value)
            counters = (changed.next_ino, changed.next_entry_id, changed.next_version)
            self.service.apply(changed.inodes, changed.versions, gone[Kind.INODE], gone[Kind.VERSION], counters,
                               changed.nodes, gone[Kind.NODE], changed.grants)
            self.service.registry.reserve(changed.next_node)  # (the ids of nodes removed meanwhile too)
        except Exception as error:  # a record that does not fit the copy: it cannot be trusted any more
            self.service = None
            raise _Diverged(f"applying {len(latest)} records up to revision {self.revision} failed: "
                            f"{type(error).__name__}: {error}") from error
        self.applied += len(latest)
        return len(latest)

    async def catch_up(self, revision: int, timeout_s: float) -> tuple[MetadataService, int]:
        """After this standby won the election at REVISION (the leader key's creation, seen
        by the watch): stops following and applies every change before REVISION, within
        TIMEOUT_S (after the load, when one is under way: loading anew would only take
        longer). The running watch normally has them already; a watch of its own from the
        last revision seen (when the running one stalled, on a frozen member) fetches the
        rest. The service and the number of records applied now. NotCaughtUp when the copy
        is not loaded, lags past what etcd keeps, or REVISION is not reached in time."""
        while self.loading and not self._stopped:  # a load under way: the same work a load now would do
            await self._advanced.wait()
        with trio.move_on_after(min(1.0, timeout_s)):  # the running watch brings it, normally at once
            while self.revision < revision and self.service is not None and not self._stopped:
                await self._advanced.wait()
        self.stop()
        if self.service is None:
            raise NotCaughtUp("the standby had not loaded the state yet")
        try:
            with trio.fail_after(timeout_s):
                if self.revision < revision:  # a watch of its own: the running one stalled or broke
                    async with aclosing(self.client.watch(self.prefix, self.revision + 1)) as watch:
                        async for events in watch:
                            self._receive(events)
                            if self.revision >= revision:
                                break
            applied = self._apply()
        except trio.TooSlowError:
            raise NotCaughtUp(f"the watch did not reach revision {revision} within {timeout_s:g} s "
                              f"(at {self.revision})") from None
        except (EtcdError, _Diverged) as error:
            raise NotCaughtUp(str(error)) from None
        service = self.service
        assert service is not None
        return service, applied


class _Diverged(Exception):
    """A change could not be applied to the copy."""
