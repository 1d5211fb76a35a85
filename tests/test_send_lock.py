"""A connection's send lock taken without a scheduler pass when free (kvfs.net.rpc.acquire)."""

from __future__ import annotations

import trio
import trio.testing

from kvfs.net.rpc import acquire


def test_a_free_lock_is_taken_without_running_another_task() -> None:
    async def main() -> None:
        lock = trio.Lock()
        ran: list[str] = []

        async def other() -> None:
            ran.append("other")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other)  # runs at the next scheduler pass
            await acquire(lock)
            assert lock.locked() and ran == []
            lock.release()
        assert ran == ["other"]

    trio.run(main)


def test_a_cancelled_caller_does_not_take_it() -> None:
    async def main() -> None:
        lock = trio.Lock()
        with trio.CancelScope() as scope:
            scope.cancel()  # (a request whose deadline passed: its frame must not go)
            await acquire(lock)
        assert scope.cancelled_caught and not lock.locked()

    trio.run(main)


def test_a_held_lock_is_waited_for_then_taken() -> None:
    async def main() -> None:
        lock = trio.Lock()
        release = trio.Event()
        order: list[str] = []

        async def holder(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            async with lock:
                task_status.started()
                await release.wait()
                order.append("holder")

        async def waiter() -> None:
            await acquire(lock)
            order.append("waiter")
            lock.release()

        async with trio.open_nursery() as nursery:
            await nursery.start(holder)
            nursery.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert order == [] and lock.statistics().tasks_waiting == 1
            release.set()
        assert order == ["holder", "waiter"] and not lock.locked()

    trio.run(main)
