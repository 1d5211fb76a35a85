"""Which nodes are dead, judged so that the judge's own stall cannot convict anyone (pure).

A node is dead when the master has not heard from it for `dead_after_s`. The master
hears nothing while it is itself paused (SIGSTOP, a slow disk, a long collection, a
clock jump): heartbeats wait in its sockets. So the expiry pass, which runs every
fraction of a second, measures the time since its previous pass on the monotonic
clock; a gap longer than `stall_gap_s` means the master stalled, and every node is
then treated as heard from at that moment, a fresh grace in which the heartbeats
queued during the stall are read. Only a node that stays silent for `dead_after_s`
of the master's own running time is declared dead.
"""

from __future__ import annotations

from kvfs.cluster.registry import NodeRecord, Registry


class Liveness:
    def __init__(self, registry: Registry, stall_gap_s: float, started: float) -> None:
        self.registry = registry
        self.stall_gap_s = stall_gap_s
        # When the previous expiry pass ran; the service's start counts as one, so that a
        # stall before the first pass (a slow load, a pause right after a restart) is a gap too.
        self.last_pass = started
        self.stalls = 0  # gaps noticed since start
        self.last_stall_s = 0.0  # the latest gap's length

    def expired(self, now: float) -> list[NodeRecord]:
        """Nodes to declare dead at `now`: none right after a gap in the master's own passes."""
        previous, self.last_pass = self.last_pass, now
        if not 0 <= now - previous <= self.stall_gap_s:
            self.stalls += 1
            self.last_stall_s = now - previous
            self.grace(now)
            return []
        return self.registry.expired(now)

    def grace(self, now: float) -> None:
        """Every live or registering node counts as heard from at `now`."""
        for node in self.registry.nodes.values():
            if node.live or node.registering:
                node.last_seen = max(node.last_seen, now)
