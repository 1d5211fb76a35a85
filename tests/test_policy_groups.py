"""Groups in the eviction policies: a group's candidates are the policy's whole order with
the other groups' keys left out (checked against the same policy without groups), and
files that move between groups (a copy moved to SSD) keep their rank."""

from __future__ import annotations

import random

import pytest

from kvfs.cluster.inttable import IntTable
from kvfs.cluster.table import NumberTable
from kvfs.policy import LruPolicy, ReusePolicy, order as order_module
from kvfs.policy.order import StampOrder

GROUPS = [(node, on_disk) for node in (1, 2, 3) for on_disk in (False, True)]


@pytest.mark.parametrize("make", [LruPolicy, lambda: ReusePolicy(bonus=30), ReusePolicy], ids=["lru", "reuse", "auto"])
def test_a_groups_candidates_are_the_whole_order_filtered(make) -> None:
    for seed in range(5):
        rng = random.Random(seed)
        grouped, plain = make(), make()
        group_of: dict[int, tuple[int, bool]] = {}
        for step in range(4000):
            key = rng.randrange(400)
            action = rng.random()
            now = float(step)
            if action < 0.35:
                group_of[key] = rng.choice(GROUPS)
                grouped.insert(key, 1, now, group_of[key])
                plain.insert(key, 1, now)
            elif action < 0.6:
                grouped.touch(key, now)
                plain.touch(key, now)
            elif action < 0.75:
                grouped.remove(key)
                plain.remove(key)
            elif action < 0.85 and key in group_of:  # its copy moved to the other tier (or back)
                node, on_disk = group_of[key]
                group_of[key] = (node, not on_disk)
                grouped.regroup(key, group_of[key])
            else:
                identity = rng.randrange(100)
                grouped.identify(key, identity)
                plain.identify(key, identity)
            if step % 97 == 0:
                whole = list(plain.candidates())
                assert list(grouped.candidates()) == whole, (seed, step)
                for group in GROUPS:
                    assert list(grouped.candidates(group)) == [k for k in whole if group_of[k] == group], (seed, step)
        assert len(grouped) == len(plain)


def _run_grouped(policy, seed: int) -> list[list[int]]:
    """Random inserts, touches, removes, regroups and names; the candidates now and then."""
    rng = random.Random(seed)
    group_of: dict[int, tuple[int, bool]] = {}
    seen: list[list[int]] = []
    for step in range(3000):
        key = rng.randrange(1, 300)
        action = rng.random()
        if action < 0.35:
            group_of[key] = rng.choice(GROUPS)
            policy.insert(key, 1, float(step), group_of[key])
        elif action < 0.6:
            policy.touch(key, float(step))
        elif action < 0.75:
            policy.remove(key)
        elif action < 0.85 and key in group_of:
            group_of[key] = (group_of[key][0], not group_of[key][1])
            policy.regroup(key, group_of[key])
        else:
            policy.identify(key, rng.randrange(1, 100))
        if step % 61 == 0:
            seen.append(list(policy.candidates()))
            seen += [list(policy.candidates(group)) for group in GROUPS]
    seen.append([len(policy)])
    return seen


@pytest.mark.parametrize("make", [LruPolicy, lambda: ReusePolicy(bonus=30), ReusePolicy], ids=["lru", "reuse", "auto"])
def test_keys_in_a_number_table_and_lists_in_parts_rank_as_one_dict(make, monkeypatch: pytest.MonkeyPatch) -> None:
    # The master's layout (kvfs.cluster.master): records in pages of bytes (or keys in pages
    # of slots), and here lists in parts of 3 keys that compact at 2 tombstones (16,384 and
    # 64 in the master), against a policy with a dict whose lists are one part that never
    # compacts in this run.
    for seed in range(4):
        plain = make()
        expected = _run_grouped(plain, seed)
        for table in (NumberTable, IntTable):
            monkeypatch.setattr(order_module, "PART_KEYS", 3)
            monkeypatch.setattr(order_module, "COMPACT_MIN", 2)
            compacted = make()
            compacted.keep_keys_in(table())
            assert _run_grouped(compacted, seed) == expected, (seed, table)
            monkeypatch.undo()
    with pytest.raises(ValueError):
        compacted.keep_keys_in(NumberTable())  # it holds keys: its map cannot change now


def test_a_key_joining_with_an_older_stamp_takes_its_place() -> None:
    order = StampOrder()
    for key, stamp in [(1, 10), (2, 20), (3, 30)]:
        order.add(key, stamp)
    order.add(4, 15)  # moved in from another list, last used between 1 and 2
    order.add(5, 5)
    assert list(order.keys()) == [5, 1, 4, 2, 3] and len(order) == 5
    order.discard(4, 15)
    order.add(4, 40)  # used now: last
    assert order.discard(5, 5) == 5
    assert list(order.keys()) == [1, 2, 3, 4] and list(order.items(1.0)) == [(11, 1), (21, 2), (31, 3), (41, 4)]


def test_unknown_keys_are_ignored() -> None:
    for policy in (LruPolicy(), ReusePolicy()):
        policy.regroup(9, (1, True))
        policy.remove(9)
        policy.touch(9, 0.0)
        assert list(policy.candidates()) == [] and list(policy.candidates((1, True))) == []
