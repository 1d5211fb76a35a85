"""The prefetch gate: lookups that are not followed by opens stop starting transfers."""

from __future__ import annotations

from kvfs.cluster.prefetch import PrefetchGate


def test_the_gate_shuts_when_half_of_the_recent_prefetches_go_unclaimed_and_reopens_later() -> None:
    gate = PrefetchGate(window=8, pause_s=5.0)
    for _ in range(20):  # a loader claims what the lookups fetched
        gate.record(True, now=1.0)
    assert gate.allows(1.0) and gate.pauses == 0
    for claimed in [True, False] * 3 + [True]:  # 3 of the last 8 wasted: still open
        gate.record(claimed, now=2.0)
    assert gate.allows(2.0)
    gate.record(False, now=2.0)  # 4 of 8: `ls -l` or `find` looking names up without opening them
    assert not gate.allows(2.0) and not gate.allows(6.9) and gate.pauses == 1
    assert gate.allows(7.0)  # tried again after the pause, with a fresh window
    for _ in range(7):
        gate.record(False, now=7.0)
    assert gate.allows(7.0)  # a window must fill before the gate judges
    gate.record(False, now=7.0)
    assert not gate.allows(7.0) and gate.pauses == 2
