"""What `kvfs du` shows: per top-level directory (per model in vLLM's layout) the files and
bytes held, by tier, the hit rate of lookups and the rate of reads (pure rendering)."""

from __future__ import annotations

from kvfs.wire import messages as m
from kvfs.config import format_size
from kvfs.status import percent


def select(rows: list[m.DirUsageRow], top: str | None) -> list[m.DirUsageRow]:
    """All rows, or the one of top-level directory `top`."""
    return rows if top is None else [row for row in rows if row.name == top]


def render_du(source: str, previous: m.DirUsageInfo | None, current: m.DirUsageInfo, seconds: float) -> str:
    """A table, largest first; rates between `previous` (counters `seconds` earlier) and `current`."""
    before = {row.name: row for row in previous.dirs} if previous is not None else {}
    rated = previous is not None and seconds > 0
    lines = [f"{source}: {len(current.dirs)} top-level entries"
             + (f" (rates over {seconds:.1f} s)" if rated else ""),
             f"{'DIRECTORY':<40} {'FILES':>8} {'BYTES':>10} {'DRAM-ONLY':>10} {'ON SSD':>10} {'LOOKUPS':>9} "
             f"{'HIT':>4} {'READS':>8} {'READS/s':>8} {'READ/s':>11}"]
    for row in current.dirs:
        lookups = row.lookups_found + row.lookups_absent
        old = before.get(row.name, m.DirUsageRow(row.name))
        opens_rate = (row.opens - old.opens) / seconds if rated else None
        bytes_rate = (row.open_bytes - old.open_bytes) / seconds if rated else None
        lines.append(
            f"{row.name[:40]:<40} {row.files:>8} {format_size(row.bytes):>10} {format_size(row.dram_only_bytes):>10} "
            f"{format_size(row.ssd_bytes):>10} {lookups:>9} {percent(row.lookups_found, lookups):>4} {row.opens:>8} "
            f"{'-' if opens_rate is None else f'{opens_rate:.1f}':>8} "
            f"{'-' if bytes_rate is None else format_size(bytes_rate) + '/s':>11}")
    lines.append("HIT: lookups of names that existed; READS: opens for reading; since the master started")
    return "\n".join(lines)
