"""A node's copies of directory entries: answers, pushed changes, the size bound (pure)."""

from kvfs.wire import messages as m
from kvfs.node.dircache import LOOKUPS_BEFORE_COPY, DirectoryCache


def test_misses_are_answered_once_the_names_are_copied() -> None:
    cache = DirectoryCache(max_names=100)
    assert not cache.absent(5, b"a")  # nothing copied: ask the master
    assert [cache.asked(5) for _ in range(LOOKUPS_BEFORE_COPY)][-1]
    cache.store(5, [b"x", b"y"])
    assert cache.absent(5, b"a") and not cache.absent(5, b"x")
    cache.added(5, b"a")
    cache.removed(5, b"x")
    assert not cache.absent(5, b"a") and cache.absent(5, b"x")
    assert cache.total == 2 and cache.answered == 2
    assert not cache.asked(5)  # already copied


def test_the_least_recently_used_directories_go_first() -> None:
    cache = DirectoryCache(max_names=10)
    assert cache.store(1, [b"%d" % i for i in range(4)]) == []
    assert cache.store(2, [b"%d" % i for i in range(4)]) == []
    cache.absent(1, b"zz")  # directory 1 is now the more recently used
    assert cache.store(3, [b"%d" % i for i in range(4)]) == [2]
    assert 2 not in cache and 1 in cache and 3 in cache and cache.total == 8


def test_a_directory_over_the_bound_is_not_copied_or_asked_for_again() -> None:
    cache = DirectoryCache(max_names=3)
    assert cache.store(7, [b"a", b"b", b"c", b"d"]) == [7]
    assert 7 not in cache and not cache.asked(7)
    cache.store(8, [b"a"])
    cache.clear()
    assert len(cache) == 0 and cache.total == 0


def entry(ino: int, version: int) -> m.Entry:
    return m.Entry(m.Attr(ino, 0o100644, 1, 0, 0, 4096, 0, 0, 0, version, True), node=2, address="a:1", checksums=[7])


def test_present_names_are_answered_with_their_entry_until_a_push_changes_it() -> None:
    cache = DirectoryCache(max_names=100)
    assert cache.present(5, b"x") is None  # nothing copied: ask the master
    cache.store(5, [b"x", b"writing", b"sub"], [entry(10, 1), None, None])
    assert cache.present(5, b"x").attr.version == 1
    assert cache.present(5, b"writing") is None and not cache.absent(5, b"writing")  # exists: ask the master
    cache.added(5, b"x", None)  # a new version is being written: ask the master
    assert cache.present(5, b"x") is None and not cache.absent(5, b"x")
    cache.added(5, b"x", entry(10, 2))  # sealed
    assert cache.present(5, b"x").attr.version == 2
    cache.removed(5, b"x")
    assert cache.present(5, b"x") is None and cache.absent(5, b"x")
    assert cache.found == 2 and cache.total == 2
