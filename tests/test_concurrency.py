"""Readers keep correct bytes while the file they read is replaced by rename."""

from __future__ import annotations

import os
import threading
from pathlib import Path

MiB = 1 << 20
SIZE = 6 * MiB  # two chunks


def version_bytes(version: int) -> bytes:
    return bytes([version % 251]) * SIZE


def test_readers_see_whole_versions_while_the_file_is_replaced(kvfs_dir: Path) -> None:
    path = kvfs_dir / "hot.bin"
    path.write_bytes(version_bytes(0))
    stop = threading.Event()
    failures: list[str] = []
    reads = [0]

    def replace() -> None:
        for version in range(1, 40):
            tmp = kvfs_dir / f"hot.bin_{version}.tmp"
            tmp.write_bytes(version_bytes(version))
            os.rename(tmp, path)
        stop.set()

    def read() -> None:
        try:
            while not stop.is_set():
                with open(path, "rb") as f:  # never fails: the name always exists
                    first = f.read(MiB)
                    rest = f.read()  # the file is replaced meanwhile: this handle keeps its version
                data = first + rest
                if len(data) != SIZE or data.count(data[:1]) != SIZE:
                    failures.append(f"mixed or short read: {len(data)} bytes, starting {data[:1]!r}")
                reads[0] += 1
        except OSError as error:
            failures.append(f"reader: {error!r}")

    threads = [threading.Thread(target=replace)] + [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:5]
    assert reads[0] > 0
    assert path.read_bytes() == version_bytes(39)
    assert os.listdir(kvfs_dir) == ["hot.bin"]


def test_open_reader_keeps_old_version_after_replacement(kvfs_dir: Path) -> None:
    path = kvfs_dir / "f"
    path.write_bytes(version_bytes(1))
    with open(path, "rb") as old:
        tmp = kvfs_dir / "f.tmp"
        tmp.write_bytes(version_bytes(2))
        os.rename(tmp, path)
        assert old.read() == version_bytes(1)
    assert path.read_bytes() == version_bytes(2)
