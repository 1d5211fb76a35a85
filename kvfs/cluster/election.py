"""The leader's view of its etcd lease (pure; the clock is passed in).

A master leads while the lease holding the leader key lives. etcd ends the lease
`ttl_s` after its last renewal; the leader counts from when it *sent* that renewal
(earlier than etcd received it), so its own deadline falls before etcd's. It acts
(answers a request, writes state) only until `ttl_s - margin_s` after that: the margin
covers the time between a check and the act. A leader frozen (SIGSTOP, a long pause)
past its deadline finds, on the monotonic clock, that it may no longer act, before
it sends anything; a write racing that is refused by etcd, fenced on the epoch.

When no renewal is answered by its deadline (etcd unreachable, or electing a leader of
its own), the leader *pauses* rather than giving up: it may not act, but it keeps its
state and its epoch. A renewal answered later proves the lease alive; once the owner has
also seen the leader key still hold this lease and epoch, `resume` lets it act again,
with its state current (nobody else could lead while its key existed). A pause longer
than `pause_limit_s` ends the leadership (see `pause_over`).

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
    election timeout 1 s) an etcd election of up to 2.5 s goes unnoticed; a longer one
    pauses the leader (see Leadership), which resumes once etcd answers."""
    return ttl_s / 12


def default_pause_limit(ttl_s: float) -> float:
    """How long a paused leader waits for a renewal before it steps down: three TTLs. It
    covers etcd's quorum lost for about a TTL and etcd's election once it returns, during
    which etcd lets no lease expire: one to two election timeouts (1-2 s by default), but
    several rounds on etcd 3.4 without --pre-vote (its default), whose member left alone
    raised its term meanwhile and disrupts the others when they return (5 s measured on
    a loaded host). Longer, the outage is no blip: had etcd had a leader all along (this
    master cut off from it), the lease ended long ago and a standby leads."""
    return 3 * ttl_s


@dataclass
class Leadership:
    lease: int  # the etcd lease id
    epoch: int  # the leader key's create_revision
    ttl_s: float
    renewed_at: float  # monotonic time the last successful renewal (or the grant) was sent
    margin_s: float = -1.0  # default_margin(ttl_s) unless given
    lost: str = ""  # why leadership ended ("" while it holds)
    paused_since: float | None = None  # monotonic time the deadline passed unrenewed (None: not paused)
    pause_limit_s: float = -1.0  # default_pause_limit(ttl_s) unless given

    def __post_init__(self) -> None:
        if self.margin_s < 0:
            self.margin_s = default_margin(self.ttl_s)
        if self.pause_limit_s < 0:
            self.pause_limit_s = default_pause_limit(self.ttl_s)
        if not 0 <= self.margin_s < self.ttl_s:
            raise ValueError(f"lease margin {self.margin_s} s must be below the TTL {self.ttl_s} s")

    def deadline(self) -> float:
        """The monotonic time after which this leader must not act."""
        return self.renewed_at + self.ttl_s - self.margin_s

    def may_act(self, now: float) -> bool:
        return not self.lost and self.paused_since is None and now < self.deadline()

    def renewed(self, sent_at: float, remaining_ttl_s: float, answered_at: float | None = None) -> None:
        """A keepalive sent at SENT_AT answered (at ANSWERED_AT) with the lease's TTL (0: etcd
        has no such lease any more: leadership is over). An answer that came after the
        deadline pauses the leader first (if nothing noticed the deadline pass yet): the
        renewal proves the lease alive, not that the leader key is still this leader's."""
        if self.lost:
            return
        if remaining_ttl_s <= 0:
            self.lose("the lease expired in etcd")
            return
        if answered_at is not None:
            self.pause(answered_at)
        if sent_at > self.renewed_at:  # answers may arrive out of order; the latest send counts
            self.renewed_at = sent_at
            self.ttl_s = min(self.ttl_s, float(remaining_ttl_s))

    def pause(self, now: float) -> bool:
        """Enters the pause once the deadline has passed unrenewed; True when this call did."""
        if self.lost or self.paused_since is not None or now < self.deadline():
            return False
        self.paused_since = self.deadline()  # it has not been allowed to act since then
        return True

    def pause_over(self, now: float) -> bool:
        """Whether the pause has outlasted its limit (the owner then steps down)."""
        return self.paused_since is not None and now >= self.paused_since + self.pause_limit_s

    def resume(self, now: float) -> bool:
        """Ends the pause, once a renewal moved the deadline on and the owner saw the leader
        key still hold this lease and epoch; False when it may not (still past the deadline,
        or leadership lost)."""
        if self.lost or self.paused_since is None or now >= self.deadline():
            return False
        self.paused_since = None
        return True

    def lose(self, reason: str) -> None:
        if not self.lost:
            self.lost = reason

    def why_not(self, now: float) -> str:
        """Why this leader may not act now ("" when it may)."""
        if self.lost:
            return self.lost
        if self.paused_since is not None:
            return (f"paused for {now - self.paused_since:.1f} s: no lease renewal answered in time (TTL "
                    f"{self.ttl_s:g} s, margin {self.margin_s:g} s)")
        if now >= self.deadline():
            return (f"the lease was last renewed {now - self.renewed_at:.1f} s ago (TTL {self.ttl_s:g} s, "
                    f"margin {self.margin_s:g} s)")
        return ""
