"""What one request costs a node and the master: one caller, requests one after the other.

Starts a real `kvfs master` (TLS on loopback) and drives it through one `RemoteMaster`
(a node's client), one request at a time, as a cluster node does for a single writer:
`Lookup`s of absent names (the smallest request that goes through the whole path: TLS,
framing, the authority, the service, the answer) and `Publish`es of block names into one
directory (a node's store of a file: the namespace insert, the policy and the lmdb save
too). Each kind runs back to back, then with a pause of `--gap-us` before each request:
a cluster node's request with one writer comes after the writer's and the node's own work,
so the master waits idle between requests, and a process woken from idle pays more CPU
for the same work than one kept busy. Prints the CPU per request of the master (/proc)
and of the client (this process), medians of the rounds, and the rate; then, per kind, the
CPU after an idle wait as a ratio to back to back in the same round.

Usage (as root, for the TLS bundles' directory): python scripts/bench_master_request.py
[--requests 3000] [--rounds 3] [--gap-us 800]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_metadata import cpu_seconds, free_port, start_master  # noqa: E402
from bench_cluster import issue_bundles  # noqa: E402

os.environ.setdefault("KVFS_METRICS_LISTEN", "127.0.0.1:0")


def own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(requests: int, rounds: int, gap_s: float) -> dict[str, list[tuple[float, float, float]]]:
    """By row (kind, gap): per round, (client µs, master µs per request, requests per second)."""
    import trio

    from kvfs.net.rpc import RemoteMaster
    from kvfs.security.credentials import Tls
    from kvfs.wire import messages as m

    results: dict[str, list[tuple[float, float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="kvfs-bench-request-") as scratch:
        base = Path(scratch)
        bundles = issue_bundles(base)
        process, address = start_master(base, bundles["master"], base / "master")
        host, port = address.rsplit(":", 1)

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                remote = await RemoteMaster.connect(host, int(port), Tls.load(bundles["a"]), nursery)
                node = (await remote.call(m.Register("a", f"127.0.0.1:{free_port()}"))).node
                await remote.call(m.Report([]))
                await remote.call(m.FinishRegistration())

                async def heartbeats() -> None:  # else the node is declared dead
                    while True:
                        await remote.call(m.Heartbeat(1 << 40, 0))
                        await trio.sleep(0.5)

                nursery.start_soon(heartbeats)
                directory = (await remote.call(m.MkDir(1, b"keys", 0o755, 0, 0))).ino
                published = 0

                async def measure(row: str, gap: float, request: Callable[[int], m.Request]) -> None:
                    client, master, started = own_cpu(), cpu_seconds(process.pid), time.perf_counter()
                    for i in range(requests):
                        if gap:
                            time.sleep(gap)  # (blocking: the whole process idles, as a node waiting on FUSE)
                        await remote.call(request(i))
                    elapsed = time.perf_counter() - started
                    results.setdefault(row, []).append(((own_cpu() - client) / requests * 1e6,
                                                        (cpu_seconds(process.pid) - master) / requests * 1e6,
                                                        requests / elapsed))

                for _ in range(rounds):
                    for gap in (0.0, gap_s):
                        label = f"+{gap * 1e6:.0f} us idle" if gap else "back to back"
                        await measure(f"Lookup (absent), {label}", gap,
                                      lambda i: m.Lookup(directory, b"absent-%d" % i))
                        numbers = await remote.call(m.GrantNumbers(requests))

                        def publish(i: int, first: int = numbers.first_ino, offset: int = published) -> m.Request:
                            now = time.time_ns()
                            return m.Publish(directory, b"%064x.bin" % (offset + i), node, first + i, first + i,
                                             0o644, 0, 0, 4096, [0], now, now)

                        await measure(f"Publish, {label}", gap, publish)
                        published += requests
                nursery.cancel_scope.cancel()

        try:
            trio.run(main)
        finally:
            process.terminate()
            process.wait()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000, help="requests of each kind per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gap-us", type=float, default=800.0, help="idle time before each request, second pass")
    args = parser.parse_args()
    results = run(args.requests, args.rounds, args.gap_us / 1e6)
    print(f"{'request':<34} {'client us':>10} {'master us':>10} {'per s':>8}   (medians of {args.rounds} rounds; "
          "each round's client / master)")
    for row, values in results.items():
        client, master, rate = (statistics.median(v[i] for v in values) for i in range(3))
        rounds = " ".join(f"{c:.0f}/{w:.0f}" for c, w, _ in values)
        print(f"{row:<34} {client:>10.0f} {master:>10.0f} {rate:>8.0f}   {rounds}")
    print("idle against back to back, the median of each round's ratio (the same round, one after the other):")
    for kind in ("Lookup (absent)", "Publish"):
        idle = next(values for row, values in results.items() if row.startswith(kind) and "idle" in row)
        busy = results[f"{kind}, back to back"]
        client, master = (statistics.median(i[n] / b[n] for i, b in zip(idle, busy)) for n in (0, 1))
        print(f"  {kind}: client CPU per request x{client:.2f}, master x{master:.2f}")


if __name__ == "__main__":
    main()
