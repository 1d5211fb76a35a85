"""A node's index records to rewrite after renames, in the background.

The master's heartbeat answers name versions on this node's SSD whose path a rename
changed (`Beat.relocated`, kvfs.cluster.relocations). They are rewritten BATCH at a time,
one batch after the other, the node's other requests going between: a `GetRecord` gives
the path as it is when the record is written, so order and repeats do not matter. A version that is no
longer on SSD, or not this node's, is skipped (the store checks). A rewrite that fails
(the master unreachable, the index failing) is not retried here: the registration that
follows a broken connection reports every record, and the master names the stale ones
again; the index's failure makes the offloader write the record anew.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Awaitable, Callable, Iterable

import trio

log = logging.getLogger("kvfs.node")
# Records rewritten together: their descriptions asked of the master at once, their headers
# and index entries written with one sync (a sync per record made 100K records take minutes).
BATCH = 64


class RecordMoves:
    def __init__(self) -> None:
        self._queue: deque[int] = deque()
        self._queued: set[int] = set()  # (a version named twice before its turn is rewritten once)
        self._wake = trio.Event()
        self.rewritten = 0  # since start (for the tests)

    def __len__(self) -> int:
        return len(self._queue)

    def add(self, versions: Iterable[int]) -> None:
        for version in versions:
            if version not in self._queued:
                self._queued.add(version)
                self._queue.append(version)
        if self._queue:
            self._wake.set()

    async def run(self, rewrite: Callable[[list[int]], Awaitable[None]]) -> None:
        """Rewrites queued records for ever, BATCH at a time (a task of the node daemon)."""
        while True:
            if not self._queue:
                await self._wake.wait()
                self._wake = trio.Event()
                continue
            batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
            self._queued.difference_update(batch)
            try:
                await rewrite(batch)
            except Exception:  # a bug here must not stop the node (the next registration names them again)
                log.exception("rewriting the index records of %d versions failed", len(batch))
            self.rewritten += len(batch)
            await trio.sleep(0)
