"""kvfs.node.misses: a miss the master answered answers that name again, and a temp name in
a directory the master found to hold none, for a second after it was asked; never after a
change of this node in the directory, nor from an answer that may predate one."""

from __future__ import annotations

from kvfs.node.misses import KEPT, RecentMisses, adds_temp_name
from kvfs.wire import messages as m

TMP = b".tmp"


def test_the_missed_name_and_temp_names_are_absent_for_the_window() -> None:
    misses = RecentMisses(TMP)
    misses.missed(5, b"a.bin", asked=100.0, token=misses.token())
    assert misses.absent(5, b"a.bin", now=100.5)  # the rename target's lookup after access()
    assert misses.absent(5, b"a.bin_123.tmp", now=100.5)  # the exclusive create's lookup
    assert not misses.absent(5, b"b.bin", now=100.5)  # any other name asks the master
    assert not misses.absent(6, b"a.bin", now=100.5)  # so does any other directory
    assert not misses.absent(5, b"a.bin", now=101.0)  # a second after it was asked: no longer
    assert not misses.absent(5, b"a.bin_123.tmp", now=100.5)  # (the mark went)
    assert misses.answered == 2


def test_temp_names_are_not_answered_without_a_temp_suffix() -> None:
    without_suffix = RecentMisses(b"")  # (a single-node mount has no private temp files)
    without_suffix.missed(5, b"a.bin", asked=0.0, token=0)
    assert without_suffix.absent(5, b"a.bin", now=0.1)
    assert not without_suffix.absent(5, b"x.tmp", now=0.1)


def test_a_change_of_this_node_in_the_directory_drops_the_mark() -> None:
    misses = RecentMisses(TMP)
    for request in (m.Create(5, b"a.bin", 0o644, 0, 0, 1, True), m.MkDir(5, b"a.bin", 0o755, 0, 0),
                    m.Rename(9, b"x", 5, b"a.bin", False)):
        misses.missed(5, b"a.bin", asked=0.0, token=misses.token())
        misses.missed(6, b"a.bin", asked=0.0, token=misses.token())
        misses.changed_request(request)
        assert not misses.absent(5, b"a.bin", now=0.1), request
        assert misses.absent(6, b"a.bin", now=0.1)  # another directory keeps its mark


def test_an_answer_that_may_predate_a_change_marks_nothing() -> None:
    misses = RecentMisses(TMP)
    token = misses.token()  # the Lookup is sent
    misses.changed(5)  # a change in the directory begins (or is answered) before the answer is applied
    misses.missed(5, b"a.bin", asked=0.0, token=token)
    assert not misses.absent(5, b"a.bin", now=0.1)
    misses.missed(6, b"a.bin", asked=0.0, token=token)  # a change elsewhere does not matter
    assert misses.absent(6, b"a.bin", now=0.1)


def test_marks_are_bounded() -> None:
    misses = RecentMisses(TMP)
    for ino in range(KEPT + 1):
        misses.missed(ino, b"a", asked=0.0, token=misses.token())
    assert not misses.absent(0, b"a", now=0.1)  # the oldest went
    assert misses.absent(KEPT, b"a", now=0.1)
    for ino in range(4 * KEPT + 1):  # the changes' record is bounded too: older tokens are refused
        misses.changed(ino)
    misses.missed(1, b"a", asked=0.0, token=0)
    assert not misses.absent(1, b"a", now=0.1)


def test_an_absence_answered_from_a_mark_is_not_cached_by_the_kernel() -> None:
    misses = RecentMisses(TMP)
    misses.missed(5, b"a.bin", asked=0.0, token=misses.token())
    assert not misses.uncached(5, b"a.bin")  # the master's own answer: the kernel caches it as always
    assert misses.absent(5, b"a.bin", now=0.1)
    assert not misses.uncached(5, b"b.bin")
    assert misses.uncached(5, b"a.bin")  # answered from the mark: entry timeout 0
    assert not misses.uncached(5, b"a.bin")  # once


def test_the_changes_that_make_a_temp_name_known_to_the_master() -> None:
    adds = [m.Create(5, b"a.tmp", 0o644, 0, 0, 1, False), m.MkDir(5, b"d.tmp", 0o755, 0, 0),
            m.Symlink(5, b"l.tmp", b"t", 0, 0), m.Rename(5, b"a", 6, b"b.tmp", False),
            m.Publish(5, b"h.tmp", 1, 7, 8, 0o644, 0, 0, 0, [], 0, 0)]
    assert all(adds_temp_name(request, TMP) for request in adds)
    others = [m.Create(5, b"a.bin", 0o644, 0, 0, 1, False), m.Rename(5, b"a.tmp", 6, b"b", False),
              m.Unlink(5, b"a.tmp"), m.Publish(5, b"h.bin", 1, 7, 8, 0o644, 0, 0, 0, [], 0, 0)]
    assert not any(adds_temp_name(request, TMP) for request in others)
    assert not adds_temp_name(adds[0], b"")
