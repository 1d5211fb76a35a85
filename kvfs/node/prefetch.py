"""Fetching a remote file's chunks when its name is looked up, before it is opened.

vLLM (and most consumers) look a block's file up and open it right after, or
check that it exists at scheduling time and load it a little later. A lookup
answered by the master already says where the bytes of a sealed file are (node,
address, checksums), so a node can start streaming them then: by the time the
open comes (and its master round trip returns the same version) the bytes are
on their way or already here. The open adopts the stream only if the master
names the same version, which is immutable once sealed and verified chunk by
chunk, so a prefetch can be late or useless but never wrong.

Bounded on every side: only files of at most MAX_CHUNKS chunks, at most
MAX_CHUNKS_HELD chunk buffers held by unclaimed prefetches, PARALLEL transfers
at a time, never when the read buffer pool is short, and an unclaimed prefetch
is dropped after TTL_S. A workload that looks names up without opening them
(`ls -l`, `find`, `du`) would make every lookup a transfer; `PrefetchGate`
notices that most prefetches go unclaimed and stops prefetching for a while.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

import trio

from kvfs.store.tiered import ReadSource, TieredStore

log = logging.getLogger(__name__)

MAX_CHUNKS = 8  # files up to 8 chunks (32 MiB with 4 MiB chunks) are prefetched
MAX_CHUNKS_HELD = 16  # read buffers held by unclaimed prefetches (64 MiB)
PARALLEL = 4  # prefetches transferring at once (each on a pooled peer connection)
POOL_RESERVE = 16  # never prefetch into the last read buffers: opens need them
TTL_S = 2.0  # an unclaimed prefetch is dropped after this long
WINDOW = 32  # outcomes the gate looks back on
PAUSE_S = 5.0  # how long the gate stays shut once most prefetches went unclaimed


class PrefetchGate:
    """Decides whether lookups may start prefetches, from how the recent ones ended:
    shut for PAUSE_S when at least half of the last WINDOW were never claimed."""

    def __init__(self, window: int = WINDOW, pause_s: float = PAUSE_S) -> None:
        self.window = window
        self.pause_s = pause_s
        self._outcomes: deque[bool] = deque(maxlen=window)
        self._shut_until = 0.0
        self.pauses = 0

    def allows(self, now: float) -> bool:
        return now >= self._shut_until

    def record(self, claimed: bool, now: float) -> None:
        self._outcomes.append(claimed)
        if len(self._outcomes) == self.window and self._outcomes.count(False) * 2 >= self.window:
            self._shut_until = now + self.pause_s
            self._outcomes.clear()
            self.pauses += 1
            log.info("most prefetches went unclaimed (names looked up, not opened): none for %.0f s", self.pause_s)


@dataclass(slots=True)
class _Prefetch:
    source: ReadSource
    expires: float


class Prefetches:
    """The unclaimed prefetches of one node, by version."""

    def __init__(self, store: TieredStore, now: Callable[[], float]) -> None:
        self.store = store
        self.now = now
        self.gate = PrefetchGate()
        # Prefetch transfers take turns: a burst of lookups must not open a connection
        # per name (opens of files not prefetched do not wait for these).
        self.turns = trio.Semaphore(PARALLEL)
        self._pending: OrderedDict[int, _Prefetch] = OrderedDict()  # oldest first
        self._chunks_held = 0
        self.started = 0
        self.claimed = 0
        self.wasted = 0

    def wanted(self, version: int, size: int) -> bool:
        """Whether a lookup of this sealed remote version should start a prefetch now."""
        chunks = -(-size // self.store.chunk_size)
        if version in self._pending or not 0 < chunks <= MAX_CHUNKS:
            return False
        now = self.now()
        self._expire(now)
        if not self.gate.allows(now) or self.store.read_buffers.available < chunks + POOL_RESERVE:
            return False
        # Full: the older prefetches stay (vLLM loads a request's chunks in the order it
        # looked them up), the new name is fetched when it is opened.
        return self._chunks_held + chunks <= MAX_CHUNKS_HELD

    def add(self, source: ReadSource) -> None:
        self._pending[source.version] = _Prefetch(source, self.now() + TTL_S)
        self._chunks_held += len(source.chunks)
        self.started += 1

    def claim(self, version: int) -> ReadSource | None:
        """The prefetch of this version, now the caller's (it closes it), if there is one."""
        prefetch = self._pending.pop(version, None)
        self._expire(self.now())  # opens come without lookups too: stale ones go here as well
        if prefetch is None:
            return None
        self._chunks_held -= len(prefetch.source.chunks)
        self.claimed += 1
        self.gate.record(True, self.now())
        return prefetch.source

    def _expire(self, now: float) -> None:
        while self._pending:
            version, prefetch = next(iter(self._pending.items()))
            if prefetch.expires > now:
                return
            self._drop(version)

    def _drop(self, version: int) -> None:
        prefetch = self._pending.pop(version)
        self._chunks_held -= len(prefetch.source.chunks)
        self.store.close_read(prefetch.source)  # a stream still running gives its buffers back when it ends
        self.wasted += 1
        self.gate.record(False, self.now())
