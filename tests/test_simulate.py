"""scripts/simulate_leader.py --quick: the leader's costs measured (in-process and through a
real `kvfs master` over TLS), then the simulation's sweep, checked for its invariants:
every request served, utilization growing with load, saturation exactly where the offered
request rate passes one over the mean service time, and the same results from the same seed."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "scripts/simulate_leader.py"
NODES = (1, 4, 16)
RATES = (0.05, 1.0, 50.0)  # requests/s per node: from idle to far past one leader, on any machine


def write_trace(path: Path, requests: int = 300, seed: int = 7) -> None:
    """A trace in the Mooncake release's format: arrivals in ms, input lengths and prefix
    block ids (conversations that grow by a few blocks per turn, so prefixes are reused)."""
    rng = random.Random(seed)
    conversations: list[list[int]] = []
    next_block = 0
    with open(path, "w") as out:
        for i in range(requests):
            if conversations and rng.random() < 0.6:
                blocks = rng.choice(conversations)
            else:
                blocks = []
                conversations.append(blocks)
            new = rng.randint(2, 12)
            blocks.extend(range(next_block, next_block + new))
            next_block += new
            row = {"timestamp": i * 300, "input_length": len(blocks) * 512 + rng.randint(0, 511),
                   "output_length": 100, "hash_ids": list(blocks) + [next_block]}  # (a last, partial block)
            next_block += 1
            out.write(json.dumps(row) + "\n")


def simulate(tmp: Path, *args: str) -> tuple[dict[str, Any], str]:
    out = tmp / f"results-{len(list(tmp.glob('results-*')))}.json"
    done = subprocess.run([sys.executable, SCRIPT, "--quick", "--trace", str(tmp / "trace.jsonl"),
                           "--nodes", ",".join(map(str, NODES)), "--rates", ",".join(map(str, RATES)),
                           "--json", str(out), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text()), done.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    tmp = tmp_path_factory.mktemp("simulate")
    write_trace(tmp / "trace.jsonl")
    results, printed = simulate(tmp, "--costs-out", str(tmp / "costs.json"))
    return tmp, results, printed


def test_every_kind_of_request_has_a_measured_cost(run: tuple[Path, dict[str, Any], str]) -> None:
    tmp, results, printed = run
    measured = json.loads((tmp / "costs.json").read_text())
    remote = measured["remote"]["kinds"]
    for kind in ("lookup_miss", "lookup_hit", "lookup_temp", "mkdir", "create", "seal", "release_write", "rename",
                 "open_read", "release_read", "getattr", "readdir_page", "heartbeat", "watch"):
        assert measured["in_process"]["kinds"][kind]["samples_us"], kind
        assert kind in remote and remote[kind]["throughput_per_s"] > 0, kind
        assert results["costs"]["mean_us"][kind] > 0, kind
        assert f"| {kind} |" in printed
    assert results["costs"]["source"] == "kvfs master over TLS"
    assert remote["lookup_miss"]["rtt_p50_us"] > 0


def test_every_request_is_served_at_every_point(run: tuple[Path, dict[str, Any], str]) -> None:
    points = run[1]["results"]
    assert {(p["nodes"], p["rate_per_node"]) for p in points} == {(n, r) for n in NODES for r in RATES}
    for point in points:
        assert point["served"] == point["requests"] > 0, point
        assert point["stored_chunks"] > 0 and point["leader_requests"] > point["requests"], point
        assert 0.0 <= point["utilization"] <= 1.0 + 1e-9, point
        assert 0.0 < point["answered_locally"] < 1.0, point  # the kernel and the copies answer some, not all


def test_utilization_grows_with_load(run: tuple[Path, dict[str, Any], str]) -> None:
    points = {(p["nodes"], p["rate_per_node"]): p for p in run[1]["results"]}
    for rate in RATES:
        row = [points[(n, rate)] for n in NODES]
        for fewer, more in zip(row, row[1:]):
            assert more["offered_per_s"] > fewer["offered_per_s"]
            assert more["utilization"] >= fewer["utilization"] - 0.02, (fewer, more)
    for nodes in NODES:
        column = [points[(nodes, r)] for r in RATES]
        for slower, faster in zip(column, column[1:]):
            assert faster["offered_per_s"] > slower["offered_per_s"]
            assert faster["utilization"] >= slower["utilization"] - 0.02, (slower, faster)


def test_saturation_is_where_the_arrival_rate_passes_the_service_rate(run: tuple[Path, dict[str, Any], str]) -> None:
    _, results, printed = run
    points = results["results"]
    for point in points:
        capacity = 1e6 / point["mean_service_us"]  # requests/s one leader serves
        assert point["saturated"] == (point["offered_per_s"] >= capacity), point
        # Far past capacity the leader never idles. "Offered" counts all the leader work each
        # trace request brings, part of which (its stores, after its loads) lands past the
        # quick sweep's short window (0.6 s at 4 nodes x 50/s), so the middle half where
        # utilization is measured sees less of it: between 1.5 and 3 that depends on how
        # cheap the measured requests are on the machine (a cheaper leader: a shorter backlog).
        if point["offered_load"] >= 3.0:
            assert point["utilization"] >= 0.9, point
        if point["offered_load"] <= 0.5:  # far below: it mostly idles, as offered
            assert point["utilization"] <= 0.75, point
    saturated = [p for p in points if p["saturated"]]
    idle = [p for p in points if not p["saturated"]]
    assert saturated and idle, "the quick sweep spans both sides of one leader's capacity"
    # Past capacity the queue grows: the heaviest point waits longer than any point below it.
    heaviest = max(saturated, key=lambda p: p["offered_load"])
    assert heaviest["wait_p50_ms"] > max(p["wait_p50_ms"] for p in idle)
    for rate in RATES:
        first = min((p["nodes"] for p in saturated if p["rate_per_node"] == rate), default=None)
        if first is not None:
            assert f"at {rate:g} req/s per node: saturated from {first} nodes" in printed
        else:
            assert f"at {rate:g} req/s per node: not saturated up to {NODES[-1]} nodes" in printed


def test_the_same_seed_gives_the_same_results(run: tuple[Path, dict[str, Any], str]) -> None:
    tmp, results, _ = run
    again, _ = simulate(tmp, "--costs", str(tmp / "costs.json"))  # the same costs, no measuring
    assert again["results"] == results["results"]
    other, _ = simulate(tmp, "--costs", str(tmp / "costs.json"), "--seed", "2")
    assert other["results"] != results["results"]
