"""The leader's view of its etcd lease (pure; the clock is passed in).

A master leads while the lease holding the leader key lives. etcd ends the lease
`ttl_s` after its last renewal; the leader counts from when it *sent* that renewal
(earlier than etcd received it), so its own deadline falls before etcd's. It acts
(answers a request, writes state) only until `ttl_s - margin_s` after that: the margin
covers the time between a check and the act. A leader frozen (SIGSTOP, a long pause)
past its deadline finds, on the monotonic clock, that it may no longer act, before
it sends anything; a write racing that is refused by etcd, fenced on the epoch.

The epoch is the leader key's create_revision: each new leadership creates the key
anew, so a later leader always has a larger epoch than every earlier one.
"""

from __future__ import annotations

from dataclasses import dataclass


def default_margin(ttl_s: float) -> float:
    """How long before its own deadline a leader stops acting: a twelfth of the TTL, at most
    0.5 s. It covers a check and the act after it (a loop pass, bounded by the ~50 ms work
    slices); the deadline already counts from when a renewal was sent, not answered."""
    return min(0.5, ttl_s / 12)


def renew_interval(ttl_s: float) -> float:
    """How often the leader renews its lease: often, so that the first renewal answered
    after a stall of etcd (its own leader lost: an election of 1 to 2 election timeouts,
    more on a loaded machine) was sent soon after etcd had a leader again, and the
    leader's deadline is as far off as it can be. With the defaults (TTL 3 s, etcd's
    election timeout 1 s) the leader outlasts 2.5 s of etcd election, where TTL/6 for
    both left 2.0 s, which an election on a loaded machine overran."""
    return ttl_s / 12


@dataclass
class Leadership:
    lease: int  # the etcd lease id
    epoch: int  # the leader key's create_revision
    ttl_s: float
    renewed_at: float  # monotonic time the last successful renewal (or the grant) was sent
    margin_s: float = -1.0  # default_margin(ttl_s) unless given
    lost: str = ""  # why leadership ended ("" while it holds)

    def __post_init__(self) -> None:
        if self.margin_s < 0:
            self.margin_s = default_margin(self.ttl_s)
        if not 0 <= self.margin_s < self.ttl_s:
            raise ValueError(f"lease margin {self.margin_s} s must be below the TTL {self.ttl_s} s")

    def deadline(self) -> float:
        """The monotonic time after which this leader must not act."""
        return self.renewed_at + self.ttl_s - self.margin_s

    def may_act(self, now: float) -> bool:
        return not self.lost and now < self.deadline()

    def renewed(self, sent_at: float, remaining_ttl_s: float) -> None:
        """A keepalive sent at SENT_AT answered with the lease's TTL (0: etcd has no such
        lease any more: leadership is over)."""
        if self.lost:
            return
        if remaining_ttl_s <= 0:
            self.lose("the lease expired in etcd")
            return
        if sent_at > self.renewed_at:  # answers may arrive out of order; the latest send counts
            self.renewed_at = sent_at
            self.ttl_s = min(self.ttl_s, float(remaining_ttl_s))

    def lose(self, reason: str) -> None:
        if not self.lost:
            self.lost = reason

    def why_not(self, now: float) -> str:
        """Why this leader may not act now ("" when it may)."""
        if self.lost:
            return self.lost
        if now >= self.deadline():
            return (f"the lease was last renewed {now - self.renewed_at:.1f} s ago (TTL {self.ttl_s:g} s, "
                    f"margin {self.margin_s:g} s)")
        return ""
