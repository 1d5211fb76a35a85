"""The store's residency state machine with plain values and a clock that moves only when told."""

from __future__ import annotations

import errno

import pytest

from kvfs.clock import ManualClock
from kvfs.errors import StorageError
from kvfs.policy import LruPolicy
from kvfs.store.residency import RETRY_MAX_S, RETRY_MIN_S, Backoff, IllegalTransition, Residency, State


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def books(clock: ManualClock) -> Residency:
    return Residency(LruPolicy(), clock.monotonic)


def consistent(books: Residency) -> Residency:
    assert books.problems() == []
    return books


def offload(books: Residency, version: int) -> None:
    """The offloader's whole way for one version: queued, copied, committed, checked, reported."""
    books.queue(version)
    assert books.take_batch(16, 1 << 30) == [version]
    books.start_offload(version)
    books.committed(version)
    assert books.finish_offload(version) is False
    books.saved(version)
    books.reported(version)


def test_a_version_goes_from_dram_only_to_demoted_and_back(books: Residency) -> None:
    books.seal(1, 100, [7])
    assert books.state(1) is State.DRAM_ONLY and books.dram_only_bytes == 100
    books.queue(1)
    assert books.state(1) is State.QUEUED
    assert books.take_batch(16, 1 << 30) == [1]
    books.start_offload(1)
    assert books.state(1) is State.OFFLOADING
    books.committed(1)
    assert books.finish_offload(1) is False
    assert books.state(1) is State.UNSETTLED and not books.is_saved(1)
    books.saved(1)
    assert books.state(1) is State.ON_SSD and books.is_saved(1)
    assert books.dram_only_bytes == 100  # until the master knows
    books.reported(1)
    assert books.dram_only_bytes == 0
    assert books.demote_one() == 1
    assert books.state(1) is State.DEMOTED and books.entry(1).in_dram is False  # type: ignore[union-attr]
    assert books.touch_on_ssd(1) == 1 and books.touch_on_ssd(1) == 2
    books.begin_promote(1)
    assert books.state(1) is State.PROMOTING and books.pinned(1)
    assert books.end_promote(1) is True
    assert books.state(1) is State.ON_SSD and books.pinned(1)  # pinned for the reader that promoted it
    assert books.unpin(1) is False
    consistent(books)


def test_illegal_transitions_are_refused(books: Residency) -> None:
    books.seal(1, 10, [0])
    with pytest.raises(IllegalTransition):
        books.seal(1, 10, [0])
    with pytest.raises(IllegalTransition):
        books.queue(2)  # never sealed here
    with pytest.raises(IllegalTransition):
        books.finish_offload(1)  # not being copied
    books.start_offload(1)
    with pytest.raises(IllegalTransition):
        books.start_offload(1)
    assert books.queue(1) is False  # a copy is in flight: not queued twice
    with pytest.raises(IllegalTransition):
        books.unpin(1)
    with pytest.raises(IllegalTransition):
        books.release_disk(1)
    with pytest.raises(IllegalTransition):
        books.begin_promote(1)  # it is in DRAM
    assert books.state(1) is State.OFFLOADING
    consistent(books)


def test_demotion_takes_the_least_recently_used_saved_unpinned_copy(books: Residency, clock: ManualClock) -> None:
    for version in (1, 2, 3, 4):
        books.seal(version, 10, [0])
        clock.advance(1)
    for version in (1, 2, 3):
        offload(books, version)
    books.pin(1)
    books.touch(2)  # 2 is now the most recently used
    assert books.demote_one() == 3  # 1 is pinned, 4 is DRAM-only
    assert books.demote_one() == 2
    assert books.demote_one() is None
    assert books.unpin(1) is False
    assert books.demote_one() == 1
    assert books.state(4) is State.DRAM_ONLY
    consistent(books)


def test_the_watermark_queues_least_valuable_dram_only_bytes_down_to_the_low_mark(books: Residency) -> None:
    for version in range(1, 11):
        books.seal(version, 100, [0])
    offload(books, 1)  # already on SSD: never queued again
    # 1000 of 1000 bytes used, high 0.9, low 0.5: 900 DRAM-only bytes, 400 to go.
    assert books.queue_for_watermark(used=1000, capacity=1000, high=0.9, low=0.5) == 4
    assert books.queued() == [2, 3, 4, 5]
    # Below the high watermark nothing happens.
    assert books.queue_for_watermark(used=900, capacity=1000, high=0.9, low=0.5) == 0
    assert books.queue_all_dram_only() == 5  # 6..10: the queued and the saved are skipped
    assert books.queued() == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    consistent(books)


def test_batches_are_bounded_and_skip_what_no_longer_needs_a_copy(books: Residency) -> None:
    for version in range(1, 6):
        books.seal(version, 40, [0])
        books.queue(version)
    books.drop(2)
    assert books.take_batch(max_files=2, max_bytes=1000) == [1, 3]
    assert books.take_batch(max_files=16, max_bytes=50) == [4, 5]  # stops once 50 bytes are reached
    assert books.queued() == []
    consistent(books)


def test_a_failed_copy_is_parked_and_retried_with_a_growing_delay(books: Residency, clock: ManualClock) -> None:
    books.seal(1, 10, [0])
    books.seal(2, 20, [0])
    books.queue(1)
    books.queue(2)
    batch = books.take_batch(16, 1 << 30)
    for version in batch:
        books.start_offload(version)
    for version in batch:
        books.finish_offload(version)
    books.park(batch)
    books.failed()
    assert books.state(1) is State.PARKED and books.parked_totals() == (2, 30)
    assert books.backlog() == (2, 30)
    assert books.retry_pending(index_failing=False)
    assert not books.retry_due() and books.retry_wait_s() == pytest.approx(RETRY_MIN_S)
    clock.advance(RETRY_MIN_S)
    assert books.retry_due()
    books.requeue_parked()
    assert books.queued() == [1, 2] and books.parked() == []
    books.failed()  # failed again: twice the delay
    assert books.retry_wait_s() == pytest.approx(2 * RETRY_MIN_S)
    books.retry_now()  # an fsync: at once
    assert books.retry_due()
    books.backoff.succeeded()
    books.failed()
    assert books.retry_wait_s() == pytest.approx(RETRY_MIN_S)
    consistent(books)


def test_the_backoff_doubles_up_to_its_maximum() -> None:
    backoff = Backoff()
    waits = []
    for _ in range(8):
        backoff.failed(now=100.0)
        waits.append(backoff.wait_s(100.0))
    assert waits[:3] == [RETRY_MIN_S, 2 * RETRY_MIN_S, 4 * RETRY_MIN_S]
    assert max(waits) == RETRY_MAX_S == waits[-1]


def test_a_parked_version_that_is_queued_again_leaves_the_parked_line(books: Residency) -> None:
    books.seal(1, 10, [0])
    books.park([1])
    assert books.state(1) is State.PARKED
    assert books.queue(1) is True  # an fsync asks for it now
    assert books.state(1) is State.QUEUED and books.parked() == []
    consistent(books)


def test_a_removal_waits_for_readers_of_the_ssd_copy(books: Residency) -> None:
    books.seal(1, 10, [0])
    offload(books, 1)
    books.hold_disk(1)
    assert books.drop(1) == (True, True)  # not pinned: DRAM freed now; its SSD copy is to go
    assert books.removals() == [1] and books.take_removals() == []  # being read: it waits
    assert books.release_disk(1) is True  # the last read ended: the reaper can go
    assert books.take_removals() == [1]
    assert books.removals() == []
    consistent(books)


def test_a_pinned_dram_copy_of_a_dropped_file_is_freed_by_its_last_user(books: Residency) -> None:
    books.seal(1, 10, [0])
    books.pin(1)
    books.pin(1)
    assert books.drop(1) == (False, False)
    assert books.state(1) is State.GONE
    assert books.unpin(1) is False
    assert books.unpin(1) is True  # now free it
    assert books.busy_versions() == {}
    consistent(books)


def test_a_file_dropped_while_copied_is_removed_from_ssd_after_its_commit(books: Residency) -> None:
    books.seal(1, 10, [0])
    books.queue(1)
    books.take_batch(16, 1 << 30)
    books.start_offload(1)
    assert books.drop(1) == (False, False)  # the copy reads its DRAM blocks: not freed yet
    assert books.dram_only_bytes == 0
    books.committed(1)
    assert books.finish_offload(1) is True  # it went meanwhile
    assert books.unsettle_dropped(1) is True  # free DRAM now, and remove the SSD copy
    assert books.removals() == [1]
    consistent(books)


def test_a_file_dropped_while_promoted_gives_its_blocks_back(books: Residency) -> None:
    books.adopt_recovered(1, 10, [0])
    assert books.state(1) is State.DEMOTED
    books.begin_promote(1)
    assert books.drop(1) == (False, True)
    assert books.end_promote(1) is False
    assert books.busy_versions() == {}
    books.adopt_recovered(2, 10, [0])
    books.begin_promote(2)
    books.promote_failed(2)  # a read error: readers go to the SSD
    assert books.state(2) is State.DEMOTED and not books.pinned(2)
    consistent(books)


def test_dram_only_bytes_count_each_sealed_version_until_reported_or_dropped(books: Residency) -> None:
    for version, size in ((1, 100), (2, 200), (3, 300)):
        books.seal(version, size, [0])
    assert books.dram_only_bytes == 600
    offload(books, 1)
    books.drop(2)
    assert books.dram_only_bytes == 300
    books.drop(1)  # already reported: not subtracted twice
    assert books.dram_only_bytes == 300
    books.committed(3)
    books.drop(3)  # dropped before it was reported
    books.reported(3)
    assert books.dram_only_bytes == 0
    assert books.unsaved() == (0, 0) and books.holdings() == []
    consistent(books)


def test_a_record_that_could_not_be_rewritten_is_unsaved_until_resettled(books: Residency) -> None:
    books.seal(1, 10, [0])
    offload(books, 1)
    books.needs_resettle(1, False)
    assert not books.is_saved(1) and books.resettles() == {1: False}
    assert books.unsaved() == (1, 10) and books.retry_pending(index_failing=False)
    books.resettled(1)
    books.saved(1)
    assert books.is_saved(1) and books.resettles() == {}
    consistent(books)


def test_a_version_not_stored_here_is_enoent(books: Residency) -> None:
    books.seal(1, 100, [7])
    assert books.stored(1).size == 100
    with pytest.raises(StorageError) as raised:
        books.stored(2)
    assert raised.value.errno == errno.ENOENT and "version 2" in str(raised.value)


def test_quarantine_is_reported_once(books: Residency) -> None:
    books.adopt_recovered(1, 10, [0])
    assert books.quarantine(1) is True
    assert books.quarantine(1) is False


def test_the_offloader_yields_to_a_burst_of_writes(books: Residency, clock: ManualClock) -> None:
    clock.advance(10)
    books.wrote()
    assert books.quiet_from() == pytest.approx(10.02)
    clock.advance(0.015)
    books.wrote()  # the burst goes on
    assert books.quiet_from() == pytest.approx(10.035)


def test_problems_name_books_that_contradict_themselves(books: Residency) -> None:
    books.seal(1, 10, [0])
    books.entry(1).dram_only = False  # type: ignore[union-attr]  # as a bookkeeping bug would
    assert any("DRAM-only bytes" in problem for problem in books.problems())
