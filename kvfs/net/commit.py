"""Group commit: replies leave only once the changes they may show are durable.

The master handles requests one at a time on its loop, as always; each handled request
takes a ticket (`ticket()`, a sequence number). One committer task (`run`) takes every
change made so far (`take()`), writes it in one transaction (`write(batch)`) and then
releases every ticket up to the last request whose changes that batch holds. A reply
waits for its ticket (`wait`), so it never shows a change a crash could still lose, and
a busy master writes many requests' changes per round trip instead of one.

`write` either returns (committed) or does not return at all: a store that cannot
commit ends the leadership (the owner cancels the committer, and the replies waiting
are never sent).
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

import trio


class GroupCommit:
    def __init__(self, take: Callable[[], Any], write: Callable[[Any], Awaitable[None]]) -> None:
        self._take = take  # every change since the last take, or None when there is none
        self._write = write
        self.handled = 0  # the last ticket given
        self.committed = 0  # every ticket up to this is released
        self.commits = 0  # transactions written
        self.batched = 0  # tickets released by them
        self._work = trio.Event()
        self._released = trio.Event()

    def ticket(self) -> int:
        """After a request (or a timer) changed the state, or read it: the number its
        reply waits for."""
        self.handled += 1
        self._work.set()
        return self.handled

    async def wait(self, ticket: int) -> None:
        while self.committed < ticket:
            await self._released.wait()

    async def run(self) -> None:
        while True:
            await self._work.wait()
            self._work = trio.Event()
            covered = self.handled  # take() below holds the changes of every request up to here
            batch = self._take()
            if batch is not None:
                await self._write(batch)
                self.commits += 1
                self.batched += covered - self.committed
            self.committed = covered
            released, self._released = self._released, trio.Event()
            released.set()
