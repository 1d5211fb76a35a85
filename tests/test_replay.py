"""Trace replay: prefix hit ratios of LRU and Belady's MIN on traces with known answers."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from kvfs.policy import DEFAULT_POLICY, POLICIES, LruPolicy, make_policy
from kvfs.policy.replay import Request, belady, load_trace, replay, unique_blocks

REPO = Path(__file__).resolve().parent.parent


def requests(*chains: tuple[int, ...]) -> list[Request]:
    return [Request(float(i), chain) for i, chain in enumerate(chains)]


def test_known_optimum_beats_lru() -> None:
    trace = requests((1, 2), (3,), (1, 2))
    assert replay(trace, 2, LruPolicy()) == 0.0  # LRU evicted 1 for the one-off 3
    assert belady(trace, 2) == 2 / 5  # MIN drops 3, never used again


def test_only_a_cached_prefix_counts() -> None:
    trace = requests((1, 2, 3), (9, 2, 3))  # 2 and 3 are cached but 9 is not: no hits
    assert replay(trace, 10, LruPolicy()) == 0.0
    assert belady(trace, 10) == 0.0
    assert replay(requests((1, 2), (1, 2, 3)), 10, LruPolicy()) == 2 / 5


def test_unlimited_capacity_hits_every_reuse() -> None:
    trace = requests((1, 2), (1, 2), (1, 3))
    assert replay(trace, 100, LruPolicy()) == belady(trace, 100) == 3 / 6


def test_replay_is_deterministic() -> None:
    trace = requests(*[tuple(range(i % 7, i % 7 + 4)) for i in range(200)])
    assert replay(trace, 5, LruPolicy()) == replay(trace, 5, LruPolicy())


def test_trace_loading_keeps_full_blocks_only(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 1500, "input_length": 1100, "output_length": 5,
                                "hash_ids": [7, 8, 9]}) + "\n")
    assert load_trace(path) == [Request(1.5, (7, 8))]


def test_offline_replay_prints_a_scriptable_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": 2048, "output_length": 1,
                                        "hash_ids": [0, i % 3 + 1, i % 5 + 10, i]}) + "\n" for i in range(50)))
    result = subprocess.run([sys.executable, "scripts/replay_trace.py", "offline", str(path), "--capacity", "0.5",
                             "--policy", "default"], capture_output=True, text=True, cwd=REPO, check=True)
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("hit_ratio=")
    trace = load_trace(path)
    capacity = unique_blocks(trace) // 2
    assert float(last.split("=")[1]) == round(replay(trace, capacity, make_policy(DEFAULT_POLICY)), 4)


def conversation_trace(path: Path, requests: int, seed: int) -> None:
    """Shared prefixes (system prompts, earlier turns) reused among one-off tails."""
    rng = random.Random(seed)
    prefixes = [[1000 * p + i for i in range(rng.randrange(1, 4))] for p in range(1, 31)]
    with open(path, "w") as out:
        for i in range(requests):
            chain = rng.choice(prefixes) + [10**6 + 10 * i + t for t in range(rng.randrange(1, 4))]
            out.write(json.dumps({"timestamp": i, "input_length": 512 * len(chain), "output_length": 1,
                                  "hash_ids": chain}) + "\n")


def test_live_replay_through_a_mount_delivers_the_offline_hit_ratio(tmp_path: Path) -> None:
    """Every policy, played through a real mount with eviction, hits what the offline
    model predicts for the number of blocks the mount's DRAM tier holds, within 0.005
    (docs/eviction.md): a file is sealed (and becomes evictable) when the kernel's
    RELEASE arrives, which may be after the next request's first calls. The kernel
    drops the entry of an evicted file asynchronously, so access() may still find a
    block that a store just evicted and its load fail; the script checks that the block
    is really gone (a load that fails while its file exists stops it) and counts the
    load as a miss, as vLLM does. The model evicted that block too, so it is a miss
    there as well: the ratio holds however many such loads there are, and their number
    is not bounded here, as it grows with how late the kernel's invalidation comes."""
    path = tmp_path / "conversation.jsonl"
    conversation_trace(path, 400, seed=5)
    result = subprocess.run([sys.executable, "scripts/replay_trace.py", "live", str(path), "--capacity", "0.1",
                             "--block-size", "256K", "--compare"], capture_output=True, text=True, cwd=REPO,
                            timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    rows = [line.split() for line in lines if line.split()[0] == "0.100"]
    assert sorted(row[2] for row in rows) == sorted(POLICIES)
    trace = load_trace(path)
    for _, blocks, policy, live, offline, *_ in rows:
        assert int(blocks) < unique_blocks(trace) // 5  # small enough to evict
        assert abs(float(live) - float(offline)) <= 0.005, lines
        assert float(offline) == round(replay(trace, int(blocks), make_policy(policy)), 4)
    assert lines[-1] == f"hit_ratio={next(row[3] for row in rows if row[2] == DEFAULT_POLICY)}"
