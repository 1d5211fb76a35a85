"""A fetch's reports from its worker thread to the event loop, delivered when wanted.

A fetch receives in a worker thread and reports each step to the event loop: the owner
answered, a piece is in and verified, a chunk is whole. Each report used to wake the loop
at once (`TrioToken.run_sync_soon`): a write to trio's wakeup socket in the thread, and a
wakeup, a read and a scheduler pass in the loop. A prefetch's reports are mostly wanted
later, by an open that comes once the bytes are already in, so they wait here instead
until someone waits for them (`want`: that report and every later one reach the loop at
once, as before) or until the thread's call has ended (`deliver`, which the fetch's task
calls then). Only when they reach the loop changes: each is delivered once, in order, and
in the event loop.
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
        self._wanted = False  # someone waits: each report wakes the loop
        self._scheduled = False  # a delivery is on its way to the loop
        self.wakeups = 0  # times a report woke the loop
        self.posted = 0

    def post(self, call: Callable[..., None], *args: Any) -> None:
        """From the worker thread: `call(*args)` in the event loop, now if it is wanted, else
        when it is or when the thread's call has ended."""
        with self._lock:
            self._calls.append((call, args))
            self.posted += 1
            if not self._wanted or self._scheduled:
                return
            self._scheduled = True
            self.wakeups += 1
        self._token.run_sync_soon(self.deliver)

    def want(self) -> None:
        """In the event loop, before waiting for a report: what was posted is delivered now,
        and every later report as it comes."""
        with self._lock:
            self._wanted = True
        self.deliver()

    def deliver(self) -> None:
        """In the event loop: the reports posted so far, in order."""
        with self._lock:
            calls, self._calls = self._calls, []
            self._scheduled = False
        for call, args in calls:
            call(*args)
