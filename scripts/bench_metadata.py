"""Benchmark the metadata path at 10K, 100K and 1M files, in one run.

Three layers, each measured with the same figures:

- the pure `MetadataService`, in this process: create (Create, Seal, Release), lookup,
  a full listing by pages, `bytes_per_file` (tracemalloc; VmRSS growth beside it) and
  `restart_s` (save everything to lmdb, then load it into a fresh service);
- a real `kvfs master` through `RemoteMaster` clients (registered as nodes, CONCURRENT
  callers each), over TLS on loopback: creates, lookups, a listing, the master's memory
  per file (`bytes_per_file`: RssAnon growth, its own heap; VmRSS growth beside it, which
  adds lmdb's mapped file pages) and CPU per request (/proc), and a kill -9 and restart timed until it
  answers with the namespace; with --base DIR, DIR's master too, in the same rounds;
- a cluster node's FUSE mount next to a single-node `kvfs mount`, in alternating rounds:
  the store (create a temp file exclusively, one write, close, rename) with 1 and 16
  writers in two patterns (one flat directory, LMCache's; vLLM's hashed three-level layout
  with its access() and parents' stat before each create), lookups of present names once the kernel dropped its entries, a listing, and
  the daemons' RSS growth per file; the node/single ratio of each. The node's requests
  to the master per create, by type, are read from its metrics.

Counts above --fuse-max are measured on the first two layers only (going through FUSE at
that count takes longer than a run should); the output says so. Medians over --rounds.

Usage (as root): python scripts/bench_metadata.py [--counts 10K,100K,1M] [--rounds 3] [--base DIR]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import urllib.request
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import drop_dentries, start_daemon  # noqa: E402
from bench_cluster import issue_bundles  # noqa: E402
from kvfs.fuse.mount import find_mount  # noqa: E402

# The daemons started here run side by side: metrics on ports of their own, not 9740/9741.
os.environ.setdefault("KVFS_METRICS_LISTEN", "127.0.0.1:0")

REPO = Path(__file__).resolve().parent.parent
BLOCK = bytes(4096)  # one small KV block per file: the metadata path dominates
CONCURRENT = 8  # callers per RemoteMaster client
CLIENTS = 2  # RemoteMaster connections (as two nodes)
WRITERS = (1, 16)
# Stores: "flat", one directory of `<key>` + `.tmp` names (LMCache's fs connector, and the first
# pattern measured here); "hashed", vLLM's three-level layout with its access() and parents' stat.
PATTERNS = ("flat", "hashed")
PAGE = 256  # entries per ReadDir, as a node asks (kvfs.fuse.operations.READDIR_BATCH)


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1000, "M": 1000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * scale)


def short(count: int) -> str:
    """10K, 100K, 1M."""
    return f"{count // 1000_000}M" if count >= 1000_000 and not count % 1000_000 else f"{count // 1000}K"


def status_bytes(pid: int, field: str) -> int:
    """A size field of /proc/PID/status (kB) in bytes; 0 if the kernel has none."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rss_bytes(pid: int) -> int:
    """Resident memory, file-backed pages included (a master's are lmdb's map: page cache)."""
    return status_bytes(pid, "VmRSS")


def anon_bytes(pid: int) -> int:
    """Resident anonymous memory: the process's own heap, not lmdb's mapped file pages,
    which the kernel may drop and VmRSS counts as RssFile."""
    return status_bytes(pid, "RssAnon")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(port: int, family: str) -> dict[str, float]:
    """`kvfs_<family>_total` samples of a daemon's metrics, by their first label's value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found: dict[str, float] = {}
    for match in re.finditer(rf'^kvfs_{family}_total{{\w+="([^"]+)",result="ok"}} (\S+)$', text, re.M):
        found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
    return found


class Results:
    def __init__(self) -> None:
        self.values: dict[tuple[str, str], list[float]] = {}
        self.notes: list[str] = []

    def record(self, layer: str, metric: str, value: float) -> None:
        self.values.setdefault((layer, metric), []).append(value)

    def median(self, layer: str, metric: str) -> float | None:
        values = self.values.get((layer, metric))
        return statistics.median(values) if values else None


# The pure service -----------------------------------------------------------------------


def pure_service(count: int, base: Path, results: Results, traced: bool) -> None:
    """Creates `count` files in one directory of an in-process MetadataService. With
    `traced`, tracemalloc counts the bytes per file (and slows the creates: their rate is
    then not recorded)."""
    from kvfs.clock import SystemClock
    from kvfs.cluster.master import MasterSettings, MetadataService
    from kvfs.cluster.persist import MasterState
    from kvfs.policy import make_policy
    from kvfs.wire import messages as m

    layer = f"service {short(count)}"
    gc.collect()
    rss_before = rss_bytes(os.getpid())
    if traced:
        tracemalloc.start()
    service = MetadataService(SystemClock(), make_policy("lru"), MasterSettings(cluster=True))
    node = service.handle(m.Register("bench", "127.0.0.1:1")).node
    service.handle(m.FinishRegistration(), node)
    directory = service.handle(m.MkDir(1, b"keys", 0o755, 0, 0), node).ino
    traced_before = tracemalloc.get_traced_memory()[0] if traced else 0
    names = [f"{i:064x}.bin".encode() for i in range(count)]
    started = time.perf_counter()
    for name in names:
        opened = service.handle(m.Create(directory, name, 0o644, 0, 0, node, True), node)
        service.handle(m.Seal(opened.version, 4096, time.time_ns(), [0], release=True), node)  # a node's close (its mtime)
    elapsed = time.perf_counter() - started
    if traced:
        results.record(layer, "bytes_per_file", (tracemalloc.get_traced_memory()[0] - traced_before) / count)
        tracemalloc.stop()
    else:
        results.record(layer, "creates_per_s", count / elapsed)
        results.record(layer, "rss_bytes_per_file", (rss_bytes(os.getpid()) - rss_before) / count)
    started = time.perf_counter()
    for name in names:
        service.handle(m.Lookup(directory, name), node)
    results.record(layer, "lookups_per_s", count / (time.perf_counter() - started))
    started = time.perf_counter()
    listed, start_id = 0, 0
    while True:
        page = service.handle(m.ReadDir(directory, start_id, PAGE), node).entries
        listed += len(page)
        if not page:
            break
        start_id = page[-1].next_id
    results.record(layer, "listing_s", time.perf_counter() - started)
    if listed != count:
        results.notes.append(f"{layer}: the listing showed {listed} of {count} entries")
    data = base / f"service-{count}"
    started = time.perf_counter()
    state = MasterState(data)
    state.save(service)
    state.sync()
    state.close()
    fresh = MetadataService(SystemClock(), make_policy("lru"), MasterSettings(cluster=True))
    state = MasterState(data)
    loaded = state.load(fresh)
    state.close()
    results.record(layer, "restart_s", time.perf_counter() - started)
    if loaded != count:
        results.notes.append(f"{layer}: the restart loaded {loaded} of {count} files")
    del service, fresh, names
    gc.collect()


# A real master through RemoteMaster clients ---------------------------------------------


def start_master(base: Path, bundle: Path, data: Path, repo: Path = REPO) -> tuple[subprocess.Popen, str]:
    log_path = base / "master.log"
    with open(log_path, "ab") as log:
        offset = log.tell()
        process = subprocess.Popen([sys.executable, "-m", "kvfs", "master", "--listen", "127.0.0.1:0", "--data",
                                    str(data), "--tls-dir", str(bundle), "--log-level", "info"],
                                   stdout=log, stderr=subprocess.STDOUT, cwd=repo)
    deadline = time.monotonic() + 600
    while True:
        with open(log_path, "rb") as log:
            log.seek(offset)
            found = re.search(rb"master listening on (\S+)", log.read())
        if found:
            return process, found.group(1).decode()
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the master did not start; see {log_path}")
        time.sleep(0.01)


def remote_master(count: int, base: Path, bundles: dict[str, Path], results: Results, repo: Path = REPO,
                  name: str = "master") -> None:
    """Creates `count` files through a `kvfs master` (REPO's checkout's) with CLIENTS connections of
    CONCURRENT callers; the master's CPU per request is read from /proc around each phase."""
    import trio

    from kvfs.net.rpc import RemoteMaster
    from kvfs.security.credentials import Tls
    from kvfs.wire import messages as m

    layer = f"{name} {short(count)}"
    data = base / f"{name.replace(' ', '-')}-{count}"
    process, address = start_master(base, bundles["master"], data, repo)
    host, port = address.rsplit(":", 1)
    rss_before, anon_before = rss_bytes(process.pid), anon_bytes(process.pid)
    names = [f"{i:064x}.bin".encode() for i in range(count)]

    async def connect(nursery: trio.Nursery, name: str) -> tuple[RemoteMaster, int]:
        remote = await RemoteMaster.connect(host, int(port), Tls.load(bundles[name]), nursery)
        node = (await remote.call(m.Register(name, f"127.0.0.1:{free_port()}"))).node
        await remote.call(m.Report([]))
        await remote.call(m.FinishRegistration())

        async def heartbeats() -> None:  # else the node is declared dead and its files hidden
            while True:
                await remote.call(m.Heartbeat(1 << 40, 0))
                await trio.sleep(0.5)

        nursery.start_soon(heartbeats)
        return remote, node

    async def in_parallel(work: Callable[[RemoteMaster, int, list[bytes]], Any],
                          clients: list[tuple[RemoteMaster, int]]) -> float:
        started = time.perf_counter()
        async with trio.open_nursery() as nursery:
            callers = len(clients) * CONCURRENT
            for index in range(callers):
                remote, node = clients[index % len(clients)]
                nursery.start_soon(work, remote, node, names[index::callers])
        return time.perf_counter() - started

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            clients = [await connect(nursery, name) for name in ("a", "b")[:CLIENTS]]
            remote, node = clients[0]
            directory = (await remote.call(m.MkDir(1, b"keys", 0o755, 0, 0))).ino

            async def create(remote: RemoteMaster, node: int, share: list[bytes]) -> None:
                for name in share:
                    opened = await remote.call(m.Create(directory, name, 0o644, 0, 0, node, True))
                    await remote.call(m.Seal(opened.version, 4096, time.time_ns(), [0], release=True))  # a node's close (its mtime)

            async def lookup(remote: RemoteMaster, node: int, share: list[bytes]) -> None:
                for name in share:
                    await remote.call(m.Lookup(directory, name))

            cpu = cpu_seconds(process.pid)
            results.record(layer, "creates_per_s", count / await in_parallel(create, clients))
            cpu, spent = cpu_seconds(process.pid), cpu_seconds(process.pid) - cpu
            results.record(layer, "create_cpu_us", spent / (2 * count) * 1e6)  # per request: Create, Seal
            results.record(layer, "bytes_per_file", (anon_bytes(process.pid) - anon_before) / count)
            results.record(layer, "rss_bytes_per_file", (rss_bytes(process.pid) - rss_before) / count)
            results.record(layer, "lookups_per_s", count / await in_parallel(lookup, clients))
            results.record(layer, "lookup_cpu_us", (cpu_seconds(process.pid) - cpu) / count * 1e6)
            started = time.perf_counter()
            start_id = listed = 0
            while page := (await remote.call(m.ReadDir(directory, start_id, PAGE))).entries:
                listed += len(page)
                start_id = page[-1].next_id
            results.record(layer, "listing_s", time.perf_counter() - started)
            if listed != count:
                results.notes.append(f"{layer}: the listing showed {listed} of {count} entries")
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
        process.send_signal(signal.SIGKILL)
        process.wait()
        started = time.perf_counter()
        process, address = start_master(base, bundles["master"], data, repo)
        host, port = address.rsplit(":", 1)

        async def files() -> int:
            async with trio.open_nursery() as nursery:
                remote = await RemoteMaster.connect(host, int(port), Tls.load(bundles["bench"]), nursery)
                stats = await remote.call(m.Stats())
                nursery.cancel_scope.cancel()
                return stats.files

        loaded = trio.run(files)
        results.record(layer, "restart_s", time.perf_counter() - started)
        if loaded != count:
            results.notes.append(f"{layer}: the restarted master knew {loaded} of {count} files")
    finally:
        process.kill()
        process.wait()


# Through FUSE: a cluster node next to a single-node mount --------------------------------


def run_writers(write: Callable[[range], None], count: int, writers: int) -> float:
    """Files `count` files' indices out to `writers` threads running `write`: files per second."""
    threads = [threading.Thread(target=write, args=(range(w, count, writers),)) for w in range(writers)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return count / (time.perf_counter() - started)


def store(root: Path, prefix: str, count: int, writers: int) -> float:
    """vLLM's store of `count` files by `writers` threads: creates per second."""

    def write(indices: range) -> None:
        for i in indices:
            final = root / f"{prefix}{i:060x}.bin"
            tmp = root / f"{prefix}{i:060x}.bin_{threading.get_ident()}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC, 0o644)
            os.write(fd, BLOCK)
            os.close(fd)
            os.rename(tmp, final)

    return run_writers(write, count, writers)


MODEL_DIR = "bench-model_0123456789ab_r0"  # vLLM's `<model>_<digest12>_r0`


def hashed_path(root: Path, i: int) -> Path:
    """vLLM's layout: `<model>_<digest12>_r0/<hhh>/<hh>_g<group>/<hash64hex>.bin`, the hash a
    sha256 (here of the file's index), its first hex digits naming the two directory levels."""
    digest = hashlib.sha256(i.to_bytes(8, "little")).hexdigest()
    return root / MODEL_DIR / digest[:3] / f"{digest[3:5]}_g0" / f"{digest}.bin"


def warm_hashed(root: Path, count: int) -> None:
    """The state after warm-up (untimed): the parents of the files `store_hashed` will store exist,
    as most do once a vLLM instance has stored for a while (fan-out 4,096 x 256)."""
    for i in range(count):
        hashed_path(root, i).parent.mkdir(parents=True, exist_ok=True)


def store_hashed(root: Path, count: int, writers: int) -> float:
    """vLLM's store of `count` files in its hashed layout by `writers` threads, steps 1-6 of
    /work/shared/CONSUMERS.md: access(dest), stat (and mkdir where missing) of the parents, an
    exclusive create of `<name>.bin_<rand63>.tmp`, one write, close, rename. Creates per second."""

    def parents(path: Path) -> None:
        try:
            os.stat(path.parent)
            return
        except FileNotFoundError:
            pass
        for level in reversed(path.parents[:3]):
            try:
                os.stat(level)
            except FileNotFoundError:
                try:
                    os.mkdir(level, 0o777)
                except FileExistsError:
                    pass

    def write(indices: range) -> None:
        for i in indices:
            final = hashed_path(root, i)
            if os.access(final, os.F_OK):
                continue
            parents(final)
            tmp = final.with_name(f"{final.name}_{random.getrandbits(63)}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC, 0o644)
            os.write(fd, BLOCK)
            os.close(fd)
            os.rename(tmp, final)

    return run_writers(write, count, writers)


def present_lookups(root: Path, prefix: str, count: int) -> tuple[float, int]:
    """stat of every stored name once the kernel dropped its entries: (per second, names missing)."""
    drop_dentries()
    missing = 0
    started = time.perf_counter()
    for i in range(count):
        try:
            os.stat(root / f"{prefix}{i:060x}.bin")
        except FileNotFoundError:
            missing += 1
    return count / (time.perf_counter() - started), missing


def listing(root: Path) -> tuple[float, int]:
    drop_dentries()
    started = time.perf_counter()
    with os.scandir(root) as entries:
        listed = sum(1 for _ in entries)
    return time.perf_counter() - started, listed


def fuse_round(targets: dict[str, Any], count: int, round_: int, results: Results) -> None:
    for pattern in PATTERNS:
        for writers in WRITERS:
            for name, target in targets.items():  # node and single alternate within the round
                directory = target.path / f"{pattern}{count}-{round_}-{writers}"
                directory.mkdir()
                if pattern == "hashed":
                    warm_hashed(directory, count)
                before = scrape(target.metrics, "master_rpc") if target.metrics else {}
                cpu = {process: cpu_seconds(pid) for process, pid in target.cpu_pids.items()}
                if pattern == "flat":
                    rate = store(directory, "k", count, writers)
                else:
                    rate = store_hashed(directory, count, writers)
                results.record(f"fuse {short(count)} {name}", f"{pattern} x{writers}", rate)
                for process, pid in target.cpu_pids.items():  # milliseconds of CPU per file stored
                    results.record(f"cpu {pattern} x{writers}", process,
                                   (cpu_seconds(pid) - cpu[process]) * 1000 / count)
                if target.metrics:
                    after = scrape(target.metrics, "master_rpc")
                    for request, total in after.items():
                        per_create = (total - before.get(request, 0.0)) / count
                        if per_create > 0:  # (GrantNumbers: one per 4,096 files)
                            results.record(f"rpc {pattern} x{writers}", request, per_create)
    for name, target in targets.items():
        layer = f"fuse {short(count)} {name}"
        directory = target.path / f"flat{count}-{round_}-1"
        rate, missing = present_lookups(directory, "k", count)
        results.record(layer, "lookups_per_s", rate)
        if missing:
            results.notes.append(f"{layer} round {round_ + 1}: {missing} of {count} stored names not found")
        elapsed, listed = listing(directory)
        results.record(layer, "listing_s", elapsed)
        if listed != count:
            results.notes.append(f"{layer}: the listing showed {listed} of {count} entries")


def fuse_layers(counts: list[int], rounds: int, base: Path, bundles: dict[str, Path], results: Results,
                dram: str = "4G") -> None:
    if not counts:
        return
    master, address = start_master(base, bundles["master"], base / "fuse-master")
    node_metrics = free_port()
    processes = [master]
    try:
        node = start_daemon("node", [sys.executable, "-m", "kvfs", "node", "--master", address, "--mount",
                                     str(base / "node"), "--name", "a", "--tls-dir", str(bundles["a"]), "-f",
                                     "--dram", dram, "--log-level", "warning",
                                     "--metrics-listen", f"127.0.0.1:{node_metrics}"], base / "node")
        processes.append(node.process)
        single = start_daemon("single", [sys.executable, "-m", "kvfs", "mount", str(base / "single"), "-f",
                                         "--dram", dram, "--log-level", "warning"], base / "single")
        processes.append(single.process)
        node.metrics, single.metrics = node_metrics, 0  # type: ignore[attr-defined]
        node.cpu_pids = {"node": node.process.pid, "master": master.pid}  # type: ignore[attr-defined]
        single.cpu_pids = {"single": single.process.pid}  # type: ignore[attr-defined]
        for count in counts:
            rss = {name: rss_bytes(t.process.pid) for name, t in (("node", node), ("single", single))}
            rss["master"] = rss_bytes(master.pid)
            for round_ in range(rounds):
                print(f"FUSE {count} files, round {round_ + 1}/{rounds}", file=sys.stderr, flush=True)
                fuse_round({"node": node, "single": single}, count, round_, results)
            files = count * len(WRITERS) * len(PATTERNS) * rounds
            label = f"{short(count)}"
            node_growth = rss_bytes(node.process.pid) - rss["node"] + rss_bytes(master.pid) - rss["master"]
            results.record(f"fuse {label} node", "bytes_per_file", node_growth / files)
            results.record(f"fuse {label} single", "bytes_per_file",
                           (rss_bytes(single.process.pid) - rss["single"]) / files)
    finally:
        for process in reversed(processes):
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for mountpoint in (base / "node", base / "single"):  # a daemon killed above left its mount
            if find_mount(str(mountpoint)) is not None:
                subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], check=False)


# Report ---------------------------------------------------------------------------------


METRICS = ("bytes_per_file", "creates_per_s", "lookups_per_s", "listing_s", "restart_s", "create_cpu_us",
           "lookup_cpu_us")


def report(results: Results, counts: list[int], fuse_counts: list[int], layers: set[str]) -> None:
    def cell(value: float | None) -> str:
        if value is None:
            return f"{'-':>16}"
        return f"{value:>16.3f}" if value < 100 else f"{value:>16,.0f}"

    print(f"{'layer':<22}" + "".join(f"{metric:>16}" for metric in METRICS + ("rss_bytes/file",)))
    for count in counts:
        for layer in (f"service {short(count)}", f"master {short(count)}", f"base master {short(count)}"):
            row = [results.median(layer, metric) for metric in METRICS]
            row.append(results.median(layer, "rss_bytes_per_file"))
            if any(value is not None for value in row):
                print(f"{layer:<22}" + "".join(cell(value) for value in row))
    print("(service: in-process, bytes_per_file by tracemalloc, rss_bytes/file its VmRSS growth per file;")
    print(f" master: a kvfs master over TLS, {CLIENTS} connections x {CONCURRENT} callers, bytes_per_file = "
          "its RssAnon growth per file (its own memory),")
    print(" rss_bytes/file = its VmRSS growth per file (RssAnon plus lmdb's mapped file pages, page cache "
          "the kernel can drop);")
    print(" restart_s: save + load from lmdb (service), kill -9 to a restarted master answering with the "
          "namespace (master);")
    print(" a create is Create + Seal with the writer's release: what a node sends per file before its rename;")
    print(" create_cpu_us, lookup_cpu_us: the master's CPU per request (/proc), Create and Seal counted apart;")
    print(" base master: the master of the --base checkout, measured in the same rounds, the order swapped each round)")
    for count in counts:
        for layer in (f"master {short(count)}", f"base master {short(count)}"):
            runs = {metric: results.values.get((layer, metric), []) for metric in
                    ("creates_per_s", "lookups_per_s", "create_cpu_us", "lookup_cpu_us")}
            if len(runs["creates_per_s"]) > 1:
                print(f"{layer}, each round: " + "; ".join(
                    f"{metric} " + " ".join(f"{value:,.0f}" for value in values) for metric, values in runs.items()))
    if not fuse_counts:
        for note in results.notes:
            print(f"note: {note}")
        return
    print()
    fuse_metrics = [f"{p} x{w}" for p in PATTERNS for w in WRITERS] + ["lookups_per_s", "listing_s",
                                                                        "bytes_per_file"]
    print(f"{'FUSE':<22}" + "".join(f"{metric:>20}" for metric in fuse_metrics))
    for count in counts:
        label = f"{short(count)}"
        if count not in fuse_counts:
            if "fuse" in layers:
                print(f"{label:<22}not measured through FUSE (above --fuse-max: too slow for one run)")
            continue
        rows = {name: [results.median(f"fuse {label} {name}", metric) for metric in fuse_metrics]
                for name in ("node", "single")}
        for name, row in rows.items():
            print(f"{label + ' ' + name:<22}" + "".join(f"{cell(v):>20}" for v in row))
        ratios = [n / s if n is not None and s else None for n, s in zip(rows["node"], rows["single"])]
        print(f"{label + ' node/single':<22}" + "".join(f"{'-' if r is None else f'{r:.2f}':>20}" for r in ratios))
    print("(FUSE, creates per second: flat x1/x16 = the store (exclusive create of a temp file, one 4 KiB write, "
          "close, rename)")
    print(" in one directory by 1 and 16 writers (LMCache's pattern); hashed x1/x16 = vLLM's store in its hashed "
          "layout,")
    print(" access(dest) and stat of the parents first, the parents present after an untimed warm-up;")
    print(" lookups: stat of present names with the kernel's entries dropped; listing: a full scandir; "
          "bytes_per_file: RSS growth of node + master, or of the single-node daemon)")
    for pattern in PATTERNS:
        for writers in WRITERS:
            layer = f"rpc {pattern} x{writers}"
            per_create = {metric: statistics.median(v) for (l, metric), v in results.values.items() if l == layer}
            if per_create:
                shown = ", ".join(f"{request} {value:.2f}" if value >= 0.01 else f"{request} {value:.4f}"
                                  for request, value in sorted(per_create.items()))
                print(f"node's requests to the master per file stored, {pattern}, {writers} writer(s): {shown} "
                      f"(total {sum(per_create.values()):.2f})")
    for pattern in PATTERNS:
        for writers in WRITERS:
            layer = f"cpu {pattern} x{writers}"
            per_file = {process: statistics.median(v) for (l, process), v in results.values.items() if l == layer}
            if per_file:
                shown = ", ".join(f"{process} {value:.2f}" for process, value in per_file.items())
                print(f"CPU per file stored (ms, /proc), {pattern}, {writers} writer(s): {shown}")
    print("target: node/single creates_per_s >= 0.80 with 1 and 16 writers")
    for note in results.notes:
        print(f"note: {note}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="10K,100K,1M", help="files per measurement, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fuse-max", default="100K", help="larger counts skip the FUSE layer")
    parser.add_argument("--layers", default="service,master,fuse", help="which layers to measure")
    parser.add_argument("--dram", default="4G", help="DRAM tier of the node and the single-node mount")
    parser.add_argument("--base", type=Path, help="another checkout whose master is measured too, rounds "
                                                  "alternating (master layer)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the benchmark mounts file systems and drops the kernel's caches")
    counts = [parse_count(c) for c in args.counts.split(",")]
    fuse_max = parse_count(args.fuse_max)
    layers = set(args.layers.split(","))
    fuse_counts = [c for c in counts if c <= fuse_max] if "fuse" in layers else []
    results = Results()
    with tempfile.TemporaryDirectory(prefix="kvfs-bench-metadata-") as scratch:
        base = Path(scratch)
        bundles = issue_bundles(base)
        os.environ["KVFS_TLS_DIR"] = str(bundles["bench"])
        for count in counts:
            for round_ in range(args.rounds):  # the service and the master alternate
                print(f"{count} files, round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
                if "service" in layers:
                    # tracemalloc in the first round, and in none when it is the only one
                    pure_service(count, base / f"r{round_}", results, traced=round_ == 0 < args.rounds - 1)
                if "master" in layers:
                    (base / f"r{round_}").mkdir(exist_ok=True)
                    masters = [(REPO, "master")] + ([(args.base.resolve(), "base master")] if args.base else [])
                    for repo, name in masters[::-1] if round_ % 2 else masters:
                        remote_master(count, base / f"r{round_}", bundles, results, repo, name)
        fuse_layers(fuse_counts, args.rounds, base, bundles, results, args.dram)
    report(results, counts, fuse_counts, layers)


if __name__ == "__main__":
    main()
