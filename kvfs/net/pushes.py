"""Pushed name changes and the replies that wait for them (the master's side of a
node's directory copies; the node's side is kvfs.node.membership).

A node answers misses from its copies of watched directories (kvfs.node.dircache). A
push of a new name could reach it after the writer's reply, and a lookup on that node
in between would answer "absent" for a file already closed elsewhere. So pushes are
numbered per connection and acknowledged (`Heartbeat.applied`), and the reply to a
request that added a name pushed to other nodes waits until each of them acknowledged
it, at most `ACK_WAIT_S`.

That wait is bounded without trusting a slow node: a node answers misses from its
copies only within `COPY_LEASE_S` of sending a heartbeat whose answer found every push
numbered before it (`Beat.pushed`) applied. A node that does not acknowledge a change
within the wait got every lease it still holds from a heartbeat sent before the change,
so its copies stop answering misses by the time the wait ends, until its next
heartbeat finds the change applied.
"""

from __future__ import annotations

import trio

from kvfs.wire import messages as m

COPY_LEASE_S = 1.0  # a node's copies answer misses this long after a heartbeat that found them current
# A changer's reply waits at most this for the nodes' acknowledgements: the lease, and a
# margin for the two clocks' rates (both monotonic, on different machines).
ACK_WAIT_S = 1.1 * COPY_LEASE_S
# Requests that can add a name to a directory (or bring one back): only their replies wait.
# A removal or a changed entry never makes a copy answer "absent" for a name that exists.
ADDING_NAMES = (m.Create, m.MkDir, m.Symlink, m.Rename, m.Restore, m.Report, m.FinishRegistration, m.Publish)


def reply_waits(request: m.Request, temp_suffix: bytes) -> bool:
    """Whether the reply to `request` waits for the nodes its changes were pushed to: it can
    add a name, other than a writer's temporary one. A temp file's name is looked up by no
    other node (it is published later by a rename, whose reply waits); the create of one is
    half of what vLLM's store would otherwise wait for."""
    if isinstance(request, m.Create) and temp_suffix and request.name.endswith(temp_suffix):
        return False
    return isinstance(request, ADDING_NAMES)


class Watcher:
    """One registered node's connection: its pushes as numbered and as acknowledged."""

    def __init__(self) -> None:
        self.queued = 0  # the number of the latest push (changes waiting or sent)
        self.applied = 0  # the latest the node acknowledged
        self.late = 0  # changers' replies that waited the whole ACK_WAIT_S for this node
        self._acknowledged = trio.Event()

    def queue(self) -> int:
        """Changes for this node were queued: the number of the push that will carry them."""
        self.queued += 1
        return self.queued

    def acknowledge(self, applied: int) -> None:
        if applied > self.applied:
            self.applied = min(applied, self.queued)  # (a number not pushed yet acknowledges nothing more)
            self._acknowledged.set()
            self._acknowledged = trio.Event()

    async def wait_applied(self, seq: int, deadline: float) -> bool:
        """Until push `seq` is acknowledged (True) or `deadline` (trio time) passes (False)."""
        with trio.move_on_at(deadline):
            while self.applied < seq:
                await self._acknowledged.wait()
        if self.applied >= seq:
            return True
        self.late += 1
        return False
