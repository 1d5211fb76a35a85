"""kvfs.cluster.election: a leader whose renewals go unanswered pauses, resumes when one is
answered (and its owner saw the key still its own), and steps down past the limit; on a
clock the test moves."""

from __future__ import annotations

from kvfs.cluster.election import Leadership, default_pause_limit


def lead() -> Leadership:
    return Leadership(lease=7, epoch=42, ttl_s=3.0, renewed_at=100.0)  # deadline 102.75


def test_the_deadline_passed_unrenewed_pauses_and_a_later_renewal_resumes_at_the_same_epoch() -> None:
    leader = lead()
    assert not leader.pause(102.7) and leader.paused_since is None
    assert leader.pause(102.8) and not leader.pause(102.9)  # entered once
    assert leader.paused_since == 102.75 and not leader.may_act(102.8)
    assert "paused for 0.2 s" in leader.why_not(102.95)
    leader.renewed(sent_at=104.0, remaining_ttl_s=4, answered_at=104.1)
    assert not leader.may_act(104.2)  # the lease lives, but the key is not checked yet
    assert leader.resume(104.2) and leader.may_act(104.2)
    assert leader.epoch == 42 and not leader.lost and leader.paused_since is None
    assert leader.deadline() == 106.75


def test_a_renewal_answered_after_the_deadline_pauses_even_if_nothing_looked() -> None:
    leader = lead()
    leader.renewed(sent_at=101.0, remaining_ttl_s=3, answered_at=103.0)  # it hung past 102.75
    assert leader.paused_since == 102.75 and not leader.may_act(103.1)
    assert leader.resume(103.1) and leader.may_act(103.1)
    on_time = lead()
    on_time.renewed(sent_at=101.0, remaining_ttl_s=3, answered_at=101.5)
    assert on_time.paused_since is None and on_time.may_act(103.0)


def test_no_resume_past_the_deadline_or_after_the_lease_ended() -> None:
    leader = lead()
    leader.pause(103.0)
    assert not leader.resume(103.0)  # no renewal moved the deadline on
    leader.renewed(sent_at=103.5, remaining_ttl_s=0, answered_at=103.6)  # etcd: no such lease
    assert leader.lost == "the lease expired in etcd"
    leader.renewed(sent_at=103.7, remaining_ttl_s=3, answered_at=103.8)
    assert not leader.resume(103.9) and not leader.may_act(103.9)


def test_a_pause_past_its_limit_is_over() -> None:
    leader = lead()
    assert leader.pause_limit_s == default_pause_limit(3.0) == 9.0
    leader.pause(102.8)
    assert not leader.pause_over(111.7)
    assert leader.pause_over(111.75)  # three TTLs after the deadline
    never_paused = lead()
    assert not never_paused.pause_over(1000.0)  # (its watch pauses it first)
