"""A call in a worker thread for the chunk paths (the owner's sends, the reader's receives),
at the cost of the hop alone.

`trio.to_thread.run_sync` does more per call than these paths need: it names the OS
thread for the call and back (two `prctl`s through ctypes), formats that name from the task's,
copies the context, and takes its limiter with a scheduler pass of its own even when the
limiter is free. `in_thread` keeps what they rely on (a thread from trio's
cache, a bound on threads at once, the caller's task waiting uncancellably until the call
returns, its outcome raised or returned) and drops the rest.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import outcome
import trio

T = TypeVar("T")


def _no_abort(_: Any) -> trio.lowlevel.Abort:
    # The thread holds views of the caller's buffers: the caller waits until it returns.
    return trio.lowlevel.Abort.FAILED


def _resume(task: trio.lowlevel.Task, result: Any, returned: Callable[[], None] | None) -> None:
    if returned is not None and isinstance(result, outcome.Value):
        returned()
    trio.lowlevel.reschedule(task, result)


async def in_thread(limiter: trio.CapacityLimiter, fn: Callable[..., T], *args: Any,
                    returned: Callable[[], None] | None = None, first: Callable[[], None] | None = None) -> T:
    """`fn(*args)` in a cached worker thread, with one of `limiter`'s tokens held meanwhile;
    returns its result or raises its exception. A cancel takes effect after it returns.
    `returned()`, if given, runs in the event loop as soon as `fn` has returned (not raised),
    on the same wake-up that reschedules the caller: a report that would otherwise wake the
    loop on its own, or wait for the caller's next step. `first()`, if given, runs in the
    event loop once the token is held, just before the thread starts (what it raises is
    raised, and no thread starts): work that must not wait for the thread to be scheduled."""
    try:
        limiter.acquire_nowait()
    except trio.WouldBlock:
        await limiter.acquire()
    try:
        if first is not None:
            first()
        task = trio.lowlevel.current_task()
        token = trio.lowlevel.current_trio_token()

        def deliver(result: Any) -> None:  # (an `outcome.Outcome`: trio hands it back as is)
            token.run_sync_soon(_resume, task, result, returned)

        trio.lowlevel.start_thread_soon(lambda: fn(*args), deliver)
        return await trio.lowlevel.wait_task_rescheduled(_no_abort)  # type: ignore[no-any-return]
    finally:
        limiter.release()
