"""The longest single Create or Seal as the master's namespace grows: what a structure
that grows by copying itself whole (a dict or set of every file) costs one request.

The pure `MetadataService` of the tree it runs in (run it in each tree to compare), one
node, `--files` files created and sealed as a node does (Create, then Seal with the
writer's release), 1,000 per directory as in vLLM's layout, the creating node's kernel
references held, the dirty sets cleared every 100,000 files as the daemon's saves do,
1 ms of the clock per file (files leave the 30 s publish grace as others close). The cyclic collector is off: its passes are
measured by `bench_loop_bounds.py --growth`. Prints every request over `--over` ms of the
thread's CPU time (a shared machine's waits are not in it) with the file count it came at.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfs.clock import ManualClock  # noqa: E402
from kvfs.cluster.master import MasterSettings, MetadataService  # noqa: E402
from kvfs.cluster.namespace import ROOT_INO  # noqa: E402
from kvfs.policy import DEFAULT_POLICY, make_policy  # noqa: E402
from kvfs.wire import messages as m  # noqa: E402


def count(text: str) -> int:
    return int(float(text.upper().replace("K", "e3").replace("M", "e6")))


def measure(files: int, over_ms: float, policy: str) -> list[tuple[int, str, float]]:
    service = MetadataService(ManualClock(), make_policy(policy), MasterSettings(cluster=True))
    node = service.handle(m.Register("a", "a:1"), 0).node
    service.handle(m.FinishRegistration(), node)
    gc.disable()
    slow: list[tuple[int, str, float]] = []
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
            if seconds * 1000 > over_ms:
                slow.append((i, what, round(seconds * 1000, 1)))
    gc.enable()
    return slow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=count, default=1_500_000)
    parser.add_argument("--over", type=float, default=20.0, help="ms of CPU a request must exceed to be listed")
    parser.add_argument("--policy", default=DEFAULT_POLICY)
    args = parser.parse_args()
    slow = measure(args.files, args.over, args.policy)
    print(f"{args.files} files, {args.policy}: requests over {args.over} ms of CPU (files then, request, ms):")
    for files, what, ms in slow:
        print(f"  {files:>10,}  {what:<6}  {ms:8.1f}")
    print(f"longest: {max((ms for _, _, ms in slow), default=0.0)} ms")


if __name__ == "__main__":
    main()
