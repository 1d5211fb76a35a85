"""Small trio helpers shared by the storage code."""

from __future__ import annotations

from typing import Awaitable, Callable, Iterable

import trio


async def run_all(calls: Iterable[Callable[[], Awaitable[object]]]) -> None:
    """Runs calls concurrently. If any fails, the others are cancelled and the first
    failure is raised as itself (not wrapped in an exception group), so callers can
    catch OSError or StorageError as with a sequential loop."""
    failures: list[Exception] = []

    async def guarded(call: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
        try:
            await call()
        except Exception as error:
            failures.append(error)
            scope.cancel()

    async with trio.open_nursery() as nursery:
        for call in calls:
            nursery.start_soon(guarded, call, nursery.cancel_scope)
    if failures:
        raise failures[0]


def single_error(group: BaseExceptionGroup, kinds: tuple[type[BaseException], ...]) -> BaseException | None:
    """The first exception of one of `kinds` inside a (nested) exception group, if any: what
    a task nursery wrapped, to report it as the one error it is."""
    matched, _ = group.split(kinds)
    while isinstance(matched, BaseExceptionGroup):
        matched = matched.exceptions[0]
    return matched
