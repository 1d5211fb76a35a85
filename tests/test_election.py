"""kvfs.cluster.election: when a leader may act, on a clock the test moves."""

from __future__ import annotations

import pytest

from kvfs.cluster.election import Leadership, default_margin, renew_interval


def test_acts_until_ttl_minus_margin_after_the_last_renewal_sent() -> None:
    lead = Leadership(lease=7, epoch=42, ttl_s=3.0, renewed_at=100.0)
    assert lead.margin_s == default_margin(3.0) == 0.25
    assert lead.may_act(100.0) and lead.may_act(102.74)
    assert not lead.may_act(102.75)
    assert "renewed 2.8 s ago" in lead.why_not(102.8)
    lead.renewed(sent_at=102.0, remaining_ttl_s=3)
    assert lead.may_act(104.7) and not lead.may_act(104.75)
    assert lead.epoch == 42 and lead.why_not(103.0) == ""


def test_a_frozen_leader_may_not_act_when_it_resumes() -> None:
    lead = Leadership(lease=1, epoch=5, ttl_s=3.0, renewed_at=10.0)
    # SIGSTOP at 10.5, SIGCONT at 30: the monotonic clock moved on meanwhile.
    assert not lead.may_act(30.0)
    # A renewal answered afterwards that was sent before the freeze does not revive it ...
    lead.renewed(sent_at=10.4, remaining_ttl_s=3)
    assert not lead.may_act(30.0)


def test_an_older_answer_does_not_move_the_deadline_back() -> None:
    lead = Leadership(lease=1, epoch=5, ttl_s=3.0, renewed_at=10.0)
    lead.renewed(sent_at=12.0, remaining_ttl_s=3)
    lead.renewed(sent_at=11.0, remaining_ttl_s=3)
    assert lead.deadline() == 14.75


def test_expired_lease_or_lost_fence_ends_it_for_good() -> None:
    lead = Leadership(lease=1, epoch=5, ttl_s=3.0, renewed_at=10.0)
    lead.renewed(sent_at=11.0, remaining_ttl_s=0)
    assert not lead.may_act(11.0) and lead.why_not(11.0) == "the lease expired in etcd"
    lead.renewed(sent_at=12.0, remaining_ttl_s=3)  # too late: leadership does not come back
    assert not lead.may_act(12.0)
    fenced = Leadership(lease=2, epoch=9, ttl_s=3.0, renewed_at=0.0)
    fenced.lose("a write was fenced: another master leads")
    fenced.lose("later reason")
    assert fenced.why_not(0.0) == "a write was fenced: another master leads"


def test_margin_and_interval() -> None:
    assert renew_interval(3.0) == 0.25
    assert default_margin(60.0) == 0.5
    with pytest.raises(ValueError):
        Leadership(lease=1, epoch=1, ttl_s=1.0, renewed_at=0.0, margin_s=1.0)
