"""Node-private temp files and Publish, with real mounts and real master and node processes:
a temp file is created, written and closed on its node alone; its rename to the final name
is one request, after which every node reads it; killed processes lose exactly what was
never acknowledged (docs/semantics.md, "Temp files")."""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import re
import subprocess
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from conftest import Cluster, KvfsMount, find_mount
from conftest import wait_until as _wait_until
from test_cluster import stats
from test_node_semantics import reads, store_like_vllm

wait_until = functools.partial(_wait_until, timeout=15.0)


def master_requests(node: KvfsMount) -> dict[str, float]:
    """The node's requests to the master so far, by type (its metrics)."""
    text = urllib.request.urlopen(node.metrics_url, timeout=10).read().decode()
    counts: dict[str, float] = {}
    for request, value in re.findall(r'^kvfs_master_rpc_total\{request="(\w+)",result="\w+"\} (\S+)$', text, re.M):
        counts[request] = counts.get(request, 0.0) + float(value)
    return counts


def spent_since(node: KvfsMount, before: dict[str, float]) -> dict[str, float]:
    return {request: count - before.get(request, 0.0) for request, count in master_requests(node).items()
            if count - before.get(request, 0.0)}


def write_temp(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        assert os.write(fd, data) == len(data)
    finally:
        os.close(fd)


def rename_noreplace(old: Path, new: Path) -> int:
    """renameat2(RENAME_NOREPLACE): 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    at_fdcwd, rename_noreplace_flag = -100, 1
    result = libc.renameat2(at_fdcwd, os.fsencode(old), at_fdcwd, os.fsencode(new), rename_noreplace_flag)
    return 0 if result == 0 else ctypes.get_errno()


def master_files(node: KvfsMount) -> int:
    return stats(node)["files"]


def restart_killed(node: KvfsMount) -> None:
    """kill -9 and start again (the stale mount of the killed daemon taken away first)."""
    node.kill()
    if find_mount(str(node.path)) is not None:
        subprocess.run(["fusermount3", "-u", "-z", str(node.path)], capture_output=True)
    node.start()


@pytest.fixture
def two_nodes(cluster: Cluster) -> Iterator[tuple[KvfsMount, KvfsMount]]:
    yield cluster.add_node("256M"), cluster.add_node("256M")


def test_a_stored_file_is_one_publish_and_reads_on_another_node_at_once(two_nodes) -> None:
    """vLLM's store: the create, write and close ask the master nothing, the rename is one
    Publish, and the other node reads the right bytes as soon as rename returned."""
    a, b = two_nodes
    directory = a.path / "kv"
    directory.mkdir()
    os.listdir(b.path / "kv")  # b copies the directory: its misses are answered from the copy
    store_like_vllm(directory, "warm.bin", b"w" * 4096)  # (a's copy of the directory, numbers)
    before = master_requests(a)
    blocks = {f"{i:064x}.bin": os.urandom(4096 + i) for i in range(20)}
    for name, data in blocks.items():
        store_like_vllm(directory, name, data)
        assert (b.path / "kv" / name).read_bytes() == data  # right after rename returned
    spent = spent_since(a, before)
    assert spent.get("Publish") == len(blocks), spent
    assert spent.get("Create", 0) == spent.get("Seal", 0) == spent.get("Rename", 0) == 0, spent
    assert spent.get("GrantNumbers", 0) <= 1, spent
    assert sorted(os.listdir(b.path / "kv")) == sorted([*blocks, "warm.bin"])
    for name, data in blocks.items():
        assert (a.path / "kv" / name).read_bytes() == data
        assert os.stat(b.path / "kv" / name).st_size == len(data)


def test_vllm_hashed_layout_asks_only_for_a_lookup_and_the_publish(two_nodes) -> None:
    """vLLM's store in its hashed layout (CONSUMERS.md steps 1-6), each file in a directory
    of its own that exists already: access() of the final name asks the master (one
    Lookup), whose miss also says the directory holds no temp name; the create's lookup of
    the temp name and the rename's of the final name (the kernel trusts no negative entry
    for those) are answered from that miss (kvfs.node.misses), and the directory is not
    copied. The kernel's getattr of the directory between the temp file's create and its
    rename is answered with the attributes it held (the master's are unchanged by a private
    file), so a file costs a lookup and the Publish."""
    a, b = two_nodes
    (a.path / "warm").mkdir()
    store_like_vllm(a.path / "warm", "warm.bin", b"w" * 4096)  # (numbers granted)
    leaves = [a.path / "m_0123456789ab_r0" / f"{i:03x}" / f"{i:02x}_g0" for i in range(12)]
    for leaf in leaves:
        leaf.mkdir(parents=True)
    for leaf in leaves:  # the kernel holds every directory's attributes (after the mkdirs' changes)
        os.stat(leaf)
    before = master_requests(a)
    blocks = {leaf: (f"{i:064x}.bin", os.urandom(4096 + i)) for i, leaf in enumerate(leaves)}
    for leaf, (name, data) in blocks.items():
        assert not os.access(leaf / name, os.F_OK)
        mtime = os.stat(leaf).st_mtime_ns
        write_temp(leaf / f"{name}_7.tmp", data)
        assert os.stat(leaf).st_mtime_ns == mtime  # a private file leaves the directory as the master has it
        os.rename(leaf / f"{name}_7.tmp", leaf / name)
        assert os.access(leaf / name, os.F_OK)
    spent = spent_since(a, before)
    assert spent.get("Publish") == len(blocks), spent
    assert spent.get("Lookup", 0) == len(blocks) and spent.get("GetAttr", 0) == 0, spent
    assert spent.get("WatchNames", 0) == 0, spent
    for leaf, (name, data) in blocks.items():  # another node finds each name
        other = b.path / leaf.relative_to(a.path)
        assert (other / name).read_bytes() == data
        assert os.stat(other).st_mtime_ns == os.stat(leaf).st_mtime_ns
        assert os.listdir(other) == [name]


def test_vllm_store_into_directories_it_makes(two_nodes) -> None:
    """vLLM's store where the parents are missing (CONSUMERS.md steps 1-6: access(), stat of
    the parents, mkdir of the missing ones, the store): each mkdir's answer carries its
    parent's attributes, which answer the kernel's getattr of the parent on the next walk,
    and the temp name's lookup in the leaf the node just made is answered without the master
    (a new directory holds no temp name): the leaf is not copied. Per file: two misses, two
    mkdirs and the Publish (before: also two GetAttrs and two WatchNames)."""
    a, b = two_nodes
    (a.path / "warm").mkdir()
    store_like_vllm(a.path / "warm", "warm.bin", b"w" * 4096)  # (numbers granted)
    model = a.path / "m_0123456789ab_r0"
    model.mkdir()
    os.stat(model)
    before = master_requests(a)
    blocks = {}
    for i in range(12):
        leaf = model / f"{i:03x}" / f"{i:02x}_g0"
        name, data = f"{i:064x}.bin", os.urandom(4096 + i)
        assert not os.access(leaf / name, os.F_OK)
        for level in (leaf.parent, leaf):
            if not os.path.exists(level):
                os.mkdir(level)
        write_temp(leaf / f"{name}_7.tmp", data)
        os.rename(leaf / f"{name}_7.tmp", leaf / name)
        blocks[leaf / name] = data
    spent = spent_since(a, before)
    assert spent.get("Publish") == len(blocks) and spent.get("MkDir") == 2 * len(blocks), spent
    assert spent.get("GetAttr", 0) == 0, spent  # the parents' attributes came with each mkdir
    assert spent.get("Lookup", 0) <= 2 * len(blocks) + 1, spent  # the misses of <hhh> and of the leaf
    assert spent.get("WatchNames", 0) <= 1, spent  # (the model directory: looked up in twice)
    for path, data in blocks.items():
        assert (b.path / path.relative_to(a.path)).read_bytes() == data


def test_vllm_store_into_parents_made_earlier_asks_no_getattr(cluster: Cluster) -> None:
    """Parents made well before the store (the benchmark's warm-up; a vLLM instance that has
    stored for a while): each leaf's mkdir left its `<hhh>` directory's attributes stale in the
    kernel, and the mkdir's answer carried them: they answer the kernel's getattr on the
    store's walk, seconds later, for what is left of the attribute timeout (kvfs.node.kernelattrs).
    Another node's change there shows once that timeout, counted from the mkdir's answer, ran
    out (node c, whose timeout is 2 s)."""
    a, b = cluster.add_node("256M"), cluster.add_node("256M")
    c = cluster.add_node("256M", "--entry-timeout", "2")
    (a.path / "warm").mkdir()
    store_like_vllm(a.path / "warm", "warm.bin", b"w" * 4096)  # (numbers granted)
    model = a.path / "m_0123456789ab_r0"
    model.mkdir()
    leaves = [model / f"{i:03x}" / f"{i:02x}_g0" for i in range(8)]
    for leaf in leaves:  # the warm-up: every parent made before the store
        leaf.mkdir(parents=True)
    before = master_requests(a)
    for i, leaf in enumerate(leaves):
        name = f"{i:064x}.bin"
        assert not os.access(leaf / name, os.F_OK)
        assert os.path.isdir(leaf)
        store_like_vllm(leaf, name, bytes([i]) * 4096)
    spent = spent_since(a, before)
    assert spent.get("Publish") == len(leaves), spent
    assert spent.get("GetAttr", 0) == 0, spent  # the <hhh> directories' came with the warm-up's mkdirs
    for i, leaf in enumerate(leaves):
        assert (b.path / leaf.relative_to(a.path) / f"{i:064x}.bin").read_bytes() == bytes([i]) * 4096

    shared = c.path / "shared"
    (shared / "leaf").mkdir(parents=True)  # c's kernel drops `shared`'s attributes; the answer has them
    before_c = master_requests(c)
    assert os.path.isdir(shared / "leaf")  # the walk's getattr of `shared`, answered by c
    assert spent_since(c, before_c).get("GetAttr", 0) == 0
    (b.path / "shared" / "other").mkdir()  # another node's change: `shared` gains a link
    assert os.stat(b.path / "shared").st_nlink == 4
    wait_until(lambda: os.stat(shared).st_nlink == 4, timeout=10.0,
               what="c to show b's mkdir once its 2 s attribute timeout ran out")


def test_after_a_miss_the_master_still_decides_what_exists(two_nodes) -> None:
    """The names a miss answers without asking (kvfs.node.misses) are only for what follows
    the store's access(): a temp name the master knows is found as before, and an exclusive
    create or a no-replace rename of a name another node made since gets EEXIST from the
    master, whether the node's lookup answered from the miss or asked."""
    a, b = two_nodes
    (a.path / "m").mkdir()
    write_temp(b.path / "m" / "h.tmp", b"handed")
    os.chmod(b.path / "m" / "h.tmp", 0o600)  # b hands its temp file to the master
    assert not os.access(a.path / "m" / "final.bin", os.F_OK)  # a's miss: the directory holds a temp name
    with pytest.raises(FileExistsError):
        write_temp(a.path / "m" / "h.tmp", b"shadow")
    assert (a.path / "m" / "h.tmp").read_bytes() == b"handed"
    (a.path / "n").mkdir()
    assert not os.access(a.path / "n" / "x.bin", os.F_OK)  # a's miss of x.bin
    assert not os.access(a.path / "n" / "y.bin", os.F_OK)
    store_like_vllm(b.path / "n", "x.bin", b"from b")
    store_like_vllm(b.path / "n", "y.bin", b"from b")
    with pytest.raises(FileExistsError):
        os.close(os.open(a.path / "n" / "x.bin", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    write_temp(a.path / "n" / "y.bin_1.tmp", b"from a")
    assert rename_noreplace(a.path / "n" / "y.bin_1.tmp", a.path / "n" / "y.bin") == errno.EEXIST
    assert (a.path / "n" / "y.bin").read_bytes() == b"from b" == (b.path / "n" / "x.bin").read_bytes()


def test_a_temp_file_is_private_to_its_node(two_nodes) -> None:
    """Another node neither sees a temp file nor meets its name: it makes its own; on the
    writer's node stat, reads and a second exclusive create (EEXIST) work as for any file."""
    a, b = two_nodes
    (a.path / "d").mkdir()
    temp_a, temp_b = a.path / "d" / "k.tmp", b.path / "d" / "k.tmp"
    write_temp(temp_a, b"from a")
    assert os.stat(temp_a).st_size == 6 and temp_a.read_bytes() == b"from a"
    assert not temp_b.exists() and "k.tmp" not in os.listdir(b.path / "d")
    with pytest.raises(FileExistsError):
        write_temp(temp_a, b"again")
    write_temp(temp_b, b"from b")  # no conflict: each node has its own
    assert temp_a.read_bytes() == b"from a" and temp_b.read_bytes() == b"from b"
    os.rename(temp_b, b.path / "d" / "k")
    assert (a.path / "d" / "k").read_bytes() == b"from b"
    assert temp_a.read_bytes() == b"from a"  # a's own is untouched
    os.rename(temp_a, a.path / "d" / "k")  # the last rename wins, as for any rename
    assert (b.path / "d" / "k").read_bytes() == b"from a"


def test_local_operations_on_a_temp_file(two_nodes) -> None:
    """Rename to another temp name and unlink stay on the node (the bytes are freed); a
    chmod, an xattr or a second write session hand the file to the master under its own name."""
    a, b = two_nodes
    (a.path / "ops").mkdir()
    first, second = a.path / "ops" / "x.tmp", a.path / "ops" / "y.tmp"
    used = stats(a)["dram_used"]
    write_temp(first, os.urandom(1 << 20))
    assert stats(a)["dram_used"] > used
    os.rename(first, second)
    assert not first.exists() and os.stat(second).st_size == 1 << 20
    assert "user.kvfs.version" in os.listxattr(second)  # answered here: the file stays private
    with pytest.raises(OSError) as raised:
        os.getxattr(second, "user.tag")
    assert raised.value.errno == errno.ENODATA and not (b.path / "ops" / "y.tmp").exists()
    os.unlink(second)
    assert not second.exists()
    wait_until(lambda: stats(a)["dram_used"] == used, what="the unlinked temp file's bytes freed")
    third = a.path / "ops" / "z.tmp"
    write_temp(third, b"12345")
    os.chmod(third, 0o600)  # handed to the master: the temp file is now one like today's
    assert (b.path / "ops" / "z.tmp").read_bytes() == b"12345"
    with open(third, "ab") as file:
        file.write(b"678")
    os.rename(third, a.path / "ops" / "z")
    assert (b.path / "ops" / "z").read_bytes() == b"12345678"
    fourth = a.path / "ops" / "w.tmp"
    write_temp(fourth, b"abc")
    with open(fourth, "r+b") as file:  # a second write session
        file.seek(3)
        file.write(b"def")
    os.rename(fourth, a.path / "ops" / "w")
    assert (b.path / "ops" / "w").read_bytes() == b"abcdef"


def test_a_temp_file_still_open_is_handed_over_unsealed(two_nodes) -> None:
    """A rename, or an fchmod, while the writer still has the temp file open publishes it
    unsealed: the writer goes on writing, and its close seals it as for any file."""
    a, b = two_nodes
    (a.path / "open").mkdir()
    renamed = a.path / "open" / "r.tmp"
    with open(renamed, "xb") as file:
        file.write(b"first ")
        file.flush()
        os.rename(renamed, a.path / "open" / "r")
        file.write(b"second")
    wait_until(lambda: reads(b.path / "open" / "r", b"first second"), what="the whole file on the other node")
    chmodded = a.path / "open" / "c.tmp"
    with open(chmodded, "xb") as file:
        file.write(b"one ")
        file.flush()
        os.fchmod(file.fileno(), 0o600)
        file.write(b"two")
    assert (b.path / "open" / "c.tmp").read_bytes() == b"one two"  # the master's now, by its temp name
    assert os.stat(b.path / "open" / "c.tmp").st_mode & 0o777 == 0o600
    os.rename(chmodded, a.path / "open" / "c")
    assert (b.path / "open" / "c").read_bytes() == b"one two"


def test_a_refused_publish_gives_the_errno_and_leaves_the_temp_file(two_nodes) -> None:
    """A rename onto a directory is refused as rename(2) refuses it (EISDIR) and changes
    nothing; an unlink of the temp file then frees its bytes."""
    a, b = two_nodes
    (a.path / "r").mkdir()
    (a.path / "r" / "taken").mkdir()
    temp = a.path / "r" / "k.tmp"
    used = stats(a)["dram_used"]
    write_temp(temp, os.urandom(1 << 20))
    with pytest.raises(IsADirectoryError):
        os.rename(temp, a.path / "r" / "taken")
    store_like_vllm(a.path / "r", "exists", b"e")
    assert rename_noreplace(temp, a.path / "r" / "exists") == errno.EEXIST
    assert os.stat(temp).st_size == 1 << 20 and (b.path / "r" / "exists").read_bytes() == b"e"
    assert os.path.isdir(b.path / "r" / "taken")
    os.unlink(temp)
    wait_until(lambda: stats(a)["dram_used"] <= used + 4096, what="the temp file's bytes freed")


def test_an_abandoned_temp_file_is_collected_by_its_node(cluster: Cluster) -> None:
    """A writer that closed a temp file and died before the rename: the node collects it
    once it was untouched for --temp-grace, and frees its bytes; a fresh one stays."""
    a = cluster.add_node("64M", "--temp-grace", "1", "--gc-interval", "0.2")
    (a.path / "o").mkdir()
    used = stats(a)["dram_used"]
    write_temp(a.path / "o" / "abandoned.tmp", os.urandom(1 << 20))
    wait_until(lambda: not (a.path / "o" / "abandoned.tmp").exists(), what="the orphan collected")
    wait_until(lambda: stats(a)["dram_used"] == used, what="its bytes freed")
    store_like_vllm(a.path / "o", "published", b"p")  # published files are the master's: never orphans
    assert (a.path / "o" / "published").read_bytes() == b"p"


def test_a_node_killed_before_the_rename_leaves_nothing_behind(cluster: Cluster) -> None:
    """kill -9 with an unpublished temp file (on SSD too): the master never held anything of
    it, and the node comes back clean, its temp file gone."""
    a = cluster.add_node("64M", "--disk", str(cluster.root / "disk-a"), "--disk-size", "64M")
    b = cluster.add_node("64M")
    (a.path / "n").mkdir()
    store_like_vllm(a.path / "n", "kept", b"kept")
    files = master_files(b)
    temp = a.path / "n" / "lost.tmp"
    write_temp(temp, os.urandom(1 << 20))
    os.setxattr(a.path, "user.kvfs.control", b"flush")  # (copies no private file to SSD)
    assert master_files(b) == files  # the master holds nothing of it
    restart_killed(a)
    assert not temp.exists() and sorted(os.listdir(a.path / "n")) == ["kept"]
    assert (a.path / "n" / "kept").read_bytes() == b"kept"
    assert master_files(b) == files, (os.listdir(b.path / "n"), os.listdir(b.path), stats(b))
    write_temp(temp, b"new")  # the name is free again
    os.rename(temp, a.path / "n" / "new")
    assert (b.path / "n" / "new").read_bytes() == b"new"


def test_an_acknowledged_publish_survives_a_master_killed_at_once(cluster: Cluster) -> None:
    a, b = cluster.add_node("64M"), cluster.add_node("64M")
    (a.path / "m").mkdir()
    data = os.urandom(8192)
    store_like_vllm(a.path / "m", "block", data)
    cluster.master.kill()  # right after rename returned
    cluster.master.start(port=cluster.master.port)
    wait_until(lambda: (b.path / "m" / "block").exists(), timeout=30, what="the file after the master restart")
    assert (b.path / "m" / "block").read_bytes() == data
    store_like_vllm(a.path / "m", "after", b"after")  # creates go on with the numbers granted before
    assert (b.path / "m" / "after").read_bytes() == b"after"


def test_numbers_are_unique_across_node_and_master_restarts(cluster: Cluster) -> None:
    """Inode numbers (and the versions with them) from blocks: never handed out twice, also
    once the node that held a block, and the master that granted it, were killed."""
    a, b = cluster.add_node("64M"), cluster.add_node("64M")
    (a.path / "u").mkdir()
    inos: dict[int, str] = {}
    versions: dict[bytes, str] = {}

    def store(node: KvfsMount, name: str) -> None:
        store_like_vllm(node.path / "u", name, name.encode())
        ino = os.stat(node.path / "u" / name).st_ino
        version = os.getxattr(node.path / "u" / name, "user.kvfs.version")
        assert ino not in inos and version not in versions, (name, inos.get(ino), versions.get(version))
        inos[ino], versions[version] = name, name

    for i in range(5):
        store(a, f"a{i}")
        store(b, f"b{i}")
    restart_killed(a)
    for i in range(5, 10):
        store(a, f"a{i}")
    cluster.master.kill()
    cluster.master.start(port=cluster.master.port)
    wait_until(lambda: (a.path / "u" / "b0").exists() and (b.path / "u" / "a9").exists(), timeout=30,
               what="both nodes registered again")
    for i in range(10, 15):
        store(a, f"a{i}")
        store(b, f"b{i}")
    # a0-a4 were in the killed node's DRAM only: gone with it (acknowledged as stored, not as on SSD)
    assert sorted(os.listdir(b.path / "u")) == sorted([f"a{i}" for i in range(5, 15)] + [f"b{i}" for i in [*range(5), *range(10, 15)]])


# The master's side, on a real etcd: a standby's copy applies a publish's records -------


def test_a_standby_applies_publishes_and_number_grants_as_a_fresh_load_would(etcd_cluster) -> None:
    import time

    import trio
    from master_view import saved_view
    from test_standby import Leader, derived_view, elect, new_service, until

    from kvfs.cluster.namespace import ROOT_INO
    from kvfs.errors import MetadataError
    from kvfs.net.etcd import EtcdClient
    from kvfs.net.etcdstate import EtcdState
    from kvfs.net.follow import Follower
    from kvfs.wire import messages as m

    def publish(leader: Leader, numbers: tuple[int, int], parent: int, name: bytes, **options: bool) -> m.Published:
        ino, version = numbers
        return leader.call(m.Publish(parent, name, leader.node, ino, version, 0o644, 0, 0, 4096, [7],
                                     time.time_ns(), time.time_ns(), **options))

    async def main() -> None:
        client = EtcdClient(etcd_cluster.urls)
        leader = Leader(client, await elect(client))
        directory = leader.call(m.MkDir(ROOT_INO, b"kv", 0o755, 0, 0)).ino
        leader.write(directory, b"old")
        await leader.commit()
        follower = Follower(client, "t", new_service)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follower.run)
            await until(lambda: follower.service is not None, "the standby's load")
            block = leader.call(m.GrantNumbers(8))
            numbers = [(block.first_ino + i, block.first_version + i) for i in range(block.count)]
            await leader.commit()  # a grant alone is committed: its counters
            publish(leader, numbers[0], directory, b"new")
            publish(leader, numbers[1], directory, b"old")  # replaces the file that had the name
            leader.call(m.MkDir(directory, b"sub", 0o755, 0, 0))
            for refused, options, code in ((numbers[2], {}, errno.EISDIR), (numbers[0], {}, errno.EINVAL),
                                           ((block.first_ino + 8, block.first_version + 8), {}, errno.EINVAL),
                                           (numbers[3], {"noreplace": True}, errno.EEXIST)):
                name = b"sub" if code == errno.EISDIR else b"new"
                with pytest.raises(MetadataError) as raised:
                    publish(leader, refused, directory, name, **options)
                assert raised.value.errno == code
            await leader.commit()
            await until(lambda: follower.revision >= leader.state.revision, "the standby following")
            nursery.cancel_scope.cancel()
        copy, _ = await follower.catch_up(leader.state.revision, 5.0)
        fresh = new_service()
        await EtcdState(client, "t").load(fresh)
        assert saved_view(copy) == saved_view(fresh) == saved_view(leader.service)
        assert derived_view(copy) == derived_view(fresh)
        assert copy.ns.lookup(directory, b"new").ino == numbers[0][0]
        assert copy.ns.lookup(directory, b"old").version == numbers[1][1]
        assert fresh.ns.next_ino >= block.first_ino + 8 and fresh.objects.next_version >= block.first_version + 8
        await client.aclose()

    trio.run(main)


# The master's side: a node publishes only numbers granted to it -------------------------


def test_a_node_cannot_publish_with_numbers_granted_to_another_and_grants_survive_a_restart(tmp_path: Path) -> None:
    """Node x publishing with node y's numbers is refused and changes nothing; y's publish
    of them then succeeds. The blocks are saved with their node: after a restart y still
    publishes from a block granted before it, and x still cannot. A removed node's blocks
    are forgotten with it."""
    import time

    from master_view import saved_view
    from test_loop_bounds import cluster as new_service
    from test_loop_bounds import join

    from kvfs.cluster.master import MetadataService
    from kvfs.cluster.namespace import ROOT_INO
    from kvfs.cluster.persist import MasterState
    from kvfs.errors import MetadataError
    from kvfs.wire import messages as m

    def publish(service: MetadataService, node: int, numbers: tuple[int, int], name: bytes) -> m.Published:
        return service.handle(m.Publish(ROOT_INO, name, node, numbers[0], numbers[1], 0o644, 0, 0, 4096, [7],
                                        time.time_ns(), time.time_ns()), node)

    def refused(service: MetadataService, node: int, numbers: tuple[int, int], name: bytes) -> None:
        before = saved_view(service)
        with pytest.raises(MetadataError) as raised:
            publish(service, node, numbers, name)
        assert raised.value.errno == errno.EINVAL
        assert saved_view(service) == before and service.ns.lookup(ROOT_INO, name) is None

    service = new_service()
    x, y = join(service, "x"), join(service, "yy")
    block = service.handle(m.GrantNumbers(8), y)
    ys = [(block.first_ino + i, block.first_version + i) for i in range(block.count)]
    own = service.handle(m.GrantNumbers(8), x)
    refused(service, x, ys[0], b"stolen")  # y's pair, below the counters and unused: not x's
    refused(service, y, (ys[0][0], ys[1][1]), b"mixed")  # y's numbers, but not one pair of its block
    assert publish(service, y, ys[0], b"y0").attr.ino == ys[0][0]  # y's publish is unharmed
    assert publish(service, x, (own.first_ino, own.first_version), b"x0").attr.version == own.first_version
    refused(service, y, ys[0], b"again")  # used

    state = MasterState(tmp_path / "state")
    state.save(service)
    state.close()
    restarted, state = new_service(), MasterState(tmp_path / "state")
    state.load(restarted)
    assert restarted.registry.nodes[y].grants == [(block.first_ino, block.first_version, 8)]
    assert join(restarted, "x") == x and join(restarted, "yy") == y  # registered again: the blocks stay
    refused(restarted, x, ys[1], b"stolen")
    assert publish(restarted, y, ys[1], b"y1").attr.ino == ys[1][0]

    # y goes for good: its blocks are forgotten with it, and saved so
    restarted.handle(m.GrantNumbers(8), y)
    state.save(restarted)
    state.close()
    again, state = new_service(), MasterState(tmp_path / "state")
    state.load(again)
    assert len(again.registry.nodes[y].grants) == 2
    again.handle(m.RemoveNode("yy"), 0)
    state.save(again)
    state.close()
    last, state = new_service(), MasterState(tmp_path / "state")
    state.load(last)
    assert set(last.registry.nodes) == {x}
    y_new = join(last, "yy")
    assert last.registry.nodes[y_new].grants == []
    refused(last, y_new, ys[2], b"y2")
    state.close()
