"""Latency histograms and per-operation counters, kept by the event loop that does the work.

Cheaper than prometheus-client's own metrics on the request path (no locks: one
trio thread updates them); the exporter turns them into metric families when
Prometheus scrapes.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterator, TypeVar

from kvfs.errors import errno_of

T = TypeVar("T")

# Upper bounds (seconds) from a cached FUSE lookup (~50 µs) to a stalled master RPC.
LATENCY_BUCKETS_S = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
                     250e-3, 500e-3, 1.0, 2.5, 10.0)


class Histogram:
    """Counts of observations at or below each bound (Prometheus' `le`), and their sum."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, observations <= le) pairs ending with +Inf, as HistogramMetricFamily takes them."""
        buckets, running = [], 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            buckets.append((repr(bound), running))
        buckets.append(("+Inf", running + self.counts[-1]))
        return buckets


def outcome_of(code: int) -> str:
    """The label of an operation's result: "ok" or the errno's symbolic name ("ENOENT")."""
    return "ok" if code == 0 else errno.errorcode.get(code, str(code))


@dataclass
class OperationStats:
    """Operations by name and outcome, with a latency histogram per name."""

    counts: dict[tuple[str, str], int] = field(default_factory=dict)
    latency: dict[str, Histogram] = field(default_factory=dict)

    def record(self, name: str, code: int, seconds: float) -> None:
        key = (name, "ok" if code == 0 else outcome_of(code))
        self.counts[key] = self.counts.get(key, 0) + 1
        histogram = self.latency.get(name)
        if histogram is None:
            histogram = self.latency[name] = Histogram()
        histogram.observe(seconds)

    @contextlib.contextmanager
    def _recording(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        code = errno.EINTR  # what stays when the operation is cancelled
        try:
            yield
            code = 0
        except Exception as error:
            code = errno_of(error)
            raise
        finally:
            self.record(name, code, time.perf_counter() - started)

    async def measure(self, name: str, operation: Awaitable[T]) -> T:
        """Awaits `operation`, recording its latency and outcome under `name`."""
        with self._recording(name):
            return await operation

    def timed(self, name: str, operation: Callable[[], T]) -> T:
        """Calls `operation`, recording its latency and outcome under `name`. (Inline rather
        than `_recording`: it wraps every master request, and a generator's context manager
        costs more than most requests' handling.)"""
        started = time.perf_counter()
        try:
            result = operation()
        except Exception as error:
            self.record(name, errno_of(error), time.perf_counter() - started)
            raise
        except BaseException:
            self.record(name, errno.EINTR, time.perf_counter() - started)
            raise
        self.record(name, 0, time.perf_counter() - started)
        return result
