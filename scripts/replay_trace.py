"""Replay a KV-cache trace against kvfs's eviction policies.

offline: runs the policy code itself over the trace at the given capacities and
prints each policy's block-level prefix hit ratio beside LRU and Belady's MIN
(the optimum), measured in the same run. The last line is `hit_ratio=0.1234`:
the chosen policy's ratio at the first capacity, for scripts.

    python scripts/replay_trace.py offline TRACE --capacity 0.05 --policy default

live (as root): plays the trace through a real single-node kvfs mount per policy
and capacity (vLLM's lookups, loads and stores; each block a file of
--block-size bytes, the DRAM tier sized to the capacity), and prints the hit
ratio the mount delivered beside the offline model's at the same capacity, with
the throughput. The last line is `hit_ratio=…` of the chosen policy, live.

    python scripts/replay_trace.py live TRACE --capacity 0.05 --policy default --part 0.25:0.5

--part A:B replays only that share of the trace's requests (0.25:0.5 is the
second quarter: the conversation trace's first quarter is what the default
policy's constants were chosen on).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvfs.config import format_size, parse_size  # noqa: E402
from kvfs.fuse.mount import find_mount  # noqa: E402
from kvfs.policy import DEFAULT_POLICY, POLICIES, make_policy  # noqa: E402
from kvfs.policy.replay import Request, belady, capacities, load_trace, replay  # noqa: E402
from kvfs.chunks import CHUNK_SIZE  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_replay import LiveResult, replay_live  # noqa: E402

# The daemons started here run side by side: metrics on ports of their own, not 9740/9741.
os.environ.setdefault("KVFS_METRICS_LISTEN", "127.0.0.1:0")


def load_part(trace: str, part: str) -> list[Request]:
    requests = load_trace(Path(trace))
    start, _, stop = part.partition(":")
    return requests[int(float(start) * len(requests)) : int(float(stop or 1) * len(requests))]


def policy_names(chosen: str, others: bool) -> tuple[str, list[str]]:
    chosen = DEFAULT_POLICY if chosen == "default" else chosen
    return chosen, [chosen] + ([name for name in sorted(POLICIES) if name != chosen] if others else [])


def offline(args: argparse.Namespace) -> None:
    requests = load_part(args.trace, args.part)
    chosen, names = policy_names(args.policy, others=True)
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


class Mount:
    """A single-node kvfs mount of its own, for one live replay."""

    def __init__(self, scratch: Path, dram: int, policy: str) -> None:
        self.path = scratch / "mnt"
        self.path.mkdir()
        self.log = scratch / "kvfs.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "kvfs", "mount", str(self.path), "-f", "--dram", str(dram),
                 "--eviction-policy", policy, "--log-level", "warning"],
                stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent)
        deadline = time.monotonic() + 60
        while find_mount(str(self.path)) is None or os.stat(self.path).st_ino != 1:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvfs did not mount; see {self.log}: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=60)


def live(args: argparse.Namespace) -> None:
    if os.geteuid() != 0:
        raise SystemExit("run as root: the live replay mounts kvfs")
    requests = load_part(args.trace, args.part)
    chosen, names = policy_names(args.policy, others=args.compare)
    block_bytes = parse_size(args.block_size, "--block-size")
    fractions = [float(f) for f in args.capacity.split(",")]
    print(f"{Path(args.trace).name}: {len(requests)} requests, blocks of {format_size(block_bytes)}")
    print(f"{'capacity':>9} {'blocks':>8} {'policy':>8} {'live':>8} {'offline':>8} {'failed':>7} "
          f"{'blocks/s':>9} {'GB/s':>6}")
    chosen_ratio = None
    for fraction, wanted in capacities(requests, fractions):
        # DRAM tiers come in whole chunks (and 16 MiB at least): the offline model is
        # run at the number of blocks the mount's tier really holds.
        dram = max(16 << 20, -(-wanted * block_bytes // CHUNK_SIZE) * CHUNK_SIZE)
        blocks = dram // block_bytes
        for name in names:
            with tempfile.TemporaryDirectory(prefix="kvfs-replay-") as scratch:
                mount = Mount(Path(scratch), dram, name)
                try:
                    result = replay_live(mount.path, requests, block_bytes, progress(len(requests)))
                finally:
                    mount.close()
            expected = replay(requests, blocks, make_policy(name))
            moved = (result.hits + result.stored) * block_bytes
            print(f"{fraction:>9.3f} {blocks:>8} {name:>8} {result.hit_ratio:>8.4f} {expected:>8.4f} "
                  f"{result.failed_loads:>7} {result.blocks / result.seconds:>9,.0f} "
                  f"{moved / result.seconds / 1e9:>6.2f}", flush=True)
            if name == chosen and chosen_ratio is None:
                chosen_ratio = result.hit_ratio
    print(f"hit_ratio={chosen_ratio:.4f}")


def progress(total: int):
    def report(done: int, result: LiveResult) -> None:
        print(f"  {done}/{total} requests, hit ratio so far {result.hit_ratio:.4f}", file=sys.stderr, flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    for mode, help_text in (("offline", "simulate the policies over the trace"),
                            ("live", "replay the trace through a kvfs mount")):
        command = modes.add_parser(mode, help=help_text)
        command.add_argument("trace")
        command.add_argument("--capacity", default="0.05,0.1,0.2,0.4" if mode == "offline" else "0.05",
                             help="fractions of the unique blocks")
        command.add_argument("--policy", default="default", choices=["default", *sorted(POLICIES)])
        command.add_argument("--part", default="0:1", help="share of the requests to replay, START:STOP")
    live_mode = modes.choices["live"]
    live_mode.add_argument("--block-size", default="64K", help="bytes per block file")
    live_mode.add_argument("--compare", action="store_true", help="also replay every other policy")
    args = parser.parse_args()
    if args.mode == "offline":
        offline(args)
    else:
        live(args)


if __name__ == "__main__":
    main()
