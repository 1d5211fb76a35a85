"""The deadlines of a connection's requests, kept by one task instead of a cancel scope each.

A trio cancel scope around every request (`move_on_after`) costs the caller the scope's
setup and teardown and its deadline's entry in trio's heap: some 15 µs per request, a tenth
of what a node spends on one master request. The requests of one connection mostly carry
the same timeout and are answered in order, so one task that sleeps until the earliest
deadline of the requests in flight, and expires those that are due, bounds them all: it
wakes once per timeout under a steady load, not once per request. A request due before the
task's wake-up moves it (a caller with less time left).
"""

from __future__ import annotations

import math
from typing import Awaitable, Callable

import trio


class Watchdog:
    def __init__(self) -> None:
        self._sleep: trio.CancelScope | None = None
        self._wake_at = -math.inf  # while awake the task looks at every deadline anyway

    def watch(self, deadline: float) -> None:
        """A request due at `deadline` (trio time) is in flight."""
        if deadline < self._wake_at:
            self._wake_at = deadline
            if self._sleep is not None:
                self._sleep.deadline = deadline

    async def run(self, earliest: Callable[[], float], expire: Callable[[float], Awaitable[None]]) -> None:
        """Forever: `expire(now)` whenever `earliest()`, the first deadline in flight, has
        passed; `expire` must take every request due by `now` out of flight."""
        while True:
            self._wake_at = -math.inf
            now = trio.current_time()
            due = earliest()
            if due <= now:
                await expire(now)
                continue
            self._wake_at = due  # (no checkpoint since `earliest()`: no deadline was missed)
            with trio.CancelScope(deadline=due) as self._sleep:
                await trio.sleep_forever()
            self._sleep = None
