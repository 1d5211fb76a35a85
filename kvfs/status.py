"""What `kvfs status` and `kvfs top` show, from the master or from one mount (pure).

Both sources become the master's `ClusterInfo`: a cluster's comes from the
master (each node's counters ride on its heartbeats); a single-node mount's is
built from its `user.kvfs.stats` attribute. Rendering is plain text: a table of
nodes for `status`, rates between two samples for `top`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from kvfs.wire import messages as m
from kvfs.config import format_size


def info_from_mount_stats(mountpoint: str, stats: dict) -> m.ClusterInfo:
    """A single-node mount's `user.kvfs.stats` as a one-node cluster."""
    activity = msgspec.convert({field: stats[field] for field in m.Activity.__struct_fields__ if field in stats},
                               m.Activity)
    node = m.NodeStatus(int(stats.get("node", 1)), mountpoint, "", True, 0.0, int(stats["dram_capacity"]),
                        int(stats["dram_used"]), int(stats.get("ssd_capacity", 0)), int(stats.get("ssd_used", 0)),
                        int(stats["stored_files"]), int(stats["dram_only_files"]), int(stats["ssd_files"]),
                        int(stats["stored_bytes"]), activity)
    return m.ClusterInfo([node], int(stats["inodes"]), int(stats["files"]), int(stats["sealed_bytes"]))


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _use(used: int, capacity: int) -> str:
    return f"{format_size(used)} / {format_size(capacity)}" if capacity else "-"


def render_status(source: str, info: m.ClusterInfo) -> str:
    lines = [f"{source}: {info.files} files, {format_size(info.sealed_bytes)}, {info.inodes} inodes",
             f"{'NODE':>4} {'NAME':<24} {'ADDRESS':<21} {'STATE':<5} {'DRAM USED/CAP':>21} {'SSD USED/CAP':>21} "
             f"{'FILES':>7} {'DRAM-ONLY':>9} {'ON SSD':>7} {'HIT':>4} {'DRAM HIT':>8} {'BACKLOG':>10} "
             f"{'TRANSPORT':<9} {'SSD I/O':<8}"]
    for n in info.nodes:
        a = n.activity
        opens = a.opens_dram + a.opens_ssd + a.opens_peer
        lines.append(f"{n.node:>4} {n.name[:24]:<24} {(n.address or '-')[:21]:<21} {'up' if n.live else 'down':<5} "
                     f"{_use(n.dram_used, n.dram_capacity):>21} {_use(n.ssd_used, n.ssd_capacity):>21} "
                     f"{n.files:>7} {n.dram_only_files:>9} {n.ssd_files:>7} "
                     f"{percent(a.lookups_found, a.lookups_found + a.lookups_absent):>4} "
                     f"{percent(a.opens_dram, opens):>8} "
                     f"{format_size(a.offload_backlog_bytes) if n.ssd_capacity else '-':>10} "
                     f"{a.transport or '-':<9} {a.io_engine or '-':<8}")
    for n in info.nodes:
        a = n.activity
        if a.offload_failed_files:
            lines.append(f"node {n.node} ({n.name}): {a.offload_failed_files} files "
                         f"({format_size(a.offload_failed_bytes)}) could not be copied to SSD and are only in DRAM: "
                         f"{a.storage_error or 'a storage failure'}")
    lines.append("HIT: names looked up that existed; DRAM HIT: reads served from the node's own DRAM; "
                 "since each node started")
    return "\n".join(lines)


@dataclass(frozen=True)
class Sample:
    at: float  # time.monotonic()
    info: m.ClusterInfo


def _rate(now: int, before: int, seconds: float) -> float:
    return max(0, now - before) / seconds if seconds > 0 else 0.0


def render_top(source: str, previous: Sample, current: Sample) -> str:
    """Rates per node between two samples, like top(1)."""
    seconds = current.at - previous.at
    before = {n.node: n.activity for n in previous.info.nodes}
    info = current.info
    lines = [f"kvfs top - {time.strftime('%H:%M:%S')}  {source}  {info.files} files, "
             f"{format_size(info.sealed_bytes)}  (rates over {seconds:.1f} s)",
             f"{'NODE':>4} {'NAME':<24} {'STATE':<5} {'LOOKUP/s':>9} {'HIT':>4} {'OPEN/s':>8} {'DRAM':>5} "
             f"{'SSD':>5} {'PEER':>5} {'READ/s':>11} {'WRITE/s':>11} {'EVICT/s':>8} {'BACKLOG':>10} "
             f"{'DRAM USED':>10}"]
    for n in info.nodes:
        a, b = n.activity, before.get(n.node, m.Activity())
        found, absent = a.lookups_found - b.lookups_found, a.lookups_absent - b.lookups_absent
        opens = {tier: getattr(a, f"opens_{tier}") - getattr(b, f"opens_{tier}") for tier in ("dram", "ssd", "peer")}
        total_opens = sum(opens.values())
        lines.append(
            f"{n.node:>4} {n.name[:24]:<24} {'up' if n.live else 'down':<5} "
            f"{_rate(found + absent, 0, seconds):>9.0f} {percent(found, found + absent):>4} "
            f"{_rate(total_opens, 0, seconds):>8.0f} "
            + " ".join(f"{percent(opens[tier], total_opens):>5}" for tier in ("dram", "ssd", "peer"))
            + f" {format_size(_rate(a.read_bytes, b.read_bytes, seconds)) + '/s':>11}"
            f" {format_size(_rate(a.written_bytes, b.written_bytes, seconds)) + '/s':>11}"
            f" {_rate(a.evicted_files, b.evicted_files, seconds):>8.1f}"
            f" {format_size(a.offload_backlog_bytes) if n.ssd_capacity else '-':>10}"
            f" {format_size(n.dram_used):>10}")
    return "\n".join(lines)
