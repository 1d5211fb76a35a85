"""Storage failures: their causes, and a run of them logged once (pure)."""

from __future__ import annotations

import errno
import logging

import lmdb
import pytest

from kvfs.errors import StorageError
from kvfs.store.faults import FaultBurst, StorageFaults, cause_of


def test_causes_name_the_errno_or_the_lmdb_error() -> None:
    assert cause_of(OSError(errno.ENOSPC, "No space left on device")) == "ENOSPC"
    assert cause_of(StorageError(errno.EIO, "short write")) == "EIO"
    assert cause_of(lmdb.DiskError("mdb_txn_commit: No space left on device")) == "ENOSPC"
    assert cause_of(lmdb.MapFullError("mdb_put: MDB_MAP_FULL: Environment mapsize limit reached")) == "MapFullError"
    assert cause_of(lmdb.CorruptedError("mdb_get: MDB_CORRUPTED")) == "CorruptedError"


def test_a_run_of_failures_is_logged_at_its_start_on_a_new_cause_and_at_its_end(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    burst = FaultBurst("copying files to /ssd", logging.getLogger("test.faults"), clock=lambda: now[0])
    full = lmdb.DiskError("mdb_txn_commit: No space left on device")
    with caplog.at_level(logging.DEBUG, logger="test.faults"):
        burst.succeeded()  # nothing to end
        for _ in range(500):
            burst.failed(full, "16 files")
        assert burst.active and burst.failures == 500 and burst.message == str(full)
        burst.failed(OSError(errno.EIO, "Input/output error"))  # another cause: said once
        burst.failed(OSError(errno.EIO, "Input/output error"))
        now[0] = 112.5
        burst.succeeded()
        burst.succeeded()
    lines = [(record.levelname, record.getMessage()) for record in caplog.records]
    assert len(lines) == 3, lines
    assert lines[0][0] == "ERROR" and "copying files to /ssd failed (16 files)" in lines[0][1]
    assert "No space left on device" in lines[0][1] and "(ENOSPC)" in lines[0][1]
    assert lines[1][0] == "ERROR" and "(EIO)" in lines[1][1]
    assert lines[2] == ("WARNING", "copying files to /ssd works again after 502 failures over 12.5 s (EIO)")
    assert not burst.active and burst.message == ""


def test_failures_are_counted_by_operation_and_cause() -> None:
    faults = StorageFaults("/ssd", logging.getLogger("test.faults"))
    for _ in range(3):
        faults.failed("offload", lmdb.DiskError("mdb_txn_commit: No space left on device"))
    faults.failed("read", OSError(errno.EIO, "Input/output error"))
    assert dict(faults.counts) == {("offload", "ENOSPC"): 3, ("read", "EIO"): 1}
    assert faults.total == 4 and faults.failing("offload") and not faults.failing("index")
    faults.succeeded("offload")
    assert not faults.failing("offload") and faults.failing("read")
