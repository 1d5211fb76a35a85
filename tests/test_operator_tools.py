"""`kvfs status`, `kvfs top`, `kvfs inspect` and the user.kvfs.* attributes, on real mounts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import xxhash

from conftest import Cluster, KvfsMount, wait_until, drop_page_cache

MiB = 1 << 20
CHUNK = 4 * MiB


def kvfs(*args: str) -> subprocess.CompletedProcess[str]:
    """A command of the test; against a cluster, as the tests' admin (conftest sets KVFS_TLS_DIR)."""
    result = subprocess.run([sys.executable, "-m", "kvfs", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result


def expected_checksums(data: bytes) -> list[str]:
    return [f"xxh3:{xxhash.xxh3_64_intdigest(data[i:i + CHUNK]):016x}" for i in range(0, len(data), CHUNK)]


def test_status_and_inspect_of_a_single_node_mount(make_mount, tmp_path: Path) -> None:
    mount: KvfsMount = make_mount("64M", "--disk", str(tmp_path / "disk"), "--disk-size", "128M")
    data = os.urandom(2 * CHUNK + 12345)
    path = mount.path / "model" / "block.bin"
    path.parent.mkdir()
    path.write_bytes(data)
    os.setxattr(mount.path, "user.kvfs.control", b"sync")
    assert not (mount.path / "model" / "absent.bin").exists()
    drop_page_cache()
    assert path.read_bytes() == data

    status = json.loads(kvfs("status", str(mount.path), "--json").stdout)
    assert status["files"] == 1 and status["sealed_bytes"] == len(data)
    [node] = status["nodes"]
    assert node["dram_capacity"] == 64 * MiB and node["ssd_capacity"] >= 128 * MiB
    assert node["files"] == 1 and node["ssd_files"] == 1 and node["dram_only_files"] == 0
    assert node["activity"]["opens_dram"] == 1 and node["activity"]["lookups_absent"] >= 1
    assert node["activity"]["written_bytes"] == len(data) and node["activity"]["read_bytes"] == len(data)
    table = kvfs("status", str(mount.path)).stdout
    assert str(mount.path) in table and " up " in table and "64.0 MiB" in table

    facts = json.loads(kvfs("inspect", str(path), "--json").stdout)
    assert facts["size"] == len(data) and facts["sealed"] and facts["stored_here"]
    assert facts["tier"] == "dram+ssd" and facts["on_ssd"]
    assert [chunk["checksum"] for chunk in facts["chunks"]] == expected_checksums(data)
    assert [chunk["length"] for chunk in facts["chunks"]] == [CHUNK, CHUNK, 12345]
    assert facts["hits"] == 1 and facts["last_access_ns"] > 0
    assert len(facts["ssd_extents"].split(",")) == 3
    with open(path, "rb"):  # an open reader holds a lease
        assert os.getxattr(path, "user.kvfs.leases") == b"readers=1 writers=0"
    assert os.getxattr(path, "user.kvfs.leases") == b"readers=0 writers=0"
    text = kvfs("inspect", str(path)).stdout
    assert "3 chunk(s)" in text and expected_checksums(data)[2] in text and "this node" in text

    refused = subprocess.run([sys.executable, "-m", "kvfs", "inspect", str(mount.path / "model")],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "not a file in a kvfs mount" in refused.stderr


def test_status_top_and_inspect_across_a_cluster(cluster: Cluster) -> None:
    writer, reader = cluster.add_node("64M", name="writer"), cluster.add_node("64M", name="reader")
    data = os.urandom(CHUNK + 1)
    (writer.path / "blocks").mkdir()
    for index in range(4):
        (writer.path / "blocks" / f"{index}.bin").write_bytes(data)

    facts = json.loads(kvfs("inspect", str(reader.path / "blocks" / "0.bin"), "--json").stdout)
    assert facts["node_name"] == "writer" and facts["node_up"] and not facts["stored_here"]
    assert facts["tier"] == "peer" and facts["node_address"].startswith("127.0.0.1:")
    assert [chunk["checksum"] for chunk in facts["chunks"]] == expected_checksums(data)

    # `kvfs top` while the reader loads blocks: its reads show as rates of the reader.
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            for index in range(4):
                assert (reader.path / "blocks" / f"{index}.bin").read_bytes() == data
            drop_page_cache()

    loader = threading.Thread(target=load)
    loader.start()
    try:
        wait_until(lambda: json.loads(kvfs("status", "--master", cluster.master.address, "--json").stdout)["nodes"][1]["activity"]["opens_peer"] > 0,
                   what="the reader's opens in its heartbeats")
        screens = kvfs("top", "--master", cluster.master.address, "--interval", "1.2", "--iterations", "2").stdout
    finally:
        stop.set()
        loader.join()
    last = screens.strip().split("kvfs top")[-1].splitlines()
    reader_row = next(line for line in last if " reader " in line)
    columns = reader_row.split()
    assert columns[2] == "up" and int(columns[5]) > 0, reader_row  # OPEN/s
    assert columns[8] == "100%", reader_row  # every open served by the peer
    assert "MiB/s" in reader_row, reader_row

    status = kvfs("status", "--master", cluster.master.address).stdout
    assert "writer" in status and "reader" in status and "HIT" in status
    rows = [line for line in status.splitlines() if " writer " in line or " reader " in line]
    # TRANSPORT (no RDMA here), then SSD I/O (neither node has an SSD tier)
    assert len(rows) == 2 and all(row.split()[-2:] == ["tcp", "-"] for row in rows), status
