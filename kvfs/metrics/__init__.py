"""Prometheus metrics: cheap in-loop counters and histograms, and their HTTP exporter."""
