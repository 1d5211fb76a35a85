"""Benchmark cross-node reads against raw Python TCP on loopback, side by side in one run.

Starts `kvfs master` and two `kvfs node` processes (A and B) on loopback. For each
file size, files are written through A's mount; B reads them cold (its page cache
dropped, so the bytes come from A's DRAM over TCP) with vLLM's load pattern (open,
one read of the whole file, close). The baseline moves the same bytes, in the
same per-file requests, from a Python sender process to a receiver that reads
them with recv_into into a preallocated buffer: the best a Python TCP transfer
does here; and the same again over TLS 1.3 with the cluster's certificates (what
kvfs's own connections are), so that the table shows what encryption costs. Also measured: distinct absent-name lookups per second through B's
mount (the master answering from another process), next to the same lookups on a
single-node mount with its embedded master, and present names written through
A, looked up through B in vLLM's lookup pattern (every key once per scheduler
step) in a directory B already asks about (its copy of the directory answers),
next to the same lookups on the single-node mount once its kernel dropped its
entries (every lookup reaching the daemon). Transfers run with one reader and
with PARALLEL readers at once (and as many raw TCP connections). For scale, the
same cold load from a single-node mount's own DRAM (the FUSE path with no
network) is shown too. Rounds interleave the transfers; the table shows medians.

Usage (as root): python scripts/bench_cluster.py [--sizes 2,32] [--total 512M] [--rounds 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import Process
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import drop_page_cache, lookups_per_second, prepare_machine, start_daemon, store_files  # noqa: E402
from kvfs.config import parse_size  # noqa: E402

# The daemons started here run side by side: metrics on ports of their own, not 9740/9741.
os.environ.setdefault("KVFS_METRICS_LISTEN", "127.0.0.1:0")

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
MOONCAKE_TCP_GBS = 0.7  # Mooncake Store's remote get over TCP measured on this machine class
PARALLEL = 4  # readers (and raw TCP streams) in the parallel rows


def issue_bundles(base: Path) -> dict[str, Path]:
    """A CA and the bundles of the master, both nodes and an admin (for --tls-dir)."""
    from kvfs.security import ca

    ca.init_ca(base / "ca")
    bundles = {}
    for name, role in (("master", "master"), ("a", "node"), ("b", "node"), ("bench", "admin")):
        bundles[name] = base / f"tls-{name}"
        ca.issue(base / "ca", name, role, bundles[name], ["127.0.0.1"] if role == "node" else [])
    return bundles


def _tls(bundle: Path | None, server: bool):  # type: ignore[no-untyped-def]
    from kvfs.security.credentials import Tls

    if bundle is None:
        return None
    tls = Tls.load(bundle)
    return tls.server if server else tls.client


def raw_sender(port_holder: int, size: int, count: int, streams: int, bundle: Path | None = None) -> None:
    """Serves `size`-byte replies to 8-byte requests on `streams` connections, each reply
    from the next of `count` distinct preallocated buffers: the same bytes kvfs sends
    (one file each), not one cache-hot buffer."""
    region = mmap.mmap(-1, size * count)
    region.write(os.urandom(size) * count)
    payloads = [memoryview(region)[i * size : (i + 1) * size] for i in range(count)]
    listener = socket.create_server(("127.0.0.1", port_holder))
    context = _tls(bundle, server=True)

    def serve(connection: socket.socket, first: int) -> None:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        if context is not None:
            connection = context.wrap_socket(connection, server_side=True)
        request = bytearray(8)
        sent = first
        while connection.recv_into(request):
            connection.sendall(payloads[sent % count])
            sent += streams

    threads = [threading.Thread(target=serve, args=(listener.accept()[0], i)) for i in range(streams)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def raw_tcp(size: int, count: int, streams: int = 1, bundle: Path | None = None) -> float:
    """GB/s of `count` request/reply transfers of `size` bytes received with recv_into,
    spread over `streams` connections each served and read by its own thread (over TLS 1.3
    with BUNDLE's certificate on both sides, if given)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sender = Process(target=raw_sender, args=(port, size, count, streams, bundle), daemon=True)
    sender.start()
    context = _tls(bundle, server=False)
    clients = []
    deadline = time.monotonic() + 10
    while len(clients) < streams:
        try:
            client = socket.create_connection(("127.0.0.1", port))
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            # The handshake happens at the first send, in the transfer's thread (the sender
            # accepts every connection before it serves any).
            clients.append(client if context is None else context.wrap_socket(client, do_handshake_on_connect=False))
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)

    def transfer(client: socket.socket, transfers: int) -> None:
        target = memoryview(mmap.mmap(-1, size))  # one buffer, as each kvfs reader below uses
        for _ in range(transfers):
            client.sendall(b"\0" * 8)
            got = 0
            while got < size:
                got += client.recv_into(target[got:])

    transfer(clients[0], 1)  # warm-up (the sender has faulted its buffers in by now)
    threads = [threading.Thread(target=transfer, args=(client, count // streams)) for client in clients]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.perf_counter() - start
    for client in clients:
        client.close()
    sender.join(timeout=10)
    return count // streams * streams * size / elapsed / 1e9


def load_in_threads(root: Path, prefix: str, indices: range, size: int, buffers: list[mmap.mmap]) -> None:
    """vLLM's load (open, one read, close) of files `indices`, split over one thread per buffer."""

    def load(share: range, buffer: mmap.mmap) -> None:
        for i in share:
            fd = os.open(root / f"{prefix}{i}.bin", os.O_RDONLY)
            got = os.readv(fd, [buffer])
            os.close(fd)
            assert got == size, f"short read: {got}"

    threads = [threading.Thread(target=load, args=(indices[r :: len(buffers)], buffer))
               for r, buffer in enumerate(buffers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def cold_load(root: Path, prefix: str, count: int, size: int, readers: int = 1) -> float:
    """Files 0..count-1 loaded by `readers` threads, cold."""
    drop_page_cache()
    buffers = [mmap.mmap(-1, size) for _ in range(readers)]
    start = time.perf_counter()
    load_in_threads(root, prefix, range(count), size, buffers)
    return count * size / (time.perf_counter() - start) / 1e9


def lookup_then_load(root: Path, prefix: str, count: int, size: int, readers: int = 1, batch: int = 16) -> float:
    """vLLM's pattern per request: its lookup thread checks that each chunk's file exists
    (`access`, serially), then the loaders load them; `batch` chunks per request. Cold."""
    drop_page_cache()
    buffers = [mmap.mmap(-1, size) for _ in range(readers)]
    start = time.perf_counter()
    for first in range(0, count, batch):
        request = range(first, min(count, first + batch))
        for i in request:
            assert os.access(root / f"{prefix}{i}.bin", os.F_OK)
        load_in_threads(root, prefix, request, size, buffers)
    return count * size / (time.perf_counter() - start) / 1e9


def wait_for(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.access(path, os.F_OK):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} did not appear")
        time.sleep(0.01)


def present_elsewhere(writer: Path, reader: Path, round_: int, keys: int = 2048, steps: int = 5) -> tuple[float, float]:
    """Names stored through `writer`, looked up through `reader` as vLLM's lookup thread
    does (every key once per scheduler step): (first step, the steps after) per second.
    The reader asked about the directory before (as a running vLLM has), so it holds a copy."""
    directory = f"present-{round_}"
    (writer / directory).mkdir()
    (writer / directory / "seen.bin").write_bytes(b"")
    wait_for(reader / directory / "seen.bin")
    for _ in range(2):
        os.access(reader / directory / "absent.bin", os.F_OK)
    store_files(writer / directory, "k", keys, mmap.mmap(-1, 4096))
    paths = [reader / directory / f"k{i}.bin" for i in range(keys)]
    wait_for(paths[-1])
    first = lookups_per_second(paths[:-1], 1)
    steady = lookups_per_second(paths, steps)
    for i in range(keys):
        os.unlink(writer / directory / f"k{i}.bin")
    return first, steady


def present_cold(mount: Path, round_: int, keys: int = 2048) -> float:
    """The single-node reference: present names whose kernel entries were dropped."""
    directory = mount / f"present-{round_}"
    directory.mkdir()
    store_files(directory, "k", keys, mmap.mmap(-1, 4096))
    Path("/proc/sys/vm/drop_caches").write_text("2")
    rate = lookups_per_second([directory / f"k{i}.bin" for i in range(keys)], 1)
    for i in range(keys):
        os.unlink(directory / f"k{i}.bin")
    return rate


def start_master(base: Path, bundle: Path) -> tuple[subprocess.Popen, str]:
    log_path = base / "master.log"
    log = open(log_path, "wb")
    process = subprocess.Popen([sys.executable, "-m", "kvfs", "master", "--listen", "127.0.0.1:0", "--data",
                                str(base / "master-data"), "--tls-dir", str(bundle), "--log-level", "info"],
                               stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 30
    while not (found := re.search(r"master listening on (\S+)", log_path.read_text())):
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the master did not start; see {log_path}")
        time.sleep(0.05)
    return process, found.group(1)


def node_command(name: str, master: str, mountpoint: Path, dram: str, bundle: Path) -> list[str]:
    return [sys.executable, "-m", "kvfs", "node", "--master", master, "--mount", str(mountpoint), "--name", name,
            "--tls-dir", str(bundle), "-f", "--dram", dram, "--log-level", "warning"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,32", help="file sizes in MiB, comma-separated")
    parser.add_argument("--total", default="512M", help="bytes per size and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dram", default="2G", help="each node's DRAM tier")
    parser.add_argument("--lookups", type=int, default=20000, help="distinct absent names per round")
    args = parser.parse_args()
    prepare_machine()
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    total = parse_size(args.total)
    results: dict[str, list[float]] = {}

    def record(metric: str, value: float) -> None:
        results.setdefault(metric, []).append(value)

    with tempfile.TemporaryDirectory(prefix="kvfs-bench-cluster-") as scratch:
        base = Path(scratch)
        bundles = issue_bundles(base)
        os.environ["KVFS_TLS_DIR"] = str(bundles["bench"])
        master, address = start_master(base, bundles["master"])
        processes = [master]
        try:
            a = start_daemon("node-a", node_command("a", address, base / "a", args.dram, bundles["a"]), base / "a")
            b = start_daemon("node-b", node_command("b", address, base / "b", args.dram, bundles["b"]), base / "b")
            single = start_daemon("single", [sys.executable, "-m", "kvfs", "mount", str(base / "single"), "-f",
                                             "--dram", "256M", "--log-level", "warning"], base / "single")
            processes += [a.process, b.process, single.process]
            for round_ in range(args.rounds):
                print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
                for size in sizes:
                    count = max(4, total // size)
                    label = f"{size // MiB}MiB"
                    buffer = mmap.mmap(-1, size)
                    buffer.write(os.urandom(size))
                    prefix = f"r{round_}-{label}-"
                    store_files(a.path, prefix, count, buffer)
                    local_count = min(count, 96 * MiB // size)
                    store_files(single.path, prefix, local_count, buffer)
                    for streams in (1, PARALLEL):
                        record(f"raw TCP {label} x{streams}", raw_tcp(size, count, streams))
                        record(f"raw TLS {label} x{streams}", raw_tcp(size, count, streams, bundles["a"]))
                        record(f"cross-node {label} x{streams}", cold_load(b.path, prefix, count, size, streams))
                        record(f"lookup first {label} x{streams}",
                               lookup_then_load(b.path, prefix, count, size, streams))
                        record(f"local {label} x{streams}", cold_load(single.path, prefix, local_count, size, streams))
                    for i in range(count):
                        os.unlink(a.path / f"{prefix}{i}.bin")
                    for i in range(local_count):
                        os.unlink(single.path / f"{prefix}{i}.bin")
                for name, target in (("node", b), ("single", single)):
                    misses = [target.path / f"{round_}-{i:062x}.miss" for i in range(args.lookups)]
                    record(f"absent lookups/s {name}", lookups_per_second(misses, 1))
                    # vLLM's lookup thread asks for the same keys every scheduler step: the
                    # kernel's negative entries (1 s) answer the repeats.
                    record(f"repeated absent lookups/s {name}", lookups_per_second(misses[:2000], 5))
                first, steady = present_elsewhere(a.path, b.path, round_)
                record("present lookups/s node first step", first)
                record("present lookups/s node later steps", steady)
                record("present lookups/s single cold", present_cold(single.path, round_))
        finally:
            for process in reversed(processes):
                if process is not None:
                    process.terminate()
                    process.wait(timeout=60)
    report(results, sizes)


def report(results: dict[str, list[float]], sizes: list[int]) -> None:
    print(f"{'transfer':<24}{'raw TCP':>9}{'raw TLS':>9}{'kvfs B<-A':>11}{'kvfs local':>12}{'kvfs/raw':>10}"
          f"{'/rawTLS':>9}{'/Mooncake':>11}{'/local':>8}   (GB/s)")
    for size in sizes:
        for pattern, metric in (("open", "cross-node"), ("lookup, open", "lookup first")):
            for streams in (1, PARALLEL):
                label = f"{size // MiB}MiB x{streams}"
                raw = statistics.median(results[f"raw TCP {label}"])
                raw_tls = statistics.median(results[f"raw TLS {label}"])
                kvfs = statistics.median(results[f"{metric} {label}"])
                local = statistics.median(results[f"local {label}"])
                print(f"{label + ' ' + pattern:<24}{raw:>9.2f}{raw_tls:>9.2f}{kvfs:>11.2f}{local:>12.2f}"
                      f"{kvfs / raw:>10.2f}{kvfs / raw_tls:>9.2f}{kvfs / MOONCAKE_TCP_GBS:>11.2f}{kvfs / local:>8.2f}")
    print("(xN: N readers at once, N connections for raw TCP and TLS; vLLM loads with 16 threads. 'open': open,")
    print(" read, close per file; 'lookup, open': vLLM's lookup thread checks 16 files exist, then they load)")
    print()
    for kind in ("absent", "repeated absent"):
        node, single = (statistics.median(results[f"{kind} lookups/s {n}"]) for n in ("node", "single"))
        print(f"{kind} lookups/s: cluster node {node:,.0f} (master in another process), "
              f"single-node mount {single:,.0f}, ratio {node / single:.2f}")
    first, later, cold = (statistics.median(results[f"present lookups/s {kind}"])
                          for kind in ("node first step", "node later steps", "single cold"))
    print(f"present lookups/s of names written on node A, through node B: first step {first:,.0f}, "
          f"later steps {later:,.0f}; single-node mount, kernel entries dropped: {cold:,.0f}")
    print(f"targets: kvfs/raw >= 0.70, kvfs/Mooncake >= 1.5 (Mooncake TCP = {MOONCAKE_TCP_GBS} GB/s, "
          "measured here earlier), absent lookups >= 20000/s, present lookups through B >= 20000/s")


if __name__ == "__main__":
    main()
