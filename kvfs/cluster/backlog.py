"""Long work the metadata service does in slices, between requests (pure).

A node holding 100K files that dies, or one dead long enough to be forgotten, means
work in proportion to its files. Done in one go it would stop the master answering
every other node meanwhile (a node's request bounds are seconds). So such work is a
job: a generator that does a few items per step and yields. The service runs one
step at once (small jobs finish there, as if synchronous), and the daemon runs the
rest with `run(budget_s)` between requests until none is left.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Callable, Iterator

Job = Iterator[None]  # each step does a bounded amount of work, then yields
STEP_ITEMS = 1024  # items a job handles per step (1-10 ms of Python: a file removed is the costliest item)


class Backlog:
    def __init__(self, timer: Callable[[], float] = time.perf_counter) -> None:
        self._jobs: deque[Job] = deque()
        self._timer = timer
        self.steps = 0  # steps run since start
        self.longest_s = 0.0  # the longest `run` call (for the daemon's metrics and the tests)

    def __len__(self) -> int:
        return len(self._jobs)

    def add(self, job: Job) -> None:
        """Queues a job and runs its first step now."""
        self._jobs.append(job)
        self._step(len(self._jobs) - 1)

    def _step(self, index: int) -> None:
        job = self._jobs[index]
        self.steps += 1
        try:
            next(job)
        except StopIteration:
            del self._jobs[index]

    def run(self, budget_s: float) -> bool:
        """Runs steps, oldest job first, until none is left or `budget_s` is spent (at least
        one step). Returns whether work is left."""
        started = self._timer()
        while self._jobs:
            self._step(0)
            if self._timer() - started >= budget_s:
                break
        self.longest_s = max(self.longest_s, self._timer() - started)
        return bool(self._jobs)

    def drain(self) -> None:
        """Runs every job to its end (tests, and a service without a loop around it)."""
        while self._jobs:
            self._step(0)
