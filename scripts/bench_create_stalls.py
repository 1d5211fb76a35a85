"""The longest single Create or Seal as the master's namespace grows: what a structure
that grows by copying itself whole (a dict or set of every file) costs one request.

The pure `MetadataService` of the tree it runs in (run it in each tree to compare), one
node, `--files` files created and sealed as a node does (Create, then Seal with the
writer's release), 1,000 per directory as in vLLM's layout, the creating node's kernel
references held, the dirty sets cleared every 100,000 files as the daemon's saves do,
1 ms of the clock per file (files leave the 30 s publish grace as others close). The cyclic collector is off: its passes are
measured by `bench_loop_bounds.py --growth`. Prints every request over `--over` ms of the
thread's CPU time (a shared machine's waits are not in it) with the file count it came at.
With --base DIR (an older checkout), the same is measured in that tree too, in the same
run, the two trees alternating round by round, and the longest requests are printed side
by side with their ratio base/this.

Usage: python scripts/bench_create_stalls.py [--files 1.5M] [--over 20] [--rounds 1] [--base DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# (--tree: the checkout whose kvfs is measured, for --base's runs; before kvfs is imported)
TREE = Path(sys.argv[sys.argv.index("--tree") + 1]).resolve() if "--tree" in sys.argv else REPO
sys.path.insert(0, str(TREE))

from kvfs.clock import ManualClock  # noqa: E402
from kvfs.cluster.master import MasterSettings, MetadataService  # noqa: E402
from kvfs.cluster.namespace import ROOT_INO  # noqa: E402
from kvfs.policy import DEFAULT_POLICY, make_policy  # noqa: E402
from kvfs.wire import messages as m  # noqa: E402


def count(text: str) -> int:
    return int(float(text.upper().replace("K", "e3").replace("M", "e6")))


Slow = tuple[list[tuple[int, str, float]], float]  # (requests over the threshold, the longest request in ms)


def measure(files: int, over_ms: float, policy: str) -> Slow:
    service = MetadataService(ManualClock(), make_policy(policy), MasterSettings(cluster=True))
    node = service.handle(m.Register("a", "a:1"), 0).node
    service.handle(m.FinishRegistration(), node)
    gc.disable()
    slow: list[tuple[int, str, float]] = []
    most = 0.0
    directory = 0
    for i in range(files):
        if i % 1000 == 0:
            directory = service.handle(m.MkDir(ROOT_INO, b"d-%06d" % (i // 1000), 0o755, 0, 0), node).ino
        if i % 100_000 == 0:
            service.ns.dirty.clear()
            service.objects.dirty.clear()
        service.clock.advance(0.001)
        started = time.thread_time()
        opened = service.handle(m.Create(directory, b"block-%06d.bin" % (i % 1000), 0o644, 0, 0, node, True), node)
        created = time.thread_time()
        service.handle(m.Seal(opened.version, 4096, service.clock.wall_ns(), [i], release=True), node)
        sealed = time.thread_time()
        for what, seconds in (("create", created - started), ("seal", sealed - created)):
            most = max(most, seconds * 1000)
            if seconds * 1000 > over_ms:
                slow.append((i, what, round(seconds * 1000, 1)))
    gc.enable()
    return slow, round(most, 1)


def measured_in(tree: Path, args: argparse.Namespace) -> Slow:
    """`measure` run by this script in a process of its own that imports `tree`'s kvfs."""
    command = [sys.executable, __file__, "--tree", str(tree), "--json", "--files", str(args.files),
               "--over", str(args.over), "--policy", args.policy]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    rows, most = json.loads(done.stdout)
    return [tuple(row) for row in rows], most  # type: ignore[misc]


def print_slow(title: str, measured: Slow) -> None:
    slow, most = measured
    print(title)
    for files, what, ms in slow:
        print(f"  {files:>10,}  {what:<6}  {ms:8.1f}")
    print(f"longest: {most} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=count, default=1_500_000)
    parser.add_argument("--over", type=float, default=20.0, help="ms of CPU a request must exceed to be listed")
    parser.add_argument("--policy", default=DEFAULT_POLICY)
    parser.add_argument("--rounds", type=int, default=1, help="with --base: rounds, the trees alternating")
    parser.add_argument("--base", type=Path, help="an older checkout to measure in the same run")
    parser.add_argument("--tree", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.files, args.over, args.policy)))
        return
    if args.base is None:
        print_slow(f"{args.files} files, {args.policy}: requests over {args.over} ms of CPU (files then, request, ms):",
                   measure(args.files, args.over, args.policy))
        return
    trees = {"base": args.base.resolve(), "this": REPO}
    worst: dict[str, list[float]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for name in order:
            measured = measured_in(trees[name], args)
            print_slow(f"round {round_ + 1}, {name} ({trees[name]}), {args.files} files, {args.policy}: requests over "
                       f"{args.over} ms of CPU (files then, request, ms):", measured)
            worst[name].append(measured[1])
    base, this = max(worst["base"]), max(worst["this"])
    print(f"longest over the rounds: base {base} ms, this {this} ms, base/this "
          f"{base / this if this else float('inf'):.1f}")


if __name__ == "__main__":
    main()
