"""Replay a KV-cache trace against kvfs's eviction policies.

offline: runs the policy code itself over the trace at the given capacities and
prints each policy's block-level prefix hit ratio beside LRU and Belady's MIN
(the optimum), measured in the same run. The last line is `hit_ratio=0.1234`:
the chosen policy's ratio at the first capacity, for scripts.

    python scripts/replay_trace.py offline TRACE --capacity 0.05 --policy default
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvfs.policy import POLICIES, make_policy  # noqa: E402
from kvfs.policy.replay import belady, capacities, load_trace, replay  # noqa: E402

DEFAULT_POLICY = "lru"


def offline(args: argparse.Namespace) -> None:
    requests = load_trace(Path(args.trace))
    chosen = DEFAULT_POLICY if args.policy == "default" else args.policy
    names = [chosen] + [name for name in sorted(POLICIES) if name != chosen]
    fractions = [float(f) for f in args.capacity.split(",")]
    print(f"{Path(args.trace).name}: {len(requests)} requests")
    print(f"{'capacity':>9} {'blocks':>8} " + " ".join(f"{n:>8}" for n in names) + f" {'MIN':>8} {'gap closed':>10}")
    first = None
    for fraction, blocks in capacities(requests, fractions):
        ratios = {name: replay(requests, blocks, make_policy(name)) for name in names}
        optimum = belady(requests, blocks)
        lru = ratios["lru"]
        closed = (ratios[chosen] - lru) / (optimum - lru) if optimum > lru else 0.0
        print(f"{fraction:>9.3f} {blocks:>8} " + " ".join(f"{ratios[n]:>8.4f}" for n in names)
              + f" {optimum:>8.4f} {closed:>10.1%}", flush=True)
        first = ratios[chosen] if first is None else first
    print(f"hit_ratio={first:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    off = modes.add_parser("offline", help="simulate the policies over the trace")
    off.add_argument("trace")
    off.add_argument("--capacity", default="0.05,0.1,0.2,0.4", help="fractions of the unique blocks")
    off.add_argument("--policy", default="default", choices=["default", *sorted(POLICIES)])
    args = parser.parse_args()
    offline(args)


if __name__ == "__main__":
    main()
