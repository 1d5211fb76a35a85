"""A block's own name (`<64 hex>.bin`, or the 64 digits alone) kept as an int key
(kvfs.cluster.names) beside bytes keys in one directory: found, listed, renamed, saved and
loaded back as itself, through the real service and its lmdb state, and its key's hash
not the name's to choose."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from kvfs.cluster import names as names_module
from kvfs.cluster.master import MetadataService
from kvfs.cluster.names import pack, unpack
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.persist import MasterState
from kvfs.errors import MetadataError
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m
from test_packed_names import listing, service, store

DIGITS = bytes(range(0xA0, 0xC0)).hex().encode()
BLOCKS = [
    DIGITS + b".bin",
    DIGITS,  # the same digits alone: another key
    b"0" * 64 + b".bin",  # all zeros: the smallest int
    b"0" * 64,  # the int 0 before it is scattered
    b"f" * 64 + b".bin",  # the largest
    b"f" * 64,
]
NOT_BLOCKS = [  # names beside them that stay bytes (packed, or as they are)
    DIGITS + b".bin_123.tmp",  # its temp file
    DIGITS + b".binx",
    DIGITS + b".bi",
    DIGITS + b".",
    DIGITS + b".BIN",
    DIGITS[:62] + b".bin",  # 62 digits
    DIGITS + b"00.bin",  # 66 digits
    DIGITS.upper() + b".bin",  # uppercase: would come back lowercase
    DIGITS[:63] + b"g.bin",  # not hex
    b"x" + DIGITS[1:] + b".bin",
    b"plain",
]
NAMES = BLOCKS + NOT_BLOCKS


def test_block_names_are_ints_and_others_are_not() -> None:
    for name in NAMES:
        key = pack(name)
        assert unpack(key) == name and pack(key) is key
        assert (type(key) is int) == (name in BLOCKS), name
    assert len({pack(name) for name in NAMES}) == len(NAMES)
    assert all(pack(name).bit_length() <= 4 * 64 + 1 for name in BLOCKS)


def test_names_made_to_collide_in_an_ints_hash_do_not() -> None:
    """A plain int of the digits would hash alike for digits that differ by a multiple of
    2^61 - 1 (an int's hash is its value modulo that); the keys scattered do not."""
    modulus = (1 << 61) - 1
    first = int(DIGITS, 16) % (1 << 200)
    chosen = [b"%064x.bin" % (first + k * modulus) for k in range(64)]
    assert len({int(name[:64], 16) % modulus for name in chosen}) == 1  # made to collide
    assert len({hash(pack(name)) for name in chosen}) == len(chosen)


def test_through_the_service_renamed_saved_and_loaded_by_another_process(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    svc, node, directory = service()
    inos = {name: store(svc, directory, name, node) for name in NAMES}
    for name, ino in inos.items():
        assert svc.handle(m.Lookup(directory, name), node).attr.ino == ino
        with pytest.raises(MetadataError) as raised:
            svc.handle(m.Create(directory, name, 0o644, 0, 0, node, True), node)
        assert raised.value.errno == errno.EEXIST
    for page in (1, 4, 1000):
        assert listing(svc, directory, node, page) == NAMES
    # Publish (temp over block), block -> plain, plain -> block, across directories.
    other = svc.handle(m.MkDir(ROOT_INO, b"e", 0o755, 0, 0), node).ino
    svc.handle(m.Rename(directory, NOT_BLOCKS[0], directory, BLOCKS[0]), node)
    assert svc.handle(m.Lookup(directory, BLOCKS[0]), node).attr.ino == inos[NOT_BLOCKS[0]]
    svc.handle(m.Rename(directory, BLOCKS[1], other, b"moved"), node)
    svc.handle(m.Rename(directory, b"plain", other, BLOCKS[1]), node)
    assert svc.handle(m.Lookup(other, BLOCKS[1]), node).attr.ino == inos[b"plain"]
    assert svc.handle(m.Lookup(directory, BLOCKS[1]), node).attr is None
    with pytest.raises(MetadataError) as raised:  # noreplace onto a block name
        svc.handle(m.Rename(other, b"moved", directory, BLOCKS[2], True), node)
    assert raised.value.errno == errno.EEXIST
    svc.handle(m.Unlink(directory, BLOCKS[4]), node)
    expected = {directory: [n for n in NAMES if n not in (NOT_BLOCKS[0], BLOCKS[1], BLOCKS[4], b"plain")],
                other: [b"moved", BLOCKS[1]]}
    expected[directory].remove(BLOCKS[0])
    expected[directory].append(BLOCKS[0])  # (a rename's entry is new: listed last)
    for parent, listed in expected.items():
        assert listing(svc, parent, node, 3) == listed
    found = {parent: [svc.ns.existing(parent, name).ino for name in listed] for parent, listed in expected.items()}
    state = MasterState(tmp_path / "state")
    try:
        assert state.save(svc)
        with state.env.begin() as txn:  # the records hold names, never keys
            values = b"".join(bytes(value) for _, value in txn.cursor(db=state._inodes))
        assert all(name in values for listed in expected.values() for name in listed)
        # A restarted master draws another scatter: the names load as themselves all the same.
        monkeypatch.setattr(names_module, "_SCATTER", 3)
        monkeypatch.setattr(names_module, "_GATHER", pow(3, -1, 1 << names_module._INT_BITS))
        monkeypatch.setattr(names_module, "_last", (b"", b""))
        fresh = MetadataService(svc.clock, LruPolicy(), svc.settings)
        state.load(fresh)
    finally:
        state.close()
    for parent, listed in expected.items():
        loaded = fresh.ns.inodes[parent]
        assert [name for name, _, _ in fresh.ns.listing(loaded, 0, 100)] == list(loaded.children) == listed  # type: ignore[arg-type]
        assert [fresh.ns.existing(parent, name).ino for name in listed] == found[parent]
