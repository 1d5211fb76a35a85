"""Readers' releases queued on the node (kvfs.node.releases): the bookkeeping alone."""

from __future__ import annotations

from kvfs.node.releases import PendingReleases


def test_one_flush_is_scheduled_per_burst_and_an_open_carries_at_most_its_share() -> None:
    pending = PendingReleases()
    assert pending.add(7) is True  # the first release of a burst schedules the flush
    assert pending.add(7) is False and pending.add(9) is False  # one entry per handle, none scheduled again
    assert pending.take(limit=2) == [7, 7]
    assert pending.take() == [9] and pending.take() == []
    pending.flushing = False  # the flush ended
    assert pending.add(3) is True


def test_a_registration_makes_what_is_pending_moot() -> None:
    pending = PendingReleases()
    pending.add(1)
    pending.add(2)
    before = pending.generation
    pending.forget()  # the registration reported only the handles still open
    assert len(pending) == 0 and pending.take() == []
    assert pending.generation == before + 1  # a flush holding releases taken before it sends none of them


def test_a_flush_takes_only_the_releases_no_open_took_within_the_delay() -> None:
    """While loads follow each other, every release rides on the next open: the flush sends
    only those that waited DELAY_S, not the ones queued a moment ago."""
    from kvfs.node.releases import DELAY_S

    pending = PendingReleases()
    assert pending.add(1, now=10.0) is True
    pending.add(2, now=10.0 + DELAY_S / 2)
    assert pending.oldest() == 10.0
    assert pending.take_due(10.0 + DELAY_S - DELAY_S) == [1]  # at 10 + DELAY_S: only the first is due
    assert pending.oldest() == 10.0 + DELAY_S / 2 and len(pending) == 1
    assert pending.take_due(9.0) == []
    assert pending.take() == [2] and pending.oldest() is None
