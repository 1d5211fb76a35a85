"""A fetch's reports from its worker thread to the event loop, delivered when wanted.

A fetch receives in a worker thread and reports each step to the event loop: the owner
answered, a piece is in and verified, a chunk is whole. Each report used to wake the loop
at once (`TrioToken.run_sync_soon`): a write to trio's wakeup socket in the thread, and a
wakeup, a read and a scheduler pass in the loop. A prefetch's reports are mostly wanted
later, by an open that comes once the bytes are already in, or by a reader that is
behind the transfer, so they wait here instead. A reader about to wait takes what was
reported (`want`), and while it waits each report reaches the loop at once, as before;
once it has woken (`unwant`) reports wait again. What is left when the thread's call has
ended is delivered by the fetch's task (`deliver`). Only when reports reach the loop
changes: each is delivered once, in order, and in the event loop.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import trio


class Notices:
    """Reports posted by one worker thread for the event loop that created this."""

    def __init__(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._lock = threading.Lock()  # (the thread posts while the loop takes)
        self._calls: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._waiters = 0  # readers waiting now: each report wakes the loop
        self._scheduled = False  # a delivery is on its way to the loop
        self.wakeups = 0  # times a report woke the loop
        self.posted = 0

    def post(self, call: Callable[..., None], *args: Any) -> None:
        """From the worker thread: `call(*args)` in the event loop, now if a reader waits, else
        when one is about to or when the thread's call has ended."""
        with self._lock:
            self._calls.append((call, args))
            self.posted += 1
            if not self._waiters or self._scheduled:
                return
            self._scheduled = True
            self.wakeups += 1
        self._token.run_sync_soon(self.deliver)

    def want(self) -> None:
        """In the event loop, before a reader waits for a report: what was posted is
        delivered now, and every later report as it comes, until `unwant`."""
        with self._lock:
            self._waiters += 1
        self.deliver()

    def unwant(self) -> None:
        """That reader has woken: later reports wait again (unless another one waits)."""
        with self._lock:
            self._waiters -= 1

    def deliver(self) -> None:
        """In the event loop: the reports posted so far, in order."""
        with self._lock:
            calls, self._calls = self._calls, []
            self._scheduled = False
        for call, args in calls:
            call(*args)
