"""What a node resolves without the master (kvfs.node.heldnames, pure): names the master
answered, followed through renames, only while the node still has what they name, and
bounded with the least recently used going first."""

from __future__ import annotations

import stat

from kvfs.node.heldnames import HeldNames
from kvfs.wire import messages as m


def attr(ino: int, mode: int = stat.S_IFREG | 0o644) -> m.Attr:
    return m.Attr(ino=ino, mode=mode, nlink=1, uid=0, gid=0, size=0, atime_ns=0, mtime_ns=0, ctime_ns=0)


def test_names_resolve_as_last_seen_while_what_they_name_is_held() -> None:
    names = HeldNames(limit=3)
    held = {2: attr(2, stat.S_IFDIR | 0o755), 5: attr(5)}
    names.seen(1, b"model", held[2])
    names.seen(2, b"block.bin.tmp", held[5])
    names.moved(2, b"block.bin.tmp", 2, b"block.bin")  # published
    names.seen(2, b"elsewhere.bin", attr(9))  # a file another node stores
    assert names.answer(1, b"model", held.get) == held[2]
    assert names.answer(2, b"block.bin", held.get) == held[5]
    assert names.answer(2, b"block.bin.tmp", held.get) is None
    assert names.answer(2, b"elsewhere.bin", held.get) is None  # not held here: the master must answer
    names.moved(2, b"never-seen.tmp", 2, b"block.bin")  # replaced by a file this node never resolved
    assert names.answer(2, b"block.bin", held.get) is None


def test_the_least_recently_used_names_go_first() -> None:
    names = HeldNames(limit=2)
    held = {i: attr(i) for i in range(10)}
    names.seen(1, b"a", held[2])
    names.seen(1, b"b", held[3])
    assert names.answer(1, b"a", held.get) is not None  # a is used: b is now the oldest
    names.seen(1, b"c", held[4])
    assert names.answer(1, b"b", held.get) is None
    assert names.answer(1, b"a", held.get) is not None and names.answer(1, b"c", held.get) is not None
