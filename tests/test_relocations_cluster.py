"""A directory rename in a real cluster (`kvfs master` and `kvfs node` processes, each node a
mount with an SSD tier): the files read at once under the new name on every node, and every
node rewrites its own SSD index records to the new path in the background, the master's walk
going a few entries per step (`--relocate-slice 16`); across a master killed with -9 and a
node restarted, and across an etcd failover, where what the master held in memory is derived
again from the nodes' registrations."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

import lmdb
import msgspec
from conftest import KvfsMount, MasterDaemon, start_master_process, tls_dir, wait_until
from kvfs.disk.records import IndexEntry

SLICE = ["--relocate-slice", "16"]  # a walk of a few thousand files takes a few hundred steps
FILES = 1200  # per node


class SlicedMaster(MasterDaemon):
    """`kvfs master` with lmdb state and small walk slices."""

    def start(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.host = host
        self.process, self.address = start_master_process(
            [sys.executable, "-m", "kvfs", "master", "--listen", f"{host}:{port}", "--data", str(self.data),
             "--tls-dir", tls_dir("master", "master"), "--log-level", "debug", *SLICE], self.log_path)


def ssd_node(root: Path, name: str, master: str) -> KvfsMount:
    node_root = root / name
    node_root.mkdir()
    node = KvfsMount(node_root, "128M", "--disk", str(node_root / "disk"), "--disk-size", "256M", master=master)
    node.start()
    return node


def recorded_paths(node: KvfsMount) -> dict[int, str]:
    """The paths a node's SSD index records, read as a restart would (lmdb, read-only, beside
    the running node)."""
    env = lmdb.open(str(node.root / "disk" / "index"), readonly=True, max_dbs=2, lock=True)
    try:
        files = env.open_db(b"files", create=False)
        decode = msgspec.msgpack.Decoder(IndexEntry).decode
        with env.begin(db=files) as txn:
            return {entry.record.version: "/".join(name.decode() for name in entry.record.file.path)
                    for entry in (decode(value) for _, value in txn.cursor())}
    finally:
        env.close()


def write_files(node: KvfsMount, directory: str, prefix: str, count: int) -> None:
    (node.path / directory).mkdir(exist_ok=True)
    for i in range(count):
        (node.path / directory / f"{prefix}{i:05d}.bin").write_bytes(f"{prefix}{i}".encode() * 64)
    os.setxattr(node.path, "user.kvfs.control", b"sync")  # every file on SSD, its record written


def all_under(node: KvfsMount, directory: str, count: int) -> bool:
    paths = recorded_paths(node)
    return len(paths) == count and all(path.startswith(directory + "/") for path in paths.values())


@contextlib.contextmanager
def nodes_stopped(nodes: list[KvfsMount]) -> Iterator[None]:
    try:
        yield
    finally:
        for node in reversed(nodes):
            with contextlib.suppress(Exception):
                node.stop()


def check_reads(nodes: list[KvfsMount], directory: str) -> None:
    """Files of both nodes, opened and read on each node under the new name."""
    for reader in nodes:
        for prefix, i in [("a", 0), ("a", FILES - 1), ("b", 7), ("b", FILES // 2)]:
            assert (reader.path / directory / f"{prefix}{i:05d}.bin").read_bytes() == f"{prefix}{i}".encode() * 64


def two_nodes_holding_files(tmp_path: Path, master: SlicedMaster,
                            nodes: list[KvfsMount]) -> tuple[KvfsMount, KvfsMount]:
    """Nodes a and b (appended to `nodes`, to be stopped), each with FILES files on SSD
    under model/layer, their records written under that path."""
    a = ssd_node(tmp_path, "a", master.address)
    nodes.append(a)
    b = ssd_node(tmp_path, "b", master.address)
    nodes.append(b)
    (a.path / "model").mkdir()
    write_files(a, "model/layer", "a", FILES)
    write_files(b, "model/layer", "b", FILES)
    assert all_under(a, "model/layer", FILES) and all_under(b, "model/layer", FILES)
    return a, b


def test_a_renamed_directory_reads_at_once_and_every_node_rewrites_its_own_records(tmp_path: Path) -> None:
    master = SlicedMaster(tmp_path)
    master.start()
    nodes: list[KvfsMount] = []
    try:
        with nodes_stopped(nodes):
            a, b = two_nodes_holding_files(tmp_path, master, nodes)
            os.rename(a.path / "model", a.path / "moved")
            check_reads([a, b], "moved/layer")  # at once, on the caller and on the other node
            wait_until(lambda: all_under(a, "moved/layer", FILES) and all_under(b, "moved/layer", FILES),
                       what="both nodes' records under the new path", timeout=60)
            errors = [f"{node.root.name}: {line}" for node in nodes for line in node.new_errors()]
            assert not errors, "\n".join(errors)
    finally:
        master.stop()


def test_records_left_stale_by_a_master_killed_and_a_node_down_are_rewritten_after(tmp_path: Path) -> None:
    """b is down at the rename (its outbox waits in the master's memory), then the master is
    killed with -9 (the outbox and any walk are gone) and restarted; b starts again and its
    registration's report names its stale records, which it then rewrites."""
    master = SlicedMaster(tmp_path)
    master.start()
    nodes: list[KvfsMount] = []
    try:
        with nodes_stopped(nodes):
            a, b = two_nodes_holding_files(tmp_path, master, nodes)
            b.stop()
            os.rename(a.path / "model", a.path / "moved")
            master.kill()
            master.start(port=master.port)
            b.start()
            check_reads([a, b], "moved/layer")
            wait_until(lambda: all_under(a, "moved/layer", FILES) and all_under(b, "moved/layer", FILES),
                       what="both nodes' records under the new path", timeout=60)
            assert all_under(b, "moved/layer", FILES)
    finally:
        master.stop()


def test_records_are_rewritten_across_an_etcd_failover(tmp_path: Path) -> None:
    """The leader is killed right after the rename; the standby takes over with its copy of
    the state, and the nodes' registrations with it name the records still stale."""
    from etcd import ElectedMaster, EtcdCluster
    from etcd import leader as etcd_leader

    with EtcdCluster(tmp_path, members=1) as etcd, contextlib.ExitStack() as stack:
        masters = []
        for i in range(2):
            elected = ElectedMaster(tmp_path / f"master{i}", etcd, cluster="reloc", lease_ttl=2)
            elected.argv += SLICE
            masters.append(elected.start())
            stack.callback(elected.close)
        wait_until(lambda: etcd_leader(etcd, "reloc") is not None, what="a leader", timeout=30)
        address = "etcd://" + ",".join(url.removeprefix("http://") for url in etcd.urls) + "/reloc"
        nodes: list[KvfsMount] = []
        with nodes_stopped(nodes):
            a = ssd_node(tmp_path, "a", address)
            nodes.append(a)
            b = ssd_node(tmp_path, "b", address)
            nodes.append(b)
            (a.path / "model").mkdir()
            write_files(a, "model/layer", "a", FILES)
            write_files(b, "model/layer", "b", FILES)
            b.stop()  # (its records stay stale until it registers with the new leader)
            leader_address, epoch = etcd_leader(etcd, "reloc")
            os.rename(a.path / "model", a.path / "moved")
            next(m for m in masters if m.address == leader_address).kill()
            wait_until(lambda: (etcd_leader(etcd, "reloc") or ("", 0))[1] > epoch, what="a new leader", timeout=30)
            b.start()
            check_reads([a, b], "moved/layer")
            wait_until(lambda: all_under(a, "moved/layer", FILES) and all_under(b, "moved/layer", FILES),
                       what="both nodes' records under the new path", timeout=60)
