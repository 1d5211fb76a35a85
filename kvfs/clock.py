"""Clocks injected into the pure decision code, so that tests control time."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def wall_ns(self) -> int:
        """Wall-clock time in nanoseconds, for file timestamps."""

    def monotonic(self) -> float:
        """Monotonic seconds, for grace periods and ageing."""


class SystemClock:
    """The real clock."""

    def wall_ns(self) -> int:
        return time.time_ns()

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to (for deterministic tests and replays)."""

    def __init__(self, start_ns: int = 1_700_000_000 * 10**9) -> None:
        self._wall_ns = start_ns
        self._monotonic = 0.0

    def advance(self, seconds: float) -> None:
        self._wall_ns += int(seconds * 1e9)
        self._monotonic += seconds

    def wall_ns(self) -> int:
        return self._wall_ns

    def monotonic(self) -> float:
        return self._monotonic
