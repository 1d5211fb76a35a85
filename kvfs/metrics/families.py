"""Metric families built at scrape time from the counters kvfs keeps anyway."""

from __future__ import annotations

from typing import Iterable, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvfs.histogram import Histogram, OperationStats

Labels = tuple[str, ...]


class Families:
    """Collects metric families under the `kvfs_` prefix (counters get `_total` appended)."""

    def __init__(self) -> None:
        self.metrics: list[Metric] = []

    def counter(self, name: str, documentation: str, value: float) -> None:
        self.metrics.append(CounterMetricFamily(f"kvfs_{name}", documentation, value=value))

    def gauge(self, name: str, documentation: str, value: float) -> None:
        self.metrics.append(GaugeMetricFamily(f"kvfs_{name}", documentation, value=value))

    def counters(self, name: str, documentation: str, labels: Iterable[str], values: Mapping[Labels, float]) -> None:
        family = CounterMetricFamily(f"kvfs_{name}", documentation, labels=list(labels))
        for key, value in values.items():
            family.add_metric(list(key), value)
        self.metrics.append(family)

    def gauges(self, name: str, documentation: str, labels: Iterable[str], values: Mapping[Labels, float]) -> None:
        family = GaugeMetricFamily(f"kvfs_{name}", documentation, labels=list(labels))
        for key, value in values.items():
            family.add_metric(list(key), value)
        self.metrics.append(family)

    def histograms(self, name: str, documentation: str, labels: Iterable[str],
                   values: Mapping[Labels, Histogram]) -> None:
        family = HistogramMetricFamily(f"kvfs_{name}", documentation, labels=list(labels))
        for key, histogram in values.items():
            family.add_metric(list(key), histogram.cumulative(), histogram.total)
        self.metrics.append(family)

    def operations(self, name: str, what: str, label: str, stats: OperationStats) -> None:
        """`kvfs_<name>_total{label, result}` and `kvfs_<name>_seconds{label}` for one OperationStats."""
        self.counters(name, f"{what} by {label} and result (ok or the errno's name)", (label, "result"),
                      stats.counts)
        self.histograms(f"{name}_seconds", f"latency of {what} by {label}", (label,),
                        {(key,): histogram for key, histogram in stats.latency.items()})
