"""docs/prometheus.yml and docs/alerts.yml: valid for promtool, each alert fires on the series
that mean trouble (tests/prometheus/alerts_test.yml), and every kvfs metric they use is one
that real daemons export."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from conftest import Cluster
from test_metrics import scrape

ROOT = Path(__file__).resolve().parent.parent


def promtool(*args: str) -> str:
    assert shutil.which("promtool"), "promtool is missing: scripts/install.sh --test installs Debian's prometheus"
    result = subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def test_promtool_accepts_the_rules_and_the_scrape_configuration() -> None:
    assert "SUCCESS: 7 rules found" in promtool("check", "rules", "docs/alerts.yml")
    checked = promtool("check", "config", "docs/prometheus.yml")
    assert "1 rule files found" in checked and "valid prometheus config file" in checked


def test_each_alert_fires_when_it_should() -> None:
    assert "SUCCESS" in promtool("test", "rules", "tests/prometheus/alerts_test.yml")
    rules = set(re.findall(r"alert: (\w+)", (ROOT / "docs" / "alerts.yml").read_text()))
    tested = set(re.findall(r"alertname: (\w+)", (ROOT / "tests" / "prometheus" / "alerts_test.yml").read_text()))
    assert rules == tested == {"KvfsNodeDown", "KvfsTargetDown", "KvfsMasterUnreachable", "KvfsOffloadBacklogGrowing",
                               "KvfsChecksumFailures", "KvfsEnospcRate", "KvfsStorageFailing"}


def test_the_alerts_use_exported_metrics(cluster: Cluster) -> None:
    node = cluster.add_node("64M")
    (node.path / "f").write_bytes(b"x")
    exported = {name for samples in (scrape(node.metrics_url), scrape(cluster.master.metrics_url))
                for name, _ in samples}
    used = set(re.findall(r"\b(kvfs_[a-z_]+)", (ROOT / "docs" / "alerts.yml").read_text()))
    assert used == {"kvfs_node_up", "kvfs_master_connected", "kvfs_offload_backlog_bytes",
                    "kvfs_checksum_failures_total", "kvfs_fuse_operations_total", "kvfs_offload_failed_files"}
    assert used <= exported, sorted(used - exported)
