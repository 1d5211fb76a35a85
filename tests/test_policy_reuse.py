"""The reuse-aware eviction policy: its order, its equivalence to LRU without a bonus, and replays."""

from __future__ import annotations

import random

from kvfs.policy import LruPolicy, ReusePolicy, make_policy
from kvfs.policy.replay import Request, belady, replay


def test_blocks_used_again_outlive_newer_one_off_blocks() -> None:
    policy = ReusePolicy(bonus=100)
    policy.insert(1, 1, now=0.0)  # block 1, first use
    policy.insert(1, 1, now=1.0)  # block 1 stored again after an eviction: used twice
    policy.remove(1)
    policy.insert(1, 1, now=2.0)  # and a third time
    policy.insert(2, 1, now=3.0)  # block 2, first use
    policy.touch(2, now=4.0)  # used again
    policy.insert(3, 1, now=4.0)  # block 3: a one-off so far
    # Last uses 3 < 5 < 6 would make LRU evict 1 first; by class: 3 (first use: no bonus),
    # then 2 (used twice: +1 x bonus), then 1 (three times: +1.3 x bonus).
    assert list(policy.candidates()) == [3, 2, 1]
    assert len(policy) == 3


def test_without_a_bonus_it_is_lru() -> None:
    rng = random.Random(7)
    trace = [Request(float(i), tuple(rng.randrange(60) for _ in range(rng.randrange(1, 6)))) for i in range(2000)]
    for capacity in (5, 20, 50):
        assert replay(trace, capacity, ReusePolicy(bonus=0)) == replay(trace, capacity, LruPolicy())


def test_it_keeps_a_shared_prefix_that_lru_loses_to_one_off_blocks() -> None:
    # A system prompt (blocks 1, 2) reused every few requests, one-off blocks in between.
    chains = []
    for i in range(40):
        chains.append((1, 2, 1000 + i) if i % 4 == 0 else (2000 + 3 * i, 2001 + 3 * i, 2002 + 3 * i))
    trace = [Request(float(i), chain) for i, chain in enumerate(chains)]
    lru, reuse, optimum = replay(trace, 6, LruPolicy()), replay(trace, 6, ReusePolicy(bonus=50)), belady(trace, 6)
    assert lru < reuse <= optimum


def test_replays_are_deterministic_and_within_capacity() -> None:
    rng = random.Random(3)
    trace = [Request(float(i // 2), tuple(rng.randrange(300) for _ in range(4))) for i in range(3000)]
    first = replay(trace, 40, make_policy("reuse"))  # replay asserts the capacity after every request
    assert replay(trace, 40, make_policy("reuse")) == first


def test_removed_keys_leave_the_order() -> None:
    policy = ReusePolicy()
    for key in range(5):
        policy.insert(key, 1, now=float(key))
    policy.remove(2)
    policy.remove(99)  # unknown keys are ignored
    assert sorted(policy.candidates()) == [0, 1, 3, 4] and len(policy) == 4


def test_a_block_stored_again_under_its_name_is_known_as_reused() -> None:
    policy = ReusePolicy(bonus=100)
    policy.insert(10, 1, now=0.0)  # block "a" as file 10 ...
    policy.identify(10, 777)  # ... published under its name
    policy.remove(10)  # evicted
    policy.identify(11, 777)  # stored again: file 11, same name (named before it is sealed)
    policy.insert(11, 1, now=1.0)
    policy.insert(12, 1, now=2.0)  # a newer one-off block
    assert list(policy.candidates()) == [12, 11]  # the block seen twice outlives it


def test_the_master_names_blocks_so_that_history_survives_eviction() -> None:
    from kvfs.clock import ManualClock
    from kvfs.wire import messages as m
    from kvfs.cluster.master import MasterSettings, MetadataService
    from kvfs.cluster.namespace import ROOT_INO

    master = MetadataService(ManualClock(), ReusePolicy(bonus=100), MasterSettings())

    def store(name: bytes) -> int:  # vLLM's pattern: a temp file, sealed, renamed into place
        opened = master.handle(m.Create(ROOT_INO, name + b".tmp", 0o644, 0, 0, 1, True))
        master.handle(m.Seal(opened.version, 10, 1, [1]))
        master.handle(m.Release(opened.version, writer=True))
        master.handle(m.Rename(ROOT_INO, name + b".tmp", ROOT_INO, name))
        return opened.attr.ino

    first = store(b"a")
    assert master.handle(m.Reclaim(1, 1 << 20)).entries == [(ROOT_INO, b"a", first)]  # evicted
    again, other = store(b"a"), store(b"b")
    assert list(master.policy.candidates()) == [other, again]
