"""The master process's saves to lmdb when they fail: the changes stay dirty, the failure is
logged, and the retry writes them all, so memory and disk never disagree silently."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conftest import load_tls
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.persist import MasterState
from kvfs.clock import SystemClock
from kvfs.daemons.master import MasterConfig, MasterProcess
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m

SMALL_MAP = 256 << 10  # room for a few dozen inodes with large xattrs, then lmdb's map is full


def names_on_disk(directory: Path) -> set[bytes]:
    service = MetadataService(SystemClock(), LruPolicy(), MasterSettings(cluster=True))
    state = MasterState(directory)
    try:
        state.load(service)
    finally:
        state.close()
    return set(service.ns.inodes[ROOT_INO].children)


def test_a_failed_save_keeps_the_changes_dirty_and_the_retry_writes_them(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    data = tmp_path / "data"
    process = MasterProcess(MasterConfig("127.0.0.1:0", str(data), load_tls("master", "master"), metrics_listen=None))
    process.state.close()
    process.state = MasterState(data, map_size=SMALL_MAP)  # the same state, in a small map
    node = process.handle(m.Register("a", "a:1"), 0).node
    process.handle(m.Report([]), node)
    process.handle(m.FinishRegistration(), node)
    names = []
    with caplog.at_level(logging.WARNING, logger="kvfs.master"):
        for i in range(400):
            name = f"k{i}.bin".encode()
            attr = process.handle(m.MkDir(ROOT_INO, name, 0o755, 0, 0), node)
            process.handle(m.SetXattr(attr.ino, b"user.pad", bytes(8000)), node)
            names.append(name)
            if process.save_failures:
                break
        assert process.save_failures, "the small map never filled"
        # Requests are still answered; what they changed waits, dirty, for the retry.
        for name in (b"after1", b"after2"):
            process.handle(m.MkDir(ROOT_INO, name, 0o755, 0, 0), node)
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
