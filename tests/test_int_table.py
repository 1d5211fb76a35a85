"""The eviction policy's records in pages of bytes (kvfs.cluster.inttable): every int comes
back as it went in, at the edges of a slot's width and past them, and a policy that keeps
its records there ranks as one with a dict, alone and inside the real service."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvfs.clock import ManualClock
from kvfs.cluster.inttable import WIDTH, IntTable
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.persist import MasterState
from kvfs.cluster.table import PAGE_SLOTS
from kvfs.policy import LruPolicy, ReusePolicy
from kvfs.wire import messages as m

LAST_IN_SLOT = (1 << 8 * WIDTH) - 1  # the largest value a slot holds
VALUES = [0, 1, 2, 255, 1 << 64, (1 << 143) - 1, LAST_IN_SLOT, LAST_IN_SLOT + 1, 1 << 200, -1, -(1 << 70)]


def test_values_come_back_at_and_past_the_slot_width() -> None:
    table = IntTable()
    keys = [0, 1, PAGE_SLOTS - 1, PAGE_SLOTS, 7 * PAGE_SLOTS + 5, 10**12]
    expected = {}
    for number, value in enumerate(VALUES):
        key = keys[number % len(keys)] + number * 3
        table[key] = expected[key] = value
    assert dict(table.items()) == expected and list(table) == sorted(expected) and len(table) == len(expected)
    for key, value in expected.items():
        assert table[key] == value and table.get(key) == value and key in table
    # Overwritten across the two forms (in the slot, beside the pages) and back.
    key = keys[0]
    for value in (LAST_IN_SLOT + 1, 5, -3, 0, 1 << 300, LAST_IN_SLOT):
        table[key] = expected[key] = value
        assert table[key] == value and len(table) == len(expected)
    assert dict(table.items()) == expected
    for key in list(expected)[::2]:
        assert table.pop(key) == expected.pop(key)
        assert key not in table and table.get(key) is None and table.pop(key, "gone") == "gone"
    for key in list(expected):
        del table[key]
    assert len(table) == 0 and not table and list(table) == [] and repr(table) == "IntTable(0 values in 0 pages)"


def test_refusals_are_a_dicts_or_a_number_tables() -> None:
    table = IntTable()
    with pytest.raises(KeyError):
        table[3]
    with pytest.raises(KeyError):
        del table[3]
    with pytest.raises(KeyError):
        table.pop(-5)
    with pytest.raises(ValueError):
        table[-1] = 1  # numbers are >= 0
    with pytest.raises(ValueError):
        table[1] = 1.5  # type: ignore[assignment]  (a record is an int)
    assert "3" not in table and -1 not in table  # type: ignore[operator]
    assert table.get(-1) is None and table.get(-1, 7) == 7


def test_the_value_last_read_is_never_stale() -> None:
    """Reads after every kind of change of the number last read or written."""
    table = IntTable()
    for value in (5, LAST_IN_SLOT + 1, 6, -2, 0):
        table[9] = value
        assert table.get(9) == value and table[9] == value
    assert table.pop(9) == 0 and table.get(9) is None and 9 not in table
    table[9] = 1 << 300
    table[10] = 4
    assert table.get(9) == 1 << 300 and table.get(10) == 4
    del table[10]
    assert table.get(10, "none") == "none"
    table.clear()
    assert table.get(9) is None and len(table) == 0


def _run(policy, seed: int) -> list[list[int]]:
    """Random inserts, touches, removes, regroups and 60-bit names (the master's identities:
    records up to 143 bits); the order now and then."""
    rng = random.Random(seed)
    groups = [(node, disk) for node in (1, 2) for disk in (False, True)]
    names = [rng.getrandbits(60) for _ in range(40)] + [0, (1 << 60) - 1]
    seen = []
    for step in range(4000):
        key = rng.randrange(1, 400) * rng.choice((1, 997))  # on several pages
        action = rng.random()
        if action < 0.35:
            policy.insert(key, 1, float(step), rng.choice(groups))
        elif action < 0.6:
            policy.touch(key, float(step))
        elif action < 0.72:
            policy.remove(key)
        elif action < 0.8:
            policy.regroup(key, rng.choice(groups))
        else:
            policy.identify(key, rng.choice(names))
        if step % 97 == 0:
            seen.append(list(policy.candidates()))
    seen.append([len(policy)])
    return seen


@pytest.mark.parametrize("make", [LruPolicy, lambda: ReusePolicy(bonus=30), ReusePolicy], ids=["lru", "reuse", "auto"])
def test_a_policy_ranks_the_same_with_its_records_in_the_table(make) -> None:
    for seed in range(3):
        in_table = make()
        in_table.keep_keys_in(IntTable())
        assert _run(in_table, seed) == _run(make(), seed), seed


def _store(svc: MetadataService, parent: int, name: bytes, node: int) -> int:
    opened = svc.handle(m.Create(parent, name, 0o644, 0, 0, node, True), node)
    svc.clock.advance(1)  # type: ignore[attr-defined]
    svc.handle(m.Seal(opened.version, 4096, svc.clock.wall_ns(), [7], release=True), node)
    return opened.attr.ino


def test_the_service_evicts_by_its_records_and_ranks_a_loaded_state(tmp_path: Path) -> None:
    """Through the real service: blocks read twice outlive those never read, each class in
    the order of its last use; a restarted master ranks what it loads by mtime, as before."""
    svc = MetadataService(ManualClock(), ReusePolicy(bonus=1000), MasterSettings(cluster=True, publish_grace_s=0))
    node = svc.handle(m.Register("a", "a:1"), 0).node
    svc.handle(m.FinishRegistration(), node)
    directory = svc.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), node).ino
    names = [b"%064x.bin" % (i * 0x9E3779B97F4A7C15 % (1 << 256)) for i in range(30)]
    inos = [_store(svc, directory, name, node) for name in names]
    svc.clock.advance(60)  # type: ignore[attr-defined]
    read = inos[::3]
    for ino in read * 2:
        opened = svc.handle(m.OpenRead(ino), node)
        svc.handle(m.Release(opened.version, False), node)
    unread = [ino for ino in inos if ino not in read]
    assert list(svc.policy.candidates()) == unread + read
    removed = svc.handle(m.Reclaim(node, 4096 * 4), node)
    assert [ino for _, _, ino in removed.entries] == unread[:4]
    assert [name for _, name, _ in removed.entries] == [names[inos.index(ino)] for ino in unread[:4]]
    state = MasterState(tmp_path / "state")
    try:
        assert state.save(svc)
        fresh = MetadataService(ManualClock(), ReusePolicy(bonus=1000), svc.settings)
        state.load(fresh)
    finally:
        state.close()
    left = [ino for ino in inos if ino not in unread[:4]]
    assert list(fresh.policy.candidates()) == left  # (by mtime: the order they were sealed in)
    assert len(fresh.policy) == len(left) == len(svc.policy)
