"""kvfs.net.deadlines: one task per connection expires its requests at their deadlines, in
trio's virtual time: each when due, an earlier one added while it sleeps included, and it
wakes once per deadline passed, not once per request."""

from __future__ import annotations

import math

import trio
import trio.testing

from kvfs.net.deadlines import Watchdog


class Requests:
    """Deadlines in flight, as RemoteMaster keeps them: expired ones are taken out."""

    def __init__(self) -> None:
        self.deadlines: dict[str, float] = {}
        self.expired: list[tuple[str, float]] = []
        self.wakes = 0

    def earliest(self) -> float:
        self.wakes += 1
        return min(self.deadlines.values(), default=math.inf)

    async def expire(self, now: float) -> None:
        for name, deadline in list(self.deadlines.items()):
            if deadline <= now:
                del self.deadlines[name]
                self.expired.append((name, now))
        await trio.lowlevel.checkpoint()


def run(test) -> None:  # type: ignore[no-untyped-def]
    trio.run(test, clock=trio.testing.MockClock(autojump_threshold=0))


def test_requests_expire_at_their_deadlines_an_earlier_one_moving_the_wake_up() -> None:
    async def test() -> None:
        requests, watchdog = Requests(), Watchdog()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watchdog.run, requests.earliest, requests.expire)
            await trio.sleep(1)  # idle: it sleeps without a deadline
            for name, deadline in (("late", 11.0), ("early", 3.0)):
                requests.deadlines[name] = deadline
                watchdog.watch(deadline)
            await trio.sleep(5)
            assert requests.expired == [("early", 3.0)]
            await trio.sleep(10)
            assert requests.expired == [("early", 3.0), ("late", 11.0)]
            nursery.cancel_scope.cancel()

    run(test)


def test_answered_requests_cost_it_no_wake_up() -> None:
    async def test() -> None:
        requests, watchdog = Requests(), Watchdog()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watchdog.run, requests.earliest, requests.expire)
            await trio.sleep(0.001)
            wakes = requests.wakes
            for i in range(1000):  # each answered 1 ms after it was sent, with 10 s to spare
                requests.deadlines[str(i)] = deadline = trio.current_time() + 10
                watchdog.watch(deadline)
                await trio.sleep(0.001)
                del requests.deadlines[str(i)]
            assert requests.wakes - wakes <= 1  # (the first request's deadline: it was idle)
            await trio.sleep(20)
            assert requests.expired == [] and requests.wakes - wakes <= 2
            nursery.cancel_scope.cancel()

    run(test)
