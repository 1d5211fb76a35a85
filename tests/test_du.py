"""`kvfs du`: per top-level directory, what the cache holds and serves, on real mounts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

from conftest import Cluster

MiB = 1 << 20


def du(*args: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "kvfs", "du", *args], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result


def vllm_store(root: Path, model: str, key: str, size: int) -> Path:
    """As vLLM's fs tier stores a chunk: check, make the parents, write a temp file, rename."""
    path = root / f"{model}_r0" / key[:3] / f"{key[3:5]}_g0" / f"{key}.bin"
    assert not os.path.exists(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + "_7.tmp")
    tmp.write_bytes(os.urandom(size))
    os.rename(tmp, path)
    return path


def test_du_per_model_directory(make_mount) -> None:
    mount = make_mount("256M")
    llama = [vllm_store(mount.path, "llama", f"{k:064x}", 2 * MiB) for k in range(3)]
    vllm_store(mount.path, "qwen", f"{99:064x}", 4 * MiB)
    for path in llama[:2]:
        assert path.read_bytes()
    assert not os.path.exists(mount.path / "llama_r0" / "fff" / "ff_g0" / ("f" * 64 + ".bin"))  # a miss
    for k in range(20):  # names asked for at the root that do not exist: counted under "/", no row each
        assert not os.path.exists(mount.path / f"nothing-{k}")
    rows = {row["name"]: row for row in json.loads(du(str(mount.path), "--json", "--interval", "0").stdout)["dirs"]}
    assert set(rows) == {"llama_r0", "qwen_r0", "/"}
    assert rows["/"]["files"] == 0 and rows["/"]["lookups_absent"] >= 20
    llama_row, qwen_row = rows["llama_r0"], rows["qwen_r0"]
    assert (llama_row["files"], llama_row["bytes"], llama_row["dram_only_bytes"]) == (3, 6 * MiB, 6 * MiB)
    assert (qwen_row["files"], qwen_row["bytes"], qwen_row["ssd_bytes"]) == (1, 4 * MiB, 0)
    assert (llama_row["opens"], llama_row["open_bytes"], qwen_row["opens"]) == (2, 4 * MiB, 0)
    assert llama_row["hits"] == 2  # reader opens of the files held now
    # The miss, and each chunk's check before its store; not the lookups of the temp files.
    assert llama_row["lookups_absent"] >= 4 and qwen_row["lookups_absent"] >= 1
    only = json.loads(du(str(llama[0].parent), "--json", "--interval", "0").stdout)["dirs"]
    assert [row["name"] for row in only] == ["llama_r0"]

    stop = threading.Event()

    def reader() -> None:  # reads all along the sampling interval
        while not stop.is_set():
            llama[2].read_bytes()

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        table = du(str(mount.path), "--interval", "1").stdout.splitlines()
    finally:
        stop.set()
        thread.join()
    assert table[0].startswith(f"mount {mount.path}: 3 top-level entries (rates over ")
    assert table[1].split() == ["DIRECTORY", "FILES", "BYTES", "DRAM-ONLY", "ON", "SSD", "LOOKUPS", "HIT", "READS",
                                "READS/s", "READ/s"]
    first = table[2].split()
    assert first[0] == "llama_r0" and first[1] == "3" and float(first[-3]) > 0 and first[-1].endswith("/s")
    qwen = table[3].split()
    assert qwen[0] == "qwen_r0" and float(qwen[-3]) == 0.0


def test_du_across_a_cluster(cluster: Cluster) -> None:
    first, second = cluster.add_node("128M"), cluster.add_node("128M")
    path = vllm_store(first.path, "llama", f"{1:064x}", 3 * MiB)
    assert (second.path / path.relative_to(first.path)).read_bytes() == path.read_bytes()
    rows = json.loads(du("--master", cluster.master.address, "--json", "--interval", "0").stdout)["dirs"]
    # "/": the lookup of llama_r0 before it was made (an absent name in the root)
    assert [(row["name"], row["files"], row["bytes"], row["opens"]) for row in rows] == [("llama_r0", 1, 3 * MiB, 2),
                                                                                        ("/", 0, 0, 0)]
    from_node = json.loads(du(str(second.path), "--json", "--interval", "0").stdout)["dirs"]
    assert from_node[0]["files"] == 1 and from_node[0]["opens"] == 2
