"""Prefetch runs bound for the same owner go out together when they wait for a turn.

vLLM's lookup thread checks a request's files one after another, and each lookup starts a
prefetch; PARALLEL of them transfer at once (kvfs.node.prefetch) and the rest wait for a
turn. Whoever gets a turn takes every run queued for the same owner, up to BATCH_CHUNKS
chunks, in one request and one worker-thread call (`TcpTransport.fetch_batch`, as
Mooncake's batch get): one request, one thread hop and one answer per batch instead of per
file. A run that finds a turn free goes at once and alone, so a lone lookup waits for
nothing; a batch of one goes as a plain fetch. Each run still ends on its own: a file the
owner no longer has, or a chunk that fails its checksum, fails that file only.
"""

from __future__ import annotations

import errno
from collections import deque
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

import trio

from kvfs.errors import StorageError
from kvfs.notices import Notices
from kvfs.net.transport import FetchRun

BATCH_CHUNKS = 4  # chunks per batch: a few files each, so that batches still go out side by side


class BatchTransport(Protocol):
    async def fetch(self, address: str, version: int, first: int, targets: list[memoryview], lengths: list[int],
                    checksums: list[int], on_chunk: Callable[[int], None], on_answer: Callable[[], None] = ...,
                    on_piece: Callable[[int, int], None] = ..., notices: Notices | None = ...) -> None: ...

    def fetch_batch(self, address: str, runs: list[FetchRun]) -> Awaitable[list[StorageError | None]]: ...


@dataclass(slots=True, eq=False)
class _Waiting:
    run: FetchRun
    taken: bool = False  # a batch carries it (its own turn's, or another run's)
    error: BaseException | None = None
    done: trio.Event = field(default_factory=trio.Event)


def take_batch(queue: deque[_Waiting], first: _Waiting, most: int) -> list[_Waiting]:
    """`first` and the runs queued after it, oldest first, up to `most` chunks in all (always
    `first`); takes them off the queue."""
    queue.remove(first)
    batch, chunks = [first], len(first.run.targets)
    while queue and chunks + len(queue[0].run.targets) <= most:
        chunks += len(queue[0].run.targets)
        batch.append(queue.popleft())
    for waiting in batch:
        waiting.taken = True
    return batch


class FetchBatcher:
    """Runs per owner that wait for one of `turns`; a turn carries a batch of them."""

    def __init__(self, transport: BatchTransport, turns: trio.Semaphore, most: int = BATCH_CHUNKS) -> None:
        self.transport = transport
        self.turns = turns
        self.most = most
        self._queues: dict[str, deque[_Waiting]] = {}
        self.batches = 0  # requests that carried more than one run
        self.batched_runs = 0  # runs they carried

    async def fetch(self, address: str, run: FetchRun) -> None:
        """Fills `run` from the node at `address`, alone or in a batch; raises what a fetch of
        it alone would (StorageError)."""
        waiting = _Waiting(run)
        queue = self._queues.setdefault(address, deque())
        queue.append(waiting)
        try:
            async with self.turns:
                if not waiting.taken:  # (else another run's turn carries it: this turn goes back at once)
                    await self._send(address, take_batch(queue, waiting, self.most))
        finally:
            if not waiting.taken:  # cancelled while queued
                queue.remove(waiting)
            if not queue and self._queues.get(address) is queue:
                del self._queues[address]
            if waiting.taken:
                # Shielded, cancelled or not: a batch writes into this run's buffers until it
                # ends, which its transport bounds (PEER_SILENCE_S per wait), so the run (and
                # its buffers) must not end before it.
                with trio.CancelScope(shield=True):
                    await waiting.done.wait()
        if waiting.error is not None:
            raise waiting.error

    async def _send(self, address: str, batch: list[_Waiting]) -> None:
        outcomes: list[BaseException | None] = [StorageError(errno.EIO, "the fetch was cancelled")] * len(batch)
        try:
            if len(batch) == 1:
                run = batch[0].run
                deferred = {"notices": run.notices} if run.notices is not None else {}
                await self.transport.fetch(address, run.version, run.first, run.targets, run.lengths, run.checksums,
                                           run.on_chunk, run.on_answer, run.on_piece, **deferred)
                outcomes = [None]
            else:
                self.batches += 1
                self.batched_runs += len(batch)
                outcomes = list(await self.transport.fetch_batch(address, [waiting.run for waiting in batch]))
        except Exception as error:  # the connection failed: every run of the batch with it
            outcomes = [error] * len(batch)
        finally:
            for waiting, outcome in zip(batch, outcomes):
                waiting.error = outcome
                waiting.done.set()
