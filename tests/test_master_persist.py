"""The master process's saves to lmdb when they fail: the changes stay dirty, the failure is
logged, and the retry writes them all, so memory and disk never disagree silently."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conftest import load_tls
from master_view import names_on_disk
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.persist import MasterState
from kvfs.clock import SystemClock
from kvfs.daemons.master import MasterConfig, MasterProcess
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m

SMALL_MAP = 256 << 10  # room for a few dozen inodes with large xattrs, then lmdb's map is full



def test_a_failed_save_keeps_the_changes_dirty_and_the_retry_writes_them(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    process = MasterProcess(MasterConfig("127.0.0.1:0", str(data), load_tls("master", "master"), metrics_listen=None))
    process.state.close()
    process.state = MasterState(data, map_size=SMALL_MAP)  # the same state, in a small map

    def handle(request: m.Request, caller: int) -> object:
        """One request as a batch of its own: handled, then saved (as the server does before answering)."""
        try:
            return process.handle(request, caller)
        finally:
            process.save_requests()

    node = handle(m.Register("a", "a:1"), 0).node
    handle(m.Report([]), node)
    handle(m.FinishRegistration(), node)
    names = []
    with caplog.at_level(logging.WARNING, logger="kvfs.master"):
        for i in range(400):
            name = f"k{i}.bin".encode()
            attr = handle(m.MkDir(ROOT_INO, name, 0o755, 0, 0), node)
            handle(m.SetXattr(attr.ino, b"user.pad", bytes(8000)), node)
            names.append(name)
            if process.save_failures:
                break
        assert process.save_failures, "the small map never filled"
        # Requests are still answered; what they changed waits, dirty, for the retry.
        for name in (b"after1", b"after2"):
            handle(m.MkDir(ROOT_INO, name, 0o755, 0, 0), node)
            names.append(name)
        assert process.service.ns.dirty
        failures = [r for r in caplog.records if r.levelno == logging.ERROR and "saving the master state" in r.message]
        assert len(failures) == 1 and str(data) in failures[0].message
        assert not process.save("timer")  # still full
        process.state.env.set_mapsize(64 << 20)  # room again (an operator freed space)
        assert process.save("timer")
        assert process.save_failures == 0 and not process.service.ns.dirty
        assert any("saved the master state again" in r.message for r in caplog.records)
    process.state.close()
    assert names_on_disk(data) == set(names) == set(process.service.ns.inodes[ROOT_INO].children)


def test_nodes_are_written_only_when_the_registry_changed() -> None:
    from kvfs.cluster import records
    from kvfs.cluster.records import Kind

    service = MetadataService(SystemClock(), LruPolicy(), MasterSettings(cluster=True))
    written: dict[int, records.NodeFields] = {}

    def take() -> list[tuple[Kind, int, bool]]:
        nonlocal written
        changes = records.changes(service, written)
        if service.registry.dirty:
            written = records.saved_nodes(service)
        records.clear_dirty(service)
        return [(c.kind, c.number, c.value is not None) for c in changes if c.kind is Kind.NODE]

    node = service.handle(m.Register("a", "10.0.0.1:1"), 0).node
    service.handle(m.Report([]), node)
    service.handle(m.FinishRegistration(), node)
    assert take() == [(Kind.NODE, node, True)]
    for i in range(3):  # requests that leave the registry alone write no node
        service.handle(m.MkDir(ROOT_INO, b"d%d" % i, 0o755, 0, 0), node)
        assert take() == []
    other = service.handle(m.Register("b", "10.0.0.2:1"), 0).node
    assert take() == [(Kind.NODE, other, True)]  # only the new one
    # A node the store wrote that the registry no longer has (forgotten) is deleted with
    # the registry's next change.
    written[99] = ("gone", "10.0.0.9:1", ())
    service.handle(m.Register("c", "10.0.0.3:1"), 0)
    assert take() == [(Kind.NODE, service.registry.by_name["c"], True), (Kind.NODE, 99, False)]
    # A block of numbers is saved with its node's record: that node's alone, once per block.
    service.handle(m.GrantNumbers(16), other)
    assert take() == [(Kind.NODE, other, True)]


def node_records(directory: Path) -> dict[bytes, bytes]:
    state = MasterState(directory)
    try:
        with state.env.begin() as txn:
            return {key: bytes(value) for key, value in txn.cursor(db=state._meta) if key.startswith(b"node/")}
    finally:
        state.close()


def test_lmdb_writes_a_node_record_only_when_the_registry_changed(tmp_path: Path) -> None:
    service = MetadataService(SystemClock(), LruPolicy(), MasterSettings(cluster=True))
    state = MasterState(tmp_path)
    node = service.handle(m.Register("a", "10.0.0.1:1"), 0).node
    service.handle(m.Report([]), node)
    service.handle(m.FinishRegistration(), node)
    state.save(service)
    with state.env.begin() as txn:
        first = {key: txn.get(key, db=state._meta) for key, _ in txn.cursor(db=state._meta)}
    for i in range(5):
        service.handle(m.MkDir(ROOT_INO, b"d%d" % i, 0o755, 0, 0), node)
        state.save(service)
    with state.env.begin() as txn:
        # one record per node beside the counters (no list of every node rewritten with each save;
        # which saves write a node record is test_nodes_are_written_only_when_the_registry_changed)
        after = {key: txn.get(key, db=state._meta) for key, _ in txn.cursor(db=state._meta)}
    assert after.keys() == first.keys() == {b"counters", b"node/" + node.to_bytes(8, "big")}
    assert after[b"counters"] != first[b"counters"]
    state.close()
    assert set(node_records(tmp_path)) == {b"node/" + node.to_bytes(8, "big")}
    assert names_on_disk(tmp_path) == {b"d%d" % i for i in range(5)}


def test_a_data_directory_of_the_first_layout_loads_and_is_upgraded(tmp_path: Path) -> None:
    """Nodes and counters in one `meta` record (the first layout): loaded as they were, and the
    next save writes them as records of their own and drops the old record."""
    from kvfs.cluster import records

    service = MetadataService(SystemClock(), LruPolicy(), MasterSettings(cluster=True))
    node = service.handle(m.Register("a", "10.0.0.1:1"), 0).node
    service.handle(m.Report([]), node)
    service.handle(m.FinishRegistration(), node)
    service.handle(m.MkDir(ROOT_INO, b"kept", 0o755, 0, 0), node)
    state = MasterState(tmp_path)
    with state.env.begin(write=True) as txn:  # what the first layout's save wrote
        for change in records.changes(service, {}):
            if change.kind is records.Kind.INODE and change.value is not None:
                txn.put(change.number.to_bytes(8, "big"), change.value, db=state._inodes)
        txn.put(b"meta", records.encode_meta(service), db=state._meta)
    state.close()

    reloaded = MetadataService(SystemClock(), LruPolicy(), MasterSettings(cluster=True))
    state = MasterState(tmp_path)
    state.load(reloaded)
    assert set(reloaded.ns.inodes[ROOT_INO].children) == {b"kept"}
    assert reloaded.registry.by_name == {"a": node}
    state.save(reloaded)
    with state.env.begin() as txn:
        assert txn.get(b"meta", db=state._meta) is None
    state.close()
    assert set(node_records(tmp_path)) == {b"node/" + node.to_bytes(8, "big")}
    assert names_on_disk(tmp_path) == {b"kept"}
