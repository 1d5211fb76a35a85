"""kvfs.node.dircache.DirectoryCache (pure): which directories a first lookup may copy, and
that past the bound an eighth of the names goes at once (one Unwatch for many directories)."""

from __future__ import annotations

from kvfs.node.dircache import LOOKUPS_BEFORE_COPY, DirectoryCache


def test_only_a_directory_never_asked_about_is_unasked() -> None:
    cache = DirectoryCache(max_names=100)
    assert cache.unasked(5)
    copy_now = cache.asked(5)  # a lookup the master answered counts
    assert copy_now == (LOOKUPS_BEFORE_COPY == 1) and not cache.unasked(5)
    cache.store(6, [b"a"])
    assert not cache.unasked(6) and cache.absent(6, b"b") and not cache.absent(6, b"a")
    cache.too_large(7)
    assert not cache.unasked(7)


def test_past_the_bound_an_eighth_goes_at_once() -> None:
    cache = DirectoryCache(max_names=64)
    for ino in range(1, 65):  # one name each: exactly at the bound, nothing dropped
        assert cache.store(ino, [b"x"]) == []
    assert cache.total == 64
    dropped = cache.store(65, [b"x"])
    assert dropped == list(range(1, 10))  # the least recently used, down to 56 names
    assert cache.total == 56 and 65 in cache and 1 not in cache
    assert cache.store(66, [b"x"]) == []  # room again: the next copies drop nothing
