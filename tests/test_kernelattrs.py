"""kvfs.node.kernelattrs: a directory's attributes answer the kernel's getattr after a private
temp file's change only, once, for what was left of the kernel's own timeout, and never after a
change of the directory went to the master."""

from __future__ import annotations

import stat

from kvfs.node.kernelattrs import KEPT, KernelDirAttrs
from kvfs.wire import messages as m


def directory(ino: int, mtime_ns: int = 1) -> m.Attr:
    return m.Attr(ino, stat.S_IFDIR | 0o755, 2, 0, 0, 0, 0, mtime_ns, mtime_ns)


def test_answers_after_a_private_change_with_the_time_left() -> None:
    kept = KernelDirAttrs()
    kept.handed(directory(5, mtime_ns=7), now=100.0)
    assert kept.answer(5, now=101.0, timeout_s=60.0) is None  # no private change: the kernel asks the master
    kept.private_change(5)
    attr, left = kept.answer(5, now=110.0, timeout_s=60.0)
    assert (attr.ino, attr.mtime_ns, left) == (5, 7, 50.0)
    assert kept.answer(5, now=110.0, timeout_s=60.0) is None  # once per change
    kept.private_change(5)
    assert kept.answer(5, now=160.0, timeout_s=60.0) is None  # the kernel's copy would have expired


def test_a_change_sent_to_the_master_drops_the_directory() -> None:
    kept = KernelDirAttrs()
    kept.handed(directory(5), now=0.0)
    kept.handed(directory(6), now=0.0)
    kept.changed_request(m.MkDir(5, b"sub", 0o755, 0, 0))
    kept.private_change(5)
    kept.private_change(6)
    assert kept.answer(5, now=1.0, timeout_s=60.0) is None
    assert kept.answer(6, now=1.0, timeout_s=60.0) is not None  # another directory is unaffected
    kept.private_change(6)
    kept.changed_request(m.Unlink(6, b"x"))  # armed, then changed: not answered
    assert kept.answer(6, now=1.0, timeout_s=60.0) is None


def test_a_rename_or_rmdir_drops_every_directory() -> None:
    for request in (m.Rename(7, b"a", 8, b"b", False), m.RmDir(7, b"a")):
        kept = KernelDirAttrs()
        kept.handed(directory(5), now=0.0)
        kept.changed_request(request)
        kept.private_change(5)
        assert kept.answer(5, now=1.0, timeout_s=60.0) is None


def test_a_directory_never_handed_is_not_answered() -> None:
    kept = KernelDirAttrs()
    kept.private_change(9)
    assert kept.answer(9, now=0.0, timeout_s=60.0) is None


def test_attributes_that_came_with_a_change_answer_once_within_the_timeout_from_the_answer() -> None:
    kept = KernelDirAttrs()
    kept.change_answered([directory(5, mtime_ns=9)], now=100.0)  # a mkdir in 5 answered at 100 s
    attr, left = kept.answer(5, now=130.0, timeout_s=60.0)  # the store's walk, 30 s later
    assert (attr.ino, attr.mtime_ns, left) == (5, 9, 30.0)
    assert kept.answer(5, now=130.0, timeout_s=60.0) is None  # the kernel holds them now
    kept.private_change(5)  # a temp file there: the same attributes, from the same answer
    assert kept.answer(5, now=140.0, timeout_s=60.0)[1] == 20.0
    kept.change_answered([directory(6)], now=100.0)
    assert kept.answer(6, now=160.0, timeout_s=60.0) is None  # as old as the kernel would keep them
    kept.change_answered([directory(7)], now=100.0)
    kept.changed_request(m.Unlink(7, b"x"))  # a later change of this node there
    assert kept.answer(7, now=101.0, timeout_s=60.0) is None
    kept.change_answered([directory(7)], now=100.0)
    kept.changed_request(m.RmDir(8, b"x"))  # one that may have moved any directory
    assert kept.answer(7, now=101.0, timeout_s=60.0) is None


def test_attributes_dropped_with_the_oldest_handed_past_the_bound() -> None:
    kept = KernelDirAttrs()
    kept.change_answered([directory(ino) for ino in range(1, KEPT + 2)], now=0.0)
    assert len(kept._armed) == KEPT
    assert kept.answer(1, now=1.0, timeout_s=60.0) is None  # pushed out with the oldest
    assert kept.answer(KEPT + 1, now=1.0, timeout_s=60.0) is not None
