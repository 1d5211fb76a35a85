"""The Prometheus endpoints of a running cluster move with real traffic."""

from __future__ import annotations

import errno
import os
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Cluster, KvfsMount, wait_until

MiB = 1 << 20


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_node_and_master_metrics_follow_traffic(cluster: Cluster, tmp_path: Path) -> None:
    writer = cluster.add_node("64M", "--disk", str(tmp_path / "writer-disk"), "--disk-size", "256M", name="writer")
    reader = cluster.add_node("64M", name="reader")
    before_writer, before_reader = scrape(writer.metrics_url), scrape(reader.metrics_url)
    master = scrape(cluster.master.metrics_url)
    assert value(master, "kvfs_node_up", node="writer") == 1 and value(master, "kvfs_node_up", node="reader") == 1

    count, size = 8, 2 * MiB + 100
    (writer.path / "blocks").mkdir()
    payloads = [os.urandom(size) for _ in range(count)]
    for index, data in enumerate(payloads):
        (writer.path / "blocks" / f"{index}.bin").write_bytes(data)
    os.setxattr(writer.path, "user.kvfs.control", b"sync")  # every file is on the writer's SSD
    for index, data in enumerate(payloads):
        assert (reader.path / "blocks" / f"{index}.bin").read_bytes() == data
    assert not (reader.path / "blocks" / "absent.bin").exists()
    with pytest.raises(OSError) as raised:
        (reader.path / "blocks").rmdir()
    assert raised.value.errno == errno.ENOTEMPTY

    w, r = scrape(writer.metrics_url), scrape(reader.metrics_url)
    moved = lambda samples, before, name, **labels: value(samples, name, **labels) - value(before, name, **labels)
    # The reader: opens served by the peer, their bytes, the fetches, and the misses.
    assert moved(r, before_reader, "kvfs_tier_hits_total", tier="peer") == count
    assert moved(r, before_reader, "kvfs_tier_misses_total", tier="dram") == count
    assert moved(r, before_reader, "kvfs_served_bytes_total", tier="peer") == count * size
    assert moved(r, before_reader, "kvfs_peer_fetched_bytes_total") == count * size
    assert moved(r, before_reader, "kvfs_peer_fetches_seconds_count", operation="fetch") >= count
    assert moved(r, before_reader, "kvfs_lookups_total", result="absent") >= 1
    assert moved(r, before_reader, "kvfs_fuse_operations_total", operation="open", result="ok") >= count
    assert moved(r, before_reader, "kvfs_fuse_operations_total", operation="rmdir", result="ENOTEMPTY") == 1
    assert moved(r, before_reader, "kvfs_fuse_operations_seconds_count", operation="read") >= count
    assert moved(r, before_reader, "kvfs_master_rpc_total", request="OpenRead", result="ok") >= count
    assert value(r, "kvfs_master_connected") == 1
    # The writer: what it wrote, copied to SSD and sent to the reader.
    assert moved(w, before_writer, "kvfs_fuse_operations_total", operation="write", result="ok") >= count
    assert moved(w, before_writer, "kvfs_offloaded_files_total") == count
    assert moved(w, before_writer, "kvfs_offloaded_bytes_total") == count * size
    assert moved(w, before_writer, "kvfs_peer_served_bytes_total") == count * size
    assert value(w, "kvfs_tier_used_bytes", tier="ssd") >= count * size
    assert value(w, "kvfs_tier_capacity_bytes", tier="dram") == 64 * MiB
    assert value(w, "kvfs_offload_backlog_files") == 0
    # The master: the namespace, its requests, each node's use from the heartbeats.
    m = scrape(cluster.master.metrics_url)
    assert value(m, "kvfs_files") == count
    assert value(m, "kvfs_sealed_bytes") == count * size
    assert value(m, "kvfs_master_requests_total", request="Create", result="ok") - \
        value(master, "kvfs_master_requests_total", request="Create", result="ok") == count
    assert value(m, "kvfs_master_requests_seconds_count", request="Create") >= count
    wait_until(lambda: value(scrape(cluster.master.metrics_url), "kvfs_node_used_bytes", node="writer", tier="ssd")
               >= count * size, what="the writer's SSD use in the master's metrics")

    # Filling the writer's SSD evicts: the master decides it, the writer counts it.
    for index in range(count, count + 160):
        (writer.path / "blocks" / f"{index}.bin").write_bytes(payloads[index % count])
    os.setxattr(writer.path, "user.kvfs.control", b"sync")
    assert value(scrape(writer.metrics_url), "kvfs_evicted_files_total") > 0
    assert value(scrape(cluster.master.metrics_url), "kvfs_evictions_total") > 0

    # Every series the Grafana dashboard queries is one that kvfs exports.
    exported = {name for samples in (scrape(writer.metrics_url), scrape(reader.metrics_url),
                                     scrape(cluster.master.metrics_url)) for name, _ in samples}
    dashboard = (Path(__file__).resolve().parent.parent / "docs" / "grafana-dashboard.json").read_text()
    queried = set(re.findall(r"\b((?:kvfs|process)_[a-z_]+)", dashboard))
    assert len(queried) > 25 and queried <= exported, sorted(queried - exported)

    # A node that stops is down in the master's metrics.
    reader.stop()
    wait_until(lambda: value(scrape(cluster.master.metrics_url), "kvfs_node_up", node="reader") == 0,
               what="the stopped reader to be down in the master's metrics")


def test_single_node_metrics_and_the_flags_that_turn_them_off(make_mount) -> None:
    kvfs: KvfsMount = make_mount("64M")
    (kvfs.path / "a").write_bytes(b"x" * 5000)
    assert (kvfs.path / "a").read_bytes() == b"x" * 5000
    with pytest.raises(OSError) as raised:
        os.getxattr(kvfs.path / "a", "user.nothing")
    assert raised.value.errno == errno.ENODATA
    samples = scrape(kvfs.metrics_url)
    assert value(samples, "kvfs_files") == 1 and value(samples, "kvfs_sealed_bytes") == 5000
    assert value(samples, "kvfs_tier_hits_total", tier="dram") == 1
    assert value(samples, "kvfs_served_bytes_total", tier="dram") == 5000
    assert value(samples, "kvfs_fuse_operations_total", operation="getxattr", result="ENODATA") >= 1
    assert value(samples, "kvfs_master_rpc_total", request="Create", result="ok") == 1
    assert value(samples, "process_resident_memory_bytes") > 0
    quiet: KvfsMount = make_mount("64M", "--no-metrics")
    assert "metrics on" not in quiet.log_text()
