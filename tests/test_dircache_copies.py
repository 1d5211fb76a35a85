"""kvfs.node.dircache.DirectoryCache (pure): which lookup copies a directory, and that past
the bound an eighth of the names goes at once (one Unwatch for many directories)."""

from __future__ import annotations

from kvfs.node.dircache import LOOKUPS_BEFORE_COPY, DirectoryCache


def test_the_lookup_that_copies_a_directory_is_the_second_one() -> None:
    """The first lookup in a directory asks the master (a reader looking up one name in a
    directory does not watch it); the next one is answered by copying the directory."""
    cache = DirectoryCache(max_names=100)
    assert LOOKUPS_BEFORE_COPY == 2
    assert not cache.copy_due(5)
    assert not cache.asked(5)  # the first lookup, answered by the master
    assert cache.copy_due(5)
    cache.store(5, [b"a"])
    assert not cache.copy_due(5) and cache.absent(5, b"b") and not cache.absent(5, b"a")
    cache.asked(7)
    cache.too_large(7)
    assert not cache.copy_due(7)


def test_past_the_bound_an_eighth_goes_at_once() -> None:
    cache = DirectoryCache(max_names=64)
    for ino in range(1, 65):  # one name each: exactly at the bound, nothing dropped
        assert cache.store(ino, [b"x"]) == []
    assert cache.total == 64
    dropped = cache.store(65, [b"x"])
    assert dropped == list(range(1, 10))  # the least recently used, down to 56 names
    assert cache.total == 56 and 65 in cache and 1 not in cache
    assert cache.store(66, [b"x"]) == []  # room again: the next copies drop nothing
