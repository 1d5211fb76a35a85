"""Hex names kept packed in memory (kvfs.cluster.names): every name, packed or not, is
found, listed, renamed, saved and loaded back as itself, through the real service, its
lmdb state and a real mount."""

from __future__ import annotations

import errno
import gc
import os
import tracemalloc
from pathlib import Path

import pytest

from master_view import reloaded_view, saved_view
from kvfs.clock import ManualClock
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.names import pack, unpack
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.persist import MasterState
from kvfs.errors import MetadataError
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m

HASH = bytes(range(0x40, 0x60)).hex().encode()  # 64 lowercase hex digits (as bytes: no NUL, no "/")
PACKED = pack(HASH + b".bin_7.tmp")  # a key of bytes (a block's own name is an int: test_block_names)

NAMES = [
    HASH + b".bin",  # a KV-cache block: packed
    HASH + b".bin_8123456789012345678.tmp",  # its temp file: packed
    HASH,  # hex without a dot: packed
    HASH[:16],  # the shortest packed
    HASH[:14],  # shorter: kept as it is
    HASH[:63] + b".bin",  # odd length: kept as it is
    HASH.upper() + b".bin",  # uppercase: kept as it is (packed, it would come back lowercase)
    HASH[:62] + b"Ab.bin",  # one uppercase digit
    HASH[:62] + b"g0.bin",  # not hex
    b"block-" + HASH + b".bin",  # hex inside: kept as it is
    PACKED[1:],  # another name's key without its NUL
    bytes.fromhex(HASH.decode()) + b".bin",  # another name's digits as bytes
    b".hidden" + HASH,  # the dot first
    HASH + b"." + HASH,  # packed up to the dot, the rest as it is
]
PACKED_NAMES = {*NAMES[:4], NAMES[-1]}


def service() -> tuple[MetadataService, int, int]:
    svc = MetadataService(ManualClock(), LruPolicy(), MasterSettings(cluster=True))
    node = svc.handle(m.Register("a", "a:1"), 0).node
    svc.handle(m.FinishRegistration(), node)
    directory = svc.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), node).ino
    return svc, node, directory


def store(svc: MetadataService, parent: int, name: bytes, node: int) -> int:
    opened = svc.handle(m.Create(parent, name, 0o644, 0, 0, node, True), node)
    svc.handle(m.Seal(opened.version, 4096, svc.clock.wall_ns(), [1], release=True), node)
    return opened.attr.ino


def listing(svc: MetadataService, directory: int, node: int, page: int) -> list[bytes]:
    names: list[bytes] = []
    start = 0
    while entries := svc.handle(m.ReadDir(directory, start, page), node).entries:
        names += [entry.name for entry in entries]
        start = entries[-1].next_id
    return names


def test_a_name_and_its_key_go_back_and_forth() -> None:
    for name in NAMES:
        key = pack(name)
        assert unpack(key) == name and pack(key) is key
        assert (key != name) == (name in PACKED_NAMES)
    assert len(PACKED) == 44 and PACKED[0] == 0  # a NUL, the count, 32 bytes, ".bin_7.tmp"
    assert pack(b"x" * 255) == b"x" * 255 and unpack(pack(b"ab" * 127)) == b"ab" * 127


def test_packed_and_plain_names_live_side_by_side() -> None:
    svc, node, directory = service()
    inos = {name: store(svc, directory, name, node) for name in NAMES}
    assert len(set(inos.values())) == len(NAMES)
    for name, ino in inos.items():
        assert svc.handle(m.Lookup(directory, name), node).attr.ino == ino
        with pytest.raises(MetadataError) as raised:
            svc.handle(m.Create(directory, name, 0o644, 0, 0, node, True), node)
        assert raised.value.errno == errno.EEXIST
    # A key is never a name: looked up or created, it is refused, not found.
    with pytest.raises(MetadataError) as raised:
        svc.handle(m.Lookup(directory, PACKED), node)
    assert raised.value.errno == errno.EINVAL
    with pytest.raises(MetadataError) as raised:
        svc.handle(m.Create(directory, PACKED, 0o644, 0, 0, node, True), node)
    assert raised.value.errno == errno.EINVAL
    # Listed in creation order, as names, on every page size.
    for page in (1, 3, len(NAMES), 1000):
        assert listing(svc, directory, node, page) == NAMES
    # Removed one by one, the others stay.
    for name in NAMES[::2]:
        svc.handle(m.Unlink(directory, name), node)
    assert listing(svc, directory, node, 2) == NAMES[1::2]
    assert all(svc.handle(m.Lookup(directory, name), node).attr is None for name in NAMES[::2])


def test_a_packed_name_costs_its_key_not_the_name() -> None:
    """Hex names and the same names in uppercase (kept as they are), everything the service
    keeps of them traced, the names' objects included: the keys are 40 B smaller (101 B
    objects, 112 allocated, against ints of 60 B, 64 allocated)."""
    per_file = {}
    for upper in (False, True):
        svc, node, directory = service()
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            names = [b"%064x.bin" % (i * 0x9E3779B97F4A7C15) for i in range(2000)]
            if upper:
                names = [name[:64].upper() + name[64:] for name in names]
            for name in names:
                store(svc, directory, name, node)
            del names
            svc.ns.dirty.clear()  # what the owner's save does
            svc.objects.dirty.clear()
            gc.collect()
            per_file[upper] = (tracemalloc.get_traced_memory()[0] - before) / 2000
        finally:
            tracemalloc.stop()
    assert per_file[True] - per_file[False] >= 28, per_file


def test_renames_between_the_two_forms() -> None:
    svc, node, directory = service()
    other = svc.handle(m.MkDir(ROOT_INO, b"e", 0o755, 0, 0), node).ino
    hexed, plain = HASH + b".bin", b"plain.bin"
    first = store(svc, directory, hexed, node)
    svc.handle(m.Rename(directory, hexed, directory, plain), node)  # packed -> plain
    assert svc.handle(m.Lookup(directory, hexed), node).attr is None
    assert svc.handle(m.Lookup(directory, plain), node).attr.ino == first
    svc.handle(m.Rename(directory, plain, other, HASH), node)  # plain -> packed, another directory
    assert svc.handle(m.Lookup(other, HASH), node).attr.ino == first
    assert listing(svc, directory, node, 10) == [] and listing(svc, other, node, 10) == [HASH]
    # A temp file renamed over its block's name (how writers publish), replacing it.
    temp = HASH + b".bin_42.tmp"
    old = store(svc, directory, hexed, node)
    new = store(svc, directory, temp, node)
    svc.handle(m.Rename(directory, temp, directory, hexed), node)
    assert svc.handle(m.Lookup(directory, hexed), node).attr.ino == new != old
    assert listing(svc, directory, node, 10) == [hexed]
    with pytest.raises(MetadataError) as raised:  # noreplace onto a packed name
        svc.handle(m.Rename(other, HASH, directory, hexed, True), node)
    assert raised.value.errno == errno.EEXIST


def test_the_saved_state_holds_the_names_and_loads_back(tmp_path: Path) -> None:
    """What is saved is unchanged (the records hold names), so a state saved before the
    packing loads as before."""
    svc, node, directory = service()
    for name in NAMES:
        store(svc, directory, name, node)
    state = MasterState(tmp_path / "state")
    try:
        assert state.save(svc)
        with state.env.begin() as txn:  # the records hold each name as it is, never a key
            values = b"".join(bytes(value) for _, value in txn.cursor(db=state._inodes))
        assert all(name in values for name in NAMES)
        assert b"\0\x20" + bytes.fromhex(HASH.decode()) not in values
        assert reloaded_view(svc, state) == saved_view(svc)
        fresh = MetadataService(svc.clock, LruPolicy(), svc.settings)
        state.load(fresh)
    finally:
        state.close()
    # (Its files show once their node registers again: the namespace itself is asked here.)
    loaded = fresh.ns.inodes[directory]
    assert [name for name, _, _ in fresh.ns.listing(loaded, 0, 100)] == list(loaded.children) == NAMES  # type: ignore[arg-type]
    assert [fresh.ns.existing(directory, name).ino for name in NAMES] == \
        [svc.ns.existing(directory, name).ino for name in NAMES]


def test_packed_names_through_a_mount(kvfs_dir: Path) -> None:
    for name in NAMES:
        (kvfs_dir / os.fsdecode(name)).write_bytes(name)
    assert sorted(os.listdir(os.fsencode(kvfs_dir))) == sorted(NAMES)
    for name in NAMES:
        assert (kvfs_dir / os.fsdecode(name)).read_bytes() == name
    block, temp = kvfs_dir / os.fsdecode(HASH + b".bin"), kvfs_dir / os.fsdecode(HASH + b".bin_7.tmp")
    temp.write_bytes(b"new")
    os.rename(temp, block)  # publish: packed over packed
    assert block.read_bytes() == b"new" and not temp.exists()
    os.rename(block, kvfs_dir / "plain")  # packed -> plain
    os.rename(kvfs_dir / "plain", kvfs_dir / os.fsdecode(HASH[:16]))  # plain -> packed, over an existing one
    assert (kvfs_dir / os.fsdecode(HASH[:16])).read_bytes() == b"new"
    left = set(NAMES) - {HASH + b".bin"}
    assert set(os.listdir(os.fsencode(kvfs_dir))) == left
    for name in left:
        os.unlink(kvfs_dir / os.fsdecode(name))
    assert os.listdir(kvfs_dir) == []
