"""A rate-limited summary of what left the store and why (pure).

Evictions happen a few files at a time, often many times a second while a tier
is full: one log line each would flood the log, none at the default level hid
them. The node records each batch here and logs the summary at most once per
interval, at INFO.
"""

from __future__ import annotations

from kvfs.config import format_size

SUMMARY_INTERVAL_S = 10.0

REASONS = {"dram": "DRAM tier full", "disk": "SSD tier full", "orphan": "orphaned temp files",
           "lost": "lost from SSD"}


class EvictionSummary:
    def __init__(self, interval_s: float = SUMMARY_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._pending: dict[str, list[int]] = {}  # reason -> [files, bytes] since the last summary
        self._last: float | None = None  # when the last summary was given

    def record(self, reason: str, files: int, nbytes: int) -> None:
        if files:
            counts = self._pending.setdefault(reason, [0, 0])
            counts[0] += files
            counts[1] += nbytes

    def summary(self, now: float) -> str | None:
        """The line to log now, or None (nothing new, or the last one was too recent)."""
        if not self._pending or (self._last is not None and now - self._last < self.interval_s):
            return None
        period = "" if self._last is None else f" in the last {now - self._last:.0f} s"
        self._last = now
        total = sum(files for files, _ in self._pending.values())
        parts = [f"{files} files ({format_size(nbytes)}): {REASONS.get(reason, reason)}"
                 for reason, (files, nbytes) in sorted(self._pending.items())]
        self._pending.clear()
        return f"removed {total} files{period}; " + "; ".join(parts)
