"""One user's files open for writing cannot pin the DRAM tier: a per-uid cap on unsealed bytes."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path

import pytest

from conftest import is_stored
from kvfs.errors import StorageError
from kvfs.node.quota import UnsealedBytes

MiB = 1 << 20
AS_NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

# Run as an unprivileged user, in the mount's root (an inherited descriptor: the test's
# temporary directories are not searchable by others): opens files one after another, writes
# 4 MiB to each and keeps them all open; prints how many it filled and the error that stopped it.
HOARDER = """
import os, sys
root, count = int(sys.argv[1]), int(sys.argv[2])
held = []
try:
    for i in range(count):
        fd = os.open(f"hoard{i}.bin", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=root)
        held.append(fd)
        os.write(fd, b"h" * (4 << 20))
    print("filled", count)
except OSError as error:
    print("filled", len(held) - 1, "error", error.errno)
"""


def hoard(mountpoint: Path, count: int) -> tuple[int, int | None]:
    fd = os.open(mountpoint, os.O_RDONLY)
    try:
        done = subprocess.run([*AS_NOBODY, "/usr/bin/python3", "-c", HOARDER, str(fd), str(count)],
                              capture_output=True, text=True, timeout=120, pass_fds=(fd,))
    finally:
        os.close(fd)
    assert done.returncode == 0, done.stderr
    words = done.stdout.split()
    return int(words[1]), int(words[3]) if len(words) > 2 else None


def test_a_user_holding_files_open_gets_edquot_and_evicts_nobody(make_mount) -> None:
    mount = make_mount("96M", "--unsealed-per-user", "24M")
    os.chmod(mount.path, 0o777)
    kept = [mount.path / f"root{i}.bin" for i in range(8)]
    for path in kept:
        path.write_bytes(os.urandom(4 * MiB))
    filled, error = hoard(mount.path, 32)
    # 24 MiB: six 4 MiB files; the seventh write is refused with the cap's own error.
    assert (filled, error) == (6, errno.EDQUOT)
    assert all(is_stored(path) for path in kept), "a user's open files evicted someone else's"
    # The hoarder's files were closed when it exited: sealed, they no longer count.
    filled, error = hoard(mount.path, 3)
    assert (filled, error) == (3, None)
    # Root is not capped: it may write more than the cap in files it holds open.
    files = [open(mount.path / f"big{i}.bin", "wb") for i in range(8)]
    try:
        for f in files:
            f.write(b"r" * (4 * MiB))
            f.flush()
    finally:
        for f in files:
            f.close()
    assert mount.new_errors() == []


def test_the_cap_counts_charges_and_credits_per_uid() -> None:
    quota = UnsealedBytes(10)
    quota.charge(1000, 6, "a")
    quota.charge(1001, 10, "b")  # another user has a cap of their own
    with pytest.raises(StorageError) as refused:
        quota.charge(1000, 5, "inode 7")
    assert refused.value.errno == errno.EDQUOT and "inode 7: uid 1000" in str(refused.value)
    assert quota.by_uid == {1000: 6, 1001: 10} and quota.refusals == 1
    quota.charge(0, 1 << 40, "root")  # root is not capped
    quota.charge(1000, 100, "copy", capped=False)  # counted, never refused
    quota.credit(1000, 106)
    quota.credit(0, 1 << 40)
    assert quota.by_uid == {1001: 10}
    assert UnsealedBytes(0).charge(5, 1 << 50, "no cap") is None
