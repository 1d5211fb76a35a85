"""Reader releases sent without a round trip of their own.

A reader's RELEASE needs nothing back from the master that the reader waits for:
the kernel sends it after close() has returned. So a node keeps the versions whose
reader handles closed and hands them to its next OpenRead (`OpenRead.released`),
which the master applies before the open; a release that no open took within
DELAY_S is flushed as a Release of its own (only those: while loads follow each
other, the opens carry every release and no flush is sent). vLLM loads files back to back, so nearly
every load's Release rides on the next load's open: one master round trip per
load instead of two.

What this changes: a reader's lease at the master ends a little later (at most
DELAY_S plus a round trip, or at the next open), never earlier. The master keeps
a retired version's bytes that much longer; no reader sees anything different.
A registration reports only the handles still open, so releases not yet sent when
the node registers again are moot and forgotten (`forget`).
"""

from __future__ import annotations

DELAY_S = 0.02  # how long a release waits for an open to carry it
CARRIED = 256  # releases carried by one OpenRead at most (the rest wait for the next)


class PendingReleases:
    """Versions whose reader handles closed here, not yet released at the master (one
    entry per handle: the master counts handles)."""

    def __init__(self) -> None:
        self._versions: list[int] = []
        self._added: list[float] = []  # when each was queued (the caller's clock), oldest first
        self.flushing = False  # a flush is scheduled
        self.generation = 0  # registrations seen: a release taken before one is moot after it
        self.carried = 0  # releases that rode on an OpenRead
        self.flushed = 0  # releases sent on their own

    def add(self, version: int, now: float = 0.0) -> bool:
        """Queues a reader's release; True when the caller must schedule a flush."""
        self._versions.append(version)
        self._added.append(now)
        if self.flushing:
            return False
        self.flushing = True
        return True

    def take(self, limit: int = CARRIED) -> list[int]:
        """The oldest releases, up to `limit`, now the caller's to send."""
        taken, self._versions = self._versions[:limit], self._versions[limit:]
        del self._added[:limit]
        return taken

    def take_due(self, before: float, limit: int = CARRIED) -> list[int]:
        """The releases queued at or before `before` (the oldest first), up to `limit`."""
        due = 0
        while due < min(limit, len(self._added)) and self._added[due] <= before:
            due += 1
        return self.take(due)

    def oldest(self) -> float | None:
        """When the oldest release still queued was queued (None: none is)."""
        return self._added[0] if self._added else None

    def forget(self) -> None:
        """A registration reported the handles still open: nothing pending is owed any more,
        nor what a flush took before it and has not sent yet (`generation`)."""
        self._versions.clear()
        self._added.clear()
        self.generation += 1

    def __len__(self) -> int:
        return len(self._versions)
