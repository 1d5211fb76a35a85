"""The metadata service, driven with plain requests and a manual clock (no mount)."""

import errno
import random
import stat

import pytest

from kvfs.clock import ManualClock
from kvfs.wire import messages as m
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.errors import MetadataError
from kvfs.policy import POLICIES, LruPolicy, make_policy

NODE = 1


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def master(clock: ManualClock) -> MetadataService:
    return MetadataService(clock, LruPolicy(), MasterSettings(temp_grace_s=60))


def fails(master: MetadataService, request: m.Request, code: int) -> None:
    with pytest.raises(MetadataError) as raised:
        master.handle(request)
    assert raised.value.errno == code


def store(master: MetadataService, parent: int, name: bytes, size: int = 10) -> m.Attr:
    """Creates, "writes" and seals a file the way a node does."""
    opened = master.handle(m.Create(parent, name, 0o644, 0, 0, NODE, exclusive=True))
    master.handle(m.Seal(opened.version, size, master.clock.wall_ns(), [123]))
    master.handle(m.Release(opened.version, writer=True))
    return master.handle(m.GetAttr(opened.attr.ino))


def test_create_lookup_and_exclusive(master: MetadataService) -> None:
    attr = store(master, ROOT_INO, b"a.bin", 4096)
    assert master.handle(m.Lookup(ROOT_INO, b"a.bin")).attr.size == 4096
    assert master.handle(m.Lookup(ROOT_INO, b"missing")).attr is None
    fails(master, m.Create(ROOT_INO, b"a.bin", 0o644, 0, 0, NODE, exclusive=True), errno.EEXIST)
    assert attr.nlink == 1 and attr.sealed


def test_names_are_validated(master: MetadataService) -> None:
    fails(master, m.Lookup(ROOT_INO, b"x" * 256), errno.ENAMETOOLONG)
    fails(master, m.MkDir(ROOT_INO, b"x" * 256, 0o755, 0, 0), errno.ENAMETOOLONG)
    fails(master, m.Lookup(ROOT_INO + 99, b"a"), errno.ENOENT)
    store(master, ROOT_INO, b"file")
    file_ino = master.handle(m.Lookup(ROOT_INO, b"file")).attr.ino
    fails(master, m.Lookup(file_ino, b"a"), errno.ENOTDIR)


def test_directories(master: MetadataService) -> None:
    d = master.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0))
    fails(master, m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), errno.EEXIST)
    store(master, d.ino, b"f")
    fails(master, m.RmDir(ROOT_INO, b"d"), errno.ENOTEMPTY)
    fails(master, m.Unlink(ROOT_INO, b"d"), errno.EISDIR)
    fails(master, m.RmDir(d.ino, b"f"), errno.ENOTDIR)
    master.handle(m.Unlink(d.ino, b"f"))
    master.handle(m.RmDir(ROOT_INO, b"d"))
    assert master.handle(m.Lookup(ROOT_INO, b"d")).attr is None


def test_rename_rules(master: MetadataService) -> None:
    a = master.handle(m.MkDir(ROOT_INO, b"a", 0o755, 0, 0))
    master.handle(m.MkDir(a.ino, b"sub", 0o755, 0, 0))
    master.handle(m.MkDir(ROOT_INO, b"empty", 0o755, 0, 0))
    store(master, ROOT_INO, b"f")
    store(master, ROOT_INO, b"g")
    fails(master, m.Rename(ROOT_INO, b"a", a.ino, b"x"), errno.EINVAL)  # into itself
    fails(master, m.Rename(ROOT_INO, b"f", ROOT_INO, b"a"), errno.EISDIR)
    fails(master, m.Rename(ROOT_INO, b"a", ROOT_INO, b"f"), errno.ENOTDIR)
    fails(master, m.Rename(ROOT_INO, b"empty", ROOT_INO, b"a"), errno.ENOTEMPTY)
    fails(master, m.Rename(ROOT_INO, b"f", ROOT_INO, b"g", noreplace=True), errno.EEXIST)
    fails(master, m.Rename(ROOT_INO, b"nope", ROOT_INO, b"g"), errno.ENOENT)
    g = master.handle(m.Lookup(ROOT_INO, b"g")).attr
    done = master.handle(m.Rename(ROOT_INO, b"f", ROOT_INO, b"g"))
    assert done.dropped == []  # the replaced file's bytes are freed once the kernel forgets it
    assert master.handle(m.Forget([g.ino])).dropped == [g.version]
    assert master.handle(m.Lookup(ROOT_INO, b"f")).attr is None
    master.handle(m.Rename(ROOT_INO, b"a", ROOT_INO, b"empty"))  # replaces an empty directory
    assert master.handle(m.Lookup(ROOT_INO, b"empty")).attr.ino == a.ino


def test_copy_on_write_keeps_readers_on_old_bytes(master: MetadataService) -> None:
    attr = store(master, ROOT_INO, b"f", 100)
    reader = master.handle(m.OpenRead(attr.ino))
    writer = master.handle(m.OpenWrite(attr.ino, NODE, truncate=False))
    assert writer.version != reader.version
    assert (writer.copy_from, writer.copy_size) == (reader.version, 100)
    assert writer.dropped == []
    assert master.handle(m.Release(writer.copy_from, writer=False)).dropped == []  # the reader still has it
    master.handle(m.Seal(writer.version, 50, 2, [1]))
    master.handle(m.Release(writer.version, writer=True))
    assert master.handle(m.GetAttr(attr.ino)).size == 50
    assert master.handle(m.Release(reader.version, writer=False)).dropped == [reader.version]


def test_second_writer_joins_unsealed_version(master: MetadataService) -> None:
    opened = master.handle(m.Create(ROOT_INO, b"f", 0o644, 0, 0, NODE, exclusive=True))
    again = master.handle(m.OpenWrite(opened.attr.ino, NODE, truncate=False))
    assert again.version == opened.version and again.copy_from == 0


def test_unlinked_open_file_lives_until_release(master: MetadataService) -> None:
    attr = store(master, ROOT_INO, b"f")
    reader = master.handle(m.OpenRead(attr.ino))
    assert master.handle(m.Unlink(ROOT_INO, b"f")).dropped == []
    fails(master, m.OpenRead(attr.ino), errno.ESTALE)
    assert master.handle(m.GetAttr(attr.ino)).nlink == 0  # the kernel still references it
    assert master.handle(m.Release(reader.version, writer=False)).dropped == [reader.version]
    master.handle(m.Forget([attr.ino]))
    fails(master, m.GetAttr(attr.ino), errno.ENOENT)


def test_reclaim_evicts_least_recently_used_and_skips_open_files(master: MetadataService, clock: ManualClock) -> None:
    attrs = [store(master, ROOT_INO, f"f{i}".encode(), 100) for i in range(4)]
    clock.advance(31)  # past the publish grace of files never renamed or read
    master.handle(m.Release(master.handle(m.OpenRead(attrs[0].ino)).version, writer=False))  # f0 is now recent
    held = master.handle(m.OpenRead(attrs[1].ino))  # f1 is open: not evictable
    removed = master.handle(m.Reclaim(NODE, 150))
    assert [name for _, name, _ in removed.entries] == [b"f2", b"f3"]
    assert removed.dropped == [attrs[2].version, attrs[3].version]
    assert master.handle(m.Lookup(ROOT_INO, b"f2")).attr is None
    removed = master.handle(m.Reclaim(NODE, 10_000))
    assert [name for _, name, _ in removed.entries] == [b"f0"]
    master.handle(m.Release(held.version, writer=False))
    assert [name for _, name, _ in master.handle(m.Reclaim(NODE, 1)).entries] == [b"f1"]
    assert master.handle(m.Reclaim(NODE, 1)).dropped == []


def test_files_being_published_are_evicted_last_for_their_grace(master: MetadataService, clock: ManualClock) -> None:
    """A file created and closed but not yet renamed or read (a writer publishes it by
    rename next) ranks after every published file, until the publish grace runs out."""
    old = [store(master, ROOT_INO, f"old{i}".encode(), 100) for i in range(3)]
    master.handle(m.Rename(ROOT_INO, b"old0", ROOT_INO, b"old0.data"))  # published by rename
    master.handle(m.Release(master.handle(m.OpenRead(old[1].ino)).version, writer=False))  # by a read
    clock.advance(31)  # old2 was never renamed or read: its grace is over, it ranks by the policy
    tmp = [store(master, ROOT_INO, f"new{i}.tmp".encode(), 100) for i in range(2)]
    assert [name for _, name, _ in master.handle(m.Reclaim(NODE, 250)).entries] == [b"old0.data", b"old2", b"old1"]
    assert [name for _, name, _ in master.handle(m.Reclaim(NODE, 1)).entries] == [b"new0.tmp"]  # nothing else left
    master.handle(m.Rename(ROOT_INO, b"new1.tmp", ROOT_INO, b"new1.data"))
    assert master.handle(m.Lookup(ROOT_INO, b"new1.data")).attr.ino == tmp[1].ino
    master.handle(m.Create(ROOT_INO, b"writing.tmp", 0o644, 0, 0, NODE, exclusive=True))
    clock.advance(60)  # a file still being written gets its grace only from its close
    fresh = store(master, ROOT_INO, b"fresh.tmp", 100)
    assert [name for _, name, _ in master.handle(m.Reclaim(NODE, 1)).entries] == [b"new1.data"]
    assert [name for _, name, _ in master.handle(m.Reclaim(NODE, 1)).entries] == [b"fresh.tmp"]
    assert master.handle(m.Lookup(ROOT_INO, b"fresh.tmp")).attr is None and fresh.ino


def test_unsealed_files_are_never_evicted(master: MetadataService) -> None:
    master.handle(m.Create(ROOT_INO, b"writing", 0o644, 0, 0, NODE, exclusive=True))
    assert master.handle(m.Reclaim(NODE, 1)).dropped == []


def test_orphaned_temp_files_are_collected_after_grace(master: MetadataService, clock: ManualClock) -> None:
    orphan = store(master, ROOT_INO, b"x.bin_123.tmp")
    store(master, ROOT_INO, b"keep.bin")
    writing = master.handle(m.Create(ROOT_INO, b"y.tmp", 0o644, 0, 0, NODE, exclusive=True))
    assert master.handle(m.CollectOrphans()).entries == []
    clock.advance(61)
    removed = master.handle(m.CollectOrphans())
    assert removed.entries == [(ROOT_INO, b"x.bin_123.tmp", orphan.ino)]
    assert master.handle(m.Lookup(ROOT_INO, b"y.tmp")).attr.ino == writing.attr.ino
    # A temp file renamed to its final name is no longer a temp file.
    store(master, ROOT_INO, b"z.tmp")
    master.handle(m.Rename(ROOT_INO, b"z.tmp", ROOT_INO, b"z.bin"))
    clock.advance(61)
    assert master.handle(m.CollectOrphans()).entries == []


def test_readdir_resumes_without_skips_or_repeats(master: MetadataService) -> None:
    for i in range(10):
        store(master, ROOT_INO, f"f{i}".encode())
    first = master.handle(m.ReadDir(ROOT_INO, 0, 4)).entries
    assert [e.name for e in first] == [b"f0", b"f1", b"f2", b"f3"]
    master.handle(m.Unlink(ROOT_INO, b"f1"))
    master.handle(m.Unlink(ROOT_INO, b"f5"))
    store(master, ROOT_INO, b"new")
    rest = master.handle(m.ReadDir(ROOT_INO, first[-1].next_id, 100)).entries
    assert [e.name for e in rest] == [b"f4", b"f6", b"f7", b"f8", b"f9", b"new"]


def test_xattrs(master: MetadataService) -> None:
    attr = store(master, ROOT_INO, b"f")
    master.handle(m.SetXattr(attr.ino, b"user.vllm_kv_crc32", b"1234"))
    assert master.handle(m.GetXattr(attr.ino, b"user.vllm_kv_crc32")).value == b"1234"
    assert master.handle(m.ListXattr(attr.ino)).names == [b"user.vllm_kv_crc32"]
    fails(master, m.SetXattr(attr.ino, b"trusted.x", b"1"), errno.ENOTSUP)
    fails(master, m.SetXattr(attr.ino, b"user.big", b"x" * 70000), errno.E2BIG)
    fails(master, m.GetXattr(attr.ino, b"user.none"), errno.ENODATA)
    master.handle(m.RemoveXattr(attr.ino, b"user.vllm_kv_crc32"))
    fails(master, m.RemoveXattr(attr.ino, b"user.vllm_kv_crc32"), errno.ENODATA)


def test_setattr_and_timestamps(master: MetadataService, clock: ManualClock) -> None:
    attr = store(master, ROOT_INO, b"f")
    clock.advance(5)
    changed = master.handle(m.SetAttr(attr.ino, mode=0o600, atime_ns=42))
    assert changed.mode & 0o777 == 0o600 and changed.atime_ns == 42
    assert changed.ctime_ns == clock.wall_ns()


def test_messages_encode_for_the_wire(master: MetadataService) -> None:
    import typing

    import msgspec

    any_request = typing.Union[tuple(m.Request.__subclasses__())]  # type: ignore[misc]
    for request in (m.Rename(1, b"a", 2, b"b", True), m.Seal(3, 10, 5, [1, 2]), m.CollectOrphans()):
        assert msgspec.msgpack.decode(msgspec.msgpack.encode(request), type=any_request) == request


def test_a_replaced_file_stays_readable_while_a_kernel_references_it(master: MetadataService) -> None:
    old = store(master, ROOT_INO, b"f", 100)
    master.handle(m.Lookup(ROOT_INO, b"f"))  # the kernel holds the old inode
    new = store(master, ROOT_INO, b"f.tmp", 200)
    master.handle(m.Rename(ROOT_INO, b"f.tmp", ROOT_INO, b"f"))
    # An open that resolved the name before the rename reads the old file, as on a local fs.
    opened = master.handle(m.OpenRead(old.ino))
    assert (opened.version, opened.attr.size) == (old.version, 100)
    fails(master, m.OpenWrite(old.ino, NODE, truncate=False), errno.ESTALE)
    assert master.handle(m.Release(opened.version, writer=False)).dropped == []
    # The bytes go when the kernel forgets the inode.
    assert master.handle(m.Forget([old.ino])).dropped == [old.version]
    fails(master, m.OpenRead(old.ino), errno.ENOENT)
    assert master.handle(m.Lookup(ROOT_INO, b"f")).attr.version == new.version
    # Eviction does not linger: its bytes are freed at once.
    master.handle(m.Lookup(ROOT_INO, b"f"))
    assert master.handle(m.Reclaim(NODE, 1)).dropped == [new.version]


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_evicts_only_sealed_closed_files_and_deterministically(policy: str) -> None:
    """A random store/load/reclaim workload through the master: whatever the policy
    ranks first, open and unsealed files stay, and the same seed evicts the same files."""

    def run(seed: int) -> list[bytes]:
        rng = random.Random(seed)
        master = MetadataService(ManualClock(), make_policy(policy), MasterSettings(temp_grace_s=60))
        names, held, writing, evicted = [], {}, {}, []
        for step in range(600):
            action = rng.random()
            if action < 0.4:  # store a file
                name = f"k{step}".encode()
                store(master, ROOT_INO, name, rng.randrange(1, 100))
                names.append(name)
            elif action < 0.6 and names:  # open one for reading (held for a while)
                attr = master.handle(m.Lookup(ROOT_INO, rng.choice(names))).attr
                if attr is not None:
                    held[attr.ino] = master.handle(m.OpenRead(attr.ino)).version
            elif action < 0.7 and held:  # a reader closes
                ino = rng.choice(sorted(held))
                master.handle(m.Release(held.pop(ino), writer=False))
            elif action < 0.75:  # a writer starts (unsealed until it is done)
                opened = master.handle(m.Create(ROOT_INO, f"w{step}".encode(), 0o644, 0, 0, NODE, exclusive=True))
                writing[opened.attr.ino] = opened.version
            else:  # capacity pressure
                removed = master.handle(m.Reclaim(NODE, rng.randrange(1, 300)))
                gone = {name for _, name, _ in removed.entries}
                assert not gone & {master.ns.inodes[ino].name for ino in (*held, *writing)}
                evicted += sorted(gone)
                names = [name for name in names if name not in gone]
        for ino in (*held, *writing):
            assert ino in master.ns.inodes  # still there
        return evicted

    first = run(seed=11)
    assert first and run(seed=11) == first


def test_symlinks_keep_their_target_and_are_not_files(master: MetadataService, clock: ManualClock) -> None:
    attr = master.handle(m.Symlink(ROOT_INO, b"l", b"../somewhere/else", 1000, 1000))
    assert stat.S_ISLNK(attr.mode) and attr.size == len(b"../somewhere/else") and attr.nlink == 1
    assert (attr.uid, attr.gid, attr.version) == (1000, 1000, 0)
    assert master.handle(m.ReadLink(attr.ino)).target == b"../somewhere/else"
    assert master.handle(m.Lookup(ROOT_INO, b"l")).attr.ino == attr.ino
    assert master.handle(m.Stats()).files == 0  # no bytes anywhere, never evicted
    fails(master, m.Symlink(ROOT_INO, b"l", b"x", 0, 0), errno.EEXIST)
    fails(master, m.Symlink(ROOT_INO, b"e", b"", 0, 0), errno.ENOENT)
    fails(master, m.Symlink(ROOT_INO, b"long", b"t" * 4096, 0, 0), errno.ENAMETOOLONG)
    assert master.handle(m.ReadLink(master.handle(m.Symlink(ROOT_INO, b"max", b"t" * 4095, 0, 0)).ino)).target \
        == b"t" * 4095
    fails(master, m.ReadLink(store(master, ROOT_INO, b"f").ino), errno.EINVAL)
    fails(master, m.OpenRead(attr.ino), errno.ELOOP)
    clock.advance(3)
    master.handle(m.Rename(ROOT_INO, b"l", ROOT_INO, b"l2"))
    moved = master.handle(m.GetAttr(attr.ino))
    assert moved.ctime_ns == clock.wall_ns() and master.handle(m.ReadLink(attr.ino)).target == b"../somewhere/else"
    master.handle(m.Rename(ROOT_INO, b"l2", ROOT_INO, b"f"))  # a link may replace a file
    assert master.handle(m.Lookup(ROOT_INO, b"f")).attr.ino == attr.ino
    master.handle(m.Unlink(ROOT_INO, b"f"))
    assert master.handle(m.Lookup(ROOT_INO, b"f")).attr is None


def test_directory_link_count_is_two_plus_subdirectories(master: MetadataService) -> None:
    def nlink(ino: int) -> int:
        return master.handle(m.GetAttr(ino)).nlink

    a = master.handle(m.MkDir(ROOT_INO, b"a", 0o755, 0, 0))
    b = master.handle(m.MkDir(ROOT_INO, b"b", 0o755, 0, 0))
    assert nlink(ROOT_INO) == 4 and nlink(a.ino) == 2
    store(master, a.ino, b"file")
    master.handle(m.Symlink(a.ino, b"link", b"file", 0, 0))
    assert nlink(a.ino) == 2  # files and links do not count
    sub = master.handle(m.MkDir(a.ino, b"sub", 0o755, 0, 0))
    assert nlink(a.ino) == 3
    master.handle(m.Rename(a.ino, b"sub", b.ino, b"sub"))
    assert (nlink(a.ino), nlink(b.ino), nlink(sub.ino)) == (2, 3, 2)
    empty = master.handle(m.MkDir(a.ino, b"empty", 0o755, 0, 0))
    master.handle(m.Rename(a.ino, b"empty", b.ino, b"sub"))  # replaces an empty directory
    assert (nlink(a.ino), nlink(b.ino)) == (2, 3) and master.handle(m.Lookup(b.ino, b"sub")).attr.ino == empty.ino
    master.handle(m.RmDir(b.ino, b"sub"))
    assert nlink(b.ino) == 2
    master.handle(m.RmDir(ROOT_INO, b"b"))
    assert nlink(ROOT_INO) == 3


def test_a_seal_moves_ctime_to_the_last_write_and_never_back(master: MetadataService, clock: ManualClock) -> None:
    opened = master.handle(m.Create(ROOT_INO, b"f", 0o644, 0, 0, NODE, exclusive=True))
    created = opened.attr.ctime_ns
    clock.advance(2)
    written = clock.wall_ns()
    clock.advance(2)
    master.handle(m.SetAttr(opened.attr.ino, mtime_ns=5))  # utimensat while the file is written
    chmod_time = clock.wall_ns()
    attr = master.handle(m.Seal(opened.version, 10, 5, [1], written))
    assert attr.mtime_ns == 5 and attr.ctime_ns == chmod_time > written > created


def test_eviction_summary_is_rate_limited_and_by_reason() -> None:
    from kvfs.store.evictions import EvictionSummary

    summary = EvictionSummary(interval_s=10)
    assert summary.summary(0.0) is None  # nothing to say
    summary.record("dram", 2, 4 << 20)
    assert summary.summary(1.0) == "removed 2 files; 2 files (4.0 MiB): DRAM tier full"
    summary.record("dram", 1, 2 << 20)
    summary.record("orphan", 3, 3 << 20)
    assert summary.summary(5.0) is None  # too soon after the last one: held back, not lost
    assert summary.summary(11.0) == ("removed 4 files in the last 10 s; 1 files (2.0 MiB): DRAM tier full; "
                                     "3 files (3.0 MiB): orphaned temp files")
    assert summary.summary(30.0) is None


def test_a_tier_of_fresh_files_is_not_scanned_past_a_bound(master: MetadataService, clock: ManualClock,
                                                          monkeypatch) -> None:
    """Writers that never rename, fast enough to fill the tier within the grace: the scan for
    published files stops after a bound, and the fresh files go in the policy's order."""
    import kvfs.cluster.master as master_module

    monkeypatch.setattr(master_module, "PUBLISHING_SKIP_MAX", 2)
    for i in range(3):
        store(master, ROOT_INO, f"fresh{i}".encode(), 100)
    store(master, ROOT_INO, b"published", 100)
    master.handle(m.Rename(ROOT_INO, b"published", ROOT_INO, b"published.data"))
    assert [name for _, name, _ in master.handle(m.Reclaim(NODE, 1)).entries] == [b"fresh0"]
    assert [name for _, name, _ in master.handle(m.Reclaim(NODE, 1)).entries] == [b"fresh1"]
    assert [name for _, name, _ in master.handle(m.Reclaim(NODE, 1)).entries] == [b"published.data"]



def test_a_miss_asked_with_a_temp_suffix_says_whether_a_small_directory_holds_a_temp_name(
        master: MetadataService) -> None:
    """What a node's store needs to answer the temp name's lookup that follows (kvfs.node.misses)."""
    leaf = master.handle(m.MkDir(ROOT_INO, b"leaf", 0o755, 0, 0)).ino
    assert master.handle(m.Lookup(leaf, b"a.bin", b".tmp")).no_temps  # empty
    assert not master.handle(m.Lookup(leaf, b"a.bin")).no_temps  # not asked
    store(master, leaf, b"b.bin")
    assert master.handle(m.Lookup(leaf, b"a.bin", b".tmp")).no_temps
    entry = master.handle(m.Lookup(leaf, b"b.bin", b".tmp"))  # a hit says nothing of it
    assert entry.attr is not None and not entry.no_temps
    store(master, leaf, b"c.bin.tmp")  # a temp file the master knows (handed over, say)
    assert not master.handle(m.Lookup(leaf, b"a.bin", b".tmp")).no_temps
    big = master.handle(m.MkDir(ROOT_INO, b"big", 0o755, 0, 0)).ino
    for i in range(m.TEMP_SCAN_NAMES + 1):
        store(master, big, b"%d.bin" % i)
    assert not master.handle(m.Lookup(big, b"a.bin", b".tmp")).no_temps  # too large to look through
    fails(master, m.Lookup(leaf, b"a.bin", b"/x"), errno.EINVAL)
