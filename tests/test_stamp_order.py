"""A policy's ordered list (kvfs.policy.order.StampOrder) against a plain reference: two
Python lists, the keys in arrival order and the ones that came late sorted, merged. Random
adds (equal stamps, older stamps), discards and reads, with compaction due early and late."""

from __future__ import annotations

import heapq
import random
from bisect import insort

import pytest

from kvfs.policy import order as order_module
from kvfs.policy.order import DEAD, StampOrder


class Reference:
    """The order a StampOrder promises, kept the simplest way."""

    def __init__(self) -> None:
        self.main: list[tuple[float, int]] = []  # arrival order; stamps never go down
        self.late: list[tuple[float, int]] = []  # sorted

    def add(self, key: int, stamp: float) -> None:
        if self.main and stamp < self.main[-1][0]:
            insort(self.late, (stamp, key))
        else:
            self.main.append((stamp, key))

    def discard(self, key: int) -> float:
        for pairs in (self.main, self.late):
            for at, (stamp, other) in enumerate(pairs):
                if other == key:
                    del pairs[at]
                    return stamp
        raise KeyError(key)

    def items(self, shift: float = 0.0) -> list[tuple[float, int]]:
        return [(stamp + shift, key) for stamp, key in heapq.merge(self.main, self.late)]


def _check_shape(order: StampOrder) -> None:
    """What keeps every step bounded: parts of at most PART_KEYS, none empty but a lone one,
    each part's tombstones at most its live keys (or COMPACT_MIN), readers' heads on live
    keys and the last part's end live."""
    assert len(order.parts) == len(order.firsts)
    for index, part in enumerate(order.parts):
        keys = part.keys
        assert len(keys) <= order_module.PART_KEYS and part.live == sum(key != DEAD for key in keys)
        assert len(keys) - part.live <= max(order_module.COMPACT_MIN, part.live)
        assert all(key == DEAD for key in keys[:part.head])
        if part.live:
            assert keys[part.head] != DEAD and part.stamps[0] >= order.firsts[index]
            assert index + 1 == len(order.parts) or part.stamps[-1] <= order.firsts[index + 1]
        else:
            assert len(order.parts) == 1 and not keys
    assert order.size == sum(part.live for part in order.parts)
    if order.size:
        assert order.parts[-1].keys[-1] != DEAD


@pytest.mark.parametrize("part_keys, compact_min", [(1, 0), (4, 0), (7, 3), (None, None)],
                         ids=["parts-of-1", "parts-of-4", "parts-of-7", "default"])
def test_random_operations_keep_the_references_order(part_keys: int | None, compact_min: int | None,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if part_keys is not None:
        monkeypatch.setattr(order_module, "PART_KEYS", part_keys)
        monkeypatch.setattr(order_module, "COMPACT_MIN", compact_min)
    for seed in range(6):
        rng = random.Random(seed)
        order, reference = StampOrder(), Reference()
        stamps: dict[int, float] = {}
        clock = 0.0
        for step in range(3000):
            key = rng.randrange(60)
            action = rng.random()
            if action < 0.45 and key not in stamps:
                if stamps and rng.random() < 0.25:  # an older stamp (a key moved in from another list)
                    stamp = float(rng.randrange(int(clock) + 1))
                else:
                    clock += rng.choice((0.0, 0.0, 1.0))  # equal stamps often
                    stamp = clock
                order.add(key, stamp)
                reference.add(key, stamp)
                stamps[key] = stamp
            elif action < 0.75 and key in stamps:
                assert order.discard(key, stamps[key]) == reference.discard(key) == stamps.pop(key)
            elif action < 0.9 and key in stamps:  # used now: to the end
                order.discard(key, stamps[key])
                reference.discard(key)
                clock += 1.0
                order.add(key, clock)
                reference.add(key, clock)
                stamps[key] = clock
            expected = reference.items()
            assert list(order.items()) == expected, (seed, step)
            assert list(order.keys()) == [key for _, key in expected] and len(order) == len(stamps)
            if step % 50 == 0:
                assert list(order.items(2.5)) == reference.items(2.5)
            _check_shape(order)


@pytest.mark.parametrize("part_keys", [64, None], ids=["parts-of-64", "default"])
def test_discarding_every_key_empties_the_list_and_it_starts_again(part_keys: int | None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    if part_keys is not None:
        monkeypatch.setattr(order_module, "PART_KEYS", part_keys)
        monkeypatch.setattr(order_module, "COMPACT_MIN", 4)
    rng = random.Random(3)
    order = StampOrder()
    stamps = {key: float(key // 3) for key in range(5000)}  # three keys to a stamp, across parts' edges too
    for key, stamp in stamps.items():
        order.add(key, stamp)
    order.add(9999, 0.5)  # late
    stamps[9999] = 0.5
    keys = list(stamps)
    rng.shuffle(keys)
    for step, key in enumerate(keys):
        assert order.discard(key, stamps[key]) == stamps[key]
        if step % 97 == 0:
            _check_shape(order)
    assert len(order) == 0 and list(order.items()) == [] and list(order.keys()) == []
    assert len(order.parts) == 1 and len(order.parts[0].keys) == 0 and len(order.late_keys) == 0
    order.add(1, 0.0)  # (an older stamp than any before: the list is empty, so not late)
    order.add(2, 0.0)
    assert list(order.items()) == [(0.0, 1), (0.0, 2)] and len(order.late_keys) == 0


def test_equal_stamps_keep_arrival_order_through_tombstones_and_compaction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(order_module, "COMPACT_MIN", 2)
    order = StampOrder()
    arrivals = [50, 7, 99, 3, 12, 8, 41, 2]
    for key in arrivals:
        order.add(key, 4.0)
    order.add(1, 5.0)
    part = order.parts[0]
    for key in (7, 3, 8, 2):  # four tombstones among five live keys: no compaction yet
        order.discard(key, 4.0)
    assert len(part.keys) == 9
    assert list(order.keys()) == [50, 99, 12, 41, 1]
    order.discard(12, 4.0)  # five tombstones, four live: compacted
    assert len(part.keys) == 4 and part.head == 0
    assert list(order.items()) == [(4.0, 50), (4.0, 99), (4.0, 41), (5.0, 1)]
    order.add(60, 5.0)  # an equal stamp after compaction: still after the others
    order.add(61, 4.0)  # older than the last: late, merged by (stamp, key) pairs
    assert list(order.keys()) == [50, 61, 99, 41, 1, 60]


def test_equal_stamps_across_parts_are_found_and_keep_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(order_module, "PART_KEYS", 3)
    order = StampOrder()
    for key in range(10):
        order.add(key, 7.0)  # four parts, one stamp
    assert len(order.parts) == 4 and order.firsts == [7.0] * 4
    for key in (9, 0, 5, 4, 3):  # the last part goes (the new last one's end stays live), a middle one
        assert order.discard(key, 7.0) == 7.0
        _check_shape(order)
    assert list(order.keys()) == [1, 2, 6, 7, 8]
    order.add(11, 7.0)
    assert list(order.keys()) == [1, 2, 6, 7, 8, 11]


def test_oldest_first_removals_move_the_heads_and_free_the_parts() -> None:
    # The master's usual pattern: new keys at the end, evictions from the front.
    order = StampOrder()
    total = 3 * order_module.PART_KEYS
    for key in range(1, total + 1):
        order.add(key, float(key))
    assert len(order.parts) == 3
    for key in range(1, total // 2 + 1):
        order.discard(key, float(key))
        first = order.parts[0]
        assert first.keys[first.head] == key + 1  # readers start at the oldest live key
    assert len(order.parts) == 2  # the first part went when its last key did
    assert next(order.keys()) == total // 2 + 1
    assert sum(len(part.keys) for part in order.parts) <= 2 * order.size + order_module.COMPACT_MIN
    assert list(order.keys()) == list(range(total // 2 + 1, total + 1))


def test_a_key_not_there_or_out_of_range_is_refused() -> None:
    order = StampOrder()
    order.add(1, 3.0)
    order.add(2, 4.0)
    order.add(3, 1.0)  # late
    with pytest.raises(KeyError):
        order.discard(1, 4.0)  # a wrong stamp finds nothing
    with pytest.raises(KeyError):
        order.discard(3, 3.0)
    with pytest.raises(KeyError):
        order.discard(4, 1.0)
    for key in (-1, DEAD, 1 << 70):
        with pytest.raises(ValueError):
            order.add(key, 5.0)
    assert list(order.items()) == [(1.0, 3), (3.0, 1), (4.0, 2)]
