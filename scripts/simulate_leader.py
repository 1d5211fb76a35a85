"""Where one metadata leader saturates: its measured cost per request, and a simulation
of many nodes driving it in vLLM's pattern.

Part 1 (measure). The leader's cost per request by type, on this machine:
- in-process: the pure `MetadataService` (kvfs/cluster/master.py) over a namespace of
  --files files named as vLLM's fs tier names them (`<model>_<digest12>_r0/<hhh>/<hh>_g0/
  <sha256>.bin`), each request timed alone, and the lmdb save that `kvfs master` does after
  every request (kvfs/cluster/persist.py) timed beside it;
- through a real `kvfs master` process over TLS 1.3 (a `RemoteMaster` with a node's
  certificate, the requests a node sends, 16 in flight): the master process's CPU time per
  request (from /proc schedstat, its idle rate subtracted), which is what a leader spends on one
  request including framing, TLS and the save; and the round trip of one request at a time.

Part 2 (simulate). A discrete-event simulation (seeded, no sleeps) of N nodes, each one
vLLM instance with its fs tier: one lookup thread, 16 load threads and 16 store threads.
Requests come from a Mooncake trace (arrival times spread within the trace's timestamp
steps and scaled to the swept request rate; block hashes give the chunk files, 512 /
--chunk-tokens files per trace block), each sent to a node chosen at random; the chunks
of the --warm requests before them are in the namespace already. Per request: the
lookup thread checks its chunks in order (`access`) until the first miss; the hits are
loaded as one job (open, read, close: OpenRead and Release at the leader); the misses are
stored as one job (access, parents, O_EXCL create of a temp name, write, close: Seal and
Release, rename). Lookups are answered without the leader where a node would: the kernel's
dentries (positive for the node mount's entry timeout, negative for 1 s) and the node's
copy of a directory it asked about twice (kvfs/node/dircache.py), whose changes the leader
then pushes to it. Every node heartbeats; the leader runs its expiry passes. The leader is
one FIFO server whose service times are the measured costs. Printed per point: the
leader's offered load and utilization, its queueing delay (p50/p99) and the lookup phase's
latency, and where offered load passes 1 / mean service time (saturation).

Usage:
  python scripts/simulate_leader.py                      # measure, then sweep
  python scripts/simulate_leader.py --quick              # small, for tests
  python scripts/simulate_leader.py --costs-out c.json   # keep the measured costs
  python scripts/simulate_leader.py --costs c.json --nodes 1,10,100 --rates 0.5,1
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import heapq
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict, deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Sequence

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvfs.cli import ENTRY_TIMEOUT_S  # noqa: E402
from kvfs.clock import ManualClock  # noqa: E402
from kvfs.cluster.master import MasterSettings, MetadataService  # noqa: E402
from kvfs.cluster.namespace import ROOT_INO  # noqa: E402
from kvfs.config import MountConfig  # noqa: E402
from kvfs.errors import MetadataError  # noqa: E402
from kvfs.node.dircache import LOOKUPS_BEFORE_COPY  # noqa: E402
from kvfs.node.membership import HEARTBEAT_S  # noqa: E402
from kvfs.policy import DEFAULT_POLICY, make_policy  # noqa: E402
from kvfs.wire import messages as m  # noqa: E402

TRACES = Path("/work/shared/traces")
TRACE_BLOCK_TOKENS = 512  # the Mooncake traces' block size (their README)
MODEL_DIR = b"Llama-3.1-8B_5f0c2e9a41d7_r0"  # vLLM's <model>_<digest12>_r0 (the digest is made up)
FILE_BYTES = 32 << 20  # one 256-token chunk of Llama-3.1-8B, as vLLM's fs tier writes it
CHECKSUMS = [0] * (FILE_BYTES // (4 << 20))  # one per 4 MiB chunk (kvfs/chunks.py CHUNK_SIZE)
# Bytes moved per chunk file, for the loaders' and storers' busy time: kvfs's own figures in
# docs/performance.md (32 MiB: cross-node load with lookup 1.40 GB/s, store 0.94 GB/s).
LOAD_GBS = 1.40
STORE_GBS = 0.94
THREADS = 16  # vLLM's fs tier: n_read_threads = n_write_threads = 16
READDIR_PAGE = 256  # what nodes ask for per ReadDir (kvfs/wire/messages.py READDIR_MAX)
WATCH_LIMIT = 1 << 16

# Request kinds as the leader sees them (the simulation's service-time keys).
KINDS = ("lookup_miss", "lookup_hit", "lookup_temp", "mkdir", "create", "seal", "release_write", "rename",
         "open_read", "release_read", "getattr", "readdir_page", "heartbeat", "watch")


# A simulated thread: yields ("leader", kind) to send a request and wait for its answer,
# or ("wait", seconds) to be busy; returns a value to the process that delegated to it.
Process = Generator[tuple[str, Any], None, Any]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# Names ------------------------------------------------------------------------------------

def chunk_name(block: int, part: int) -> bytes:
    """The 64-hex-digit name vLLM gives a chunk (a chained sha256; here of the trace's block id)."""
    return hashlib.sha256(f"{block}/{part}".encode()).hexdigest().encode()


def chunk_dirs(name: bytes) -> tuple[bytes, bytes]:
    """The two directory levels under the model directory: <hhh>/<hh>_g0."""
    return name[:3], name[3:5] + b"_g0"


def temp_name(name: bytes, rng: random.Random) -> bytes:
    return name + b".bin_" + str(rng.getrandbits(63)).encode() + b".tmp"


# Part 1a: the pure service, in-process --------------------------------------------------

class InProcess:
    """A cluster-mode MetadataService with registered nodes, driven as nodes drive it;
    each request timed alone, and (with `state`) the lmdb save after it timed beside it."""

    def __init__(self, nodes: int, state_dir: Path | None) -> None:
        # A clock moved by hand: the registered nodes do not heartbeat, and must not expire.
        self.clock = ManualClock()
        self.service = MetadataService(self.clock, make_policy(DEFAULT_POLICY), MasterSettings(cluster=True))
        self.nodes = []
        for i in range(nodes):
            node = self.service.handle(m.Register(f"n{i}", f"127.0.0.1:{7000 + i}")).node
            self.service.handle(m.Report([]), node)
            self.service.handle(m.FinishRegistration(), node)
            self.nodes.append(node)
        self.state = None
        if state_dir is not None:
            from kvfs.cluster.persist import MasterState

            self.state = MasterState(state_dir)
        self.samples: dict[str, list[float]] = defaultdict(list)  # seconds in the service
        self.saves: dict[str, list[float]] = defaultdict(list)  # seconds in the save after it
        self.timing = False
        self.dirs: dict[tuple[bytes, ...], int] = {(): self.call("mkdir", m.MkDir(ROOT_INO, MODEL_DIR, 0o755, 0, 0)).ino}
        self.files: list[tuple[int, bytes, int]] = []  # (directory, name, inode)

    def call(self, kind: str, request: m.Request, node: int | None = None) -> Any:
        caller = self.nodes[0] if node is None else node
        started = time.thread_time()  # CPU time: other processes on a shared machine do not count
        try:
            return self.service.handle(request, caller)
        finally:
            handled = time.thread_time()
            if self.state is not None and self.timing:
                self.state.save(self.service)
            if self.timing:
                self.samples[kind].append(handled - started)
                if self.state is not None:
                    self.saves[kind].append(time.thread_time() - handled)

    def directory(self, name: bytes) -> int:
        """The leaf directory of a chunk name, made as vLLM makes it (stat, mkdir per level)."""
        path: tuple[bytes, ...] = ()
        for level in chunk_dirs(name):
            parent, path = self.dirs[path], path + (level,)
            if path not in self.dirs:
                self.dirs[path] = self.call("mkdir", m.MkDir(parent, level, 0o755, 0, 0)).ino
        return self.dirs[path]

    def store(self, name: bytes, rng: random.Random, parent: int | None = None) -> None:
        """vLLM's store of one chunk, as the node turns it into requests."""
        parent = self.directory(name) if parent is None else parent
        temp, final = temp_name(name, rng), name + b".bin"
        self.call("lookup_temp", m.Lookup(parent, temp))  # the kernel's lookup before an O_CREAT open
        opened = self.call("create", m.Create(parent, temp, 0o644, 0, 0, self.nodes[0], True))
        self.call("seal", m.Seal(opened.version, FILE_BYTES, self.clock.wall_ns(), CHECKSUMS))
        self.call("release_write", m.Release(opened.version, True))
        self.call("rename", m.Rename(parent, temp, parent, final))
        self.files.append((parent, final, opened.attr.ino))

    def populate(self, files: int, rng: random.Random) -> None:
        for i in range(files):
            self.store(chunk_name(1 << 40 | i, 0), rng)
            if i and i % 20000 == 0:
                log(f"  in-process namespace: {i} files")
        if self.state is not None:
            self.state.save(self.service)  # the namespace's first save, once (not a request's)

    def round(self, rng: random.Random, serial: int) -> None:
        """One of each request kind, in the mix vLLM's tier and the nodes send."""
        self.clock.advance(1e-4)
        parent, _, _ = rng.choice(self.files)
        self.call("lookup_miss", m.Lookup(parent, chunk_name(serial, 1) + b".bin"))
        self.store(chunk_name(serial, 2), rng)
        parent, name, ino = rng.choice(self.files)
        self.call("lookup_hit", m.Lookup(parent, name))
        opened = self.call("open_read", m.OpenRead(ino))
        self.call("release_read", m.Release(opened.version, False))
        self.call("getattr", m.GetAttr(ino))
        node = rng.choice(self.nodes)
        self.call("heartbeat", m.Heartbeat(64 << 30, 32 << 30), node)
        model = self.service.ns.inodes[self.dirs[()]]
        if model.children:  # a page that starts after a random entry
            start = self.service.ns.inodes[model.children.get(rng.choice(list(model.children)))].entry_id
        else:
            start = 0
        self.call("readdir_page", m.ReadDir(self.dirs[()], start, READDIR_PAGE))
        watcher = self.nodes[-1]
        self.call("watch", m.WatchNames(parent, WATCH_LIMIT), watcher)
        self.service.handle(m.Unwatch([parent]), watcher)
        started = time.thread_time()
        self.service.expire_nodes()
        self.samples["expiry_pass"].append(time.thread_time() - started)

    def fanout(self, rng: random.Random, watchers: list[int], rounds: int) -> float:
        """Seconds of leader work per watching node per name change: stores in a directory
        that `watchers` copy (the pushes of their changes taken as the server takes them),
        less the same stores in a directory nobody copies."""
        parent = self.files[0][0]
        costs, changes = [], 0
        for count in (0, len(watchers)):
            for node in watchers[:count]:
                self.service.handle(m.WatchNames(parent, WATCH_LIMIT), node)
            times = []
            for i in range(rounds):
                self.clock.advance(1e-4)
                started = time.thread_time()
                self.store(chunk_name(1 << 41 | count << 20 | i, 0), rng, parent)
                for node in watchers[:count]:
                    changes += len(self.service.take_notifications(node))
                times.append(time.thread_time() - started)
            for node in watchers[:count]:
                self.service.handle(m.Unwatch([parent]), node)
            costs.append(statistics.median(times))
        per_store = changes / rounds / len(watchers)  # changes each watcher is told of per store
        return max(0.0, (costs[1] - costs[0]) / len(watchers) / max(per_store, 1.0))


def timer_overhead() -> float:
    """What reading the CPU clock twice costs (taken off every in-process sample)."""
    intervals = []
    for _ in range(2000):
        started = time.thread_time()
        intervals.append(time.thread_time() - started)
    return statistics.median(intervals)


def measure_in_process(files: int, rounds: int, nodes: int, seed: int, scratch: Path) -> dict[str, Any]:
    rng = random.Random(seed)
    log(f"in-process: {files} files, {nodes} nodes registered")
    driver = InProcess(nodes, scratch / "lmdb")
    driver.populate(files, rng)
    driver.timing = True
    for serial in range(rounds):
        driver.round(rng, serial)
    driver.timing = False
    push = driver.fanout(rng, driver.nodes[1:], max(20, rounds // 10))
    clock = timer_overhead()
    for kind, values in driver.samples.items():
        driver.samples[kind] = [max(0.0, x - clock) for x in values]
    result = {kind: {"mean_us": statistics.fmean(v) * 1e6, "p50_us": statistics.median(v) * 1e6,
                     "p99_us": percentile(v, 99) * 1e6,
                     "save_us": statistics.fmean(driver.saves[kind]) * 1e6 if driver.saves.get(kind) else 0.0,
                     "samples_us": [round(x * 1e6, 2) for x in v]}
              for kind, v in driver.samples.items()}
    result["push_per_watcher"] = {"mean_us": push * 1e6, "p50_us": push * 1e6, "p99_us": push * 1e6,
                                  "save_us": 0.0, "samples_us": [push * 1e6]}
    return {"files": files + rounds, "nodes": nodes, "kinds": result}


# Part 1b: a real `kvfs master` over TLS ----------------------------------------------------

def process_cpu_s(pid: int) -> float:
    """CPU seconds of a process's live threads, to the nanosecond (/proc/PID/task/*/schedstat;
    /proc/PID/stat counts in 10 ms ticks, too coarse for a batch of small requests)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):  # a worker thread that just ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


@contextlib.contextmanager
def master_process(scratch: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    """`kvfs master` on a loopback port with a fresh CA; yields it, its address and a node's bundle."""
    from kvfs.security import ca

    ca.init_ca(scratch / "ca")
    ca.issue(scratch / "ca", "master", "master", scratch / "tls-master", [])
    ca.issue(scratch / "ca", "sim0", "node", scratch / "tls-sim0", ["127.0.0.1"])
    log_path = scratch / "master.log"
    env = dict(os.environ, KVFS_METRICS_LISTEN="127.0.0.1:0")
    # --dead-after: the measuring node heartbeats, but on a loaded machine a beat may come
    # late, and a node declared dead mid-measurement would hide its files.
    with open(log_path, "ab") as out:
        process = subprocess.Popen([sys.executable, "-m", "kvfs", "master", "--listen", "127.0.0.1:0",
                                    "--data", str(scratch / "master-data"), "--tls-dir", str(scratch / "tls-master"),
                                    "--log-level", "info",
                                    "--dead-after", "3600"], stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:
            found = re.search(r"master listening on (\S+)", log_path.read_text(errors="replace"))
            if found:
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"kvfs master did not start:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.02)  # (waiting for a child process to print its address)
        yield process, found.group(1), scratch / "tls-sim0"
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def measure_remote(files: int, batch: int, seed: int, scratch: Path, in_flight: int = 16) -> dict[str, Any]:
    import trio

    from kvfs.net.rpc import RemoteMaster
    from kvfs.security.credentials import Tls

    rng = random.Random(seed)
    log(f"kvfs master over TLS: {files} files, batches of {batch}, {in_flight} requests in flight")
    with master_process(scratch) as (process, address, bundle):
        host, port = address.rsplit(":", 1)
        results: dict[str, dict[str, float]] = {}

        async def run() -> None:
            async with trio.open_nursery() as nursery:
                master = await RemoteMaster.connect(host, int(port), Tls.load(bundle), nursery)
                node = (await master.call(m.Register("sim0", "127.0.0.1:7000"))).node
                await master.call(m.Report([]))
                await master.call(m.FinishRegistration())

                async def heartbeat() -> None:  # as a node does, or the master declares it dead
                    while True:
                        await master.call(m.Heartbeat(64 << 30, 32 << 30))
                        await trio.sleep(HEARTBEAT_S)

                nursery.start_soon(heartbeat)
                model = (await master.call(m.MkDir(ROOT_INO, MODEL_DIR, 0o755, 0, 0))).ino
                dirs: dict[tuple[bytes, ...], int] = {(): model}

                async def each(requests: list[Callable[[], m.Request]]) -> list[Any]:
                    """The requests, `in_flight` at a time, answers in order."""
                    answers: list[Any] = [None] * len(requests)

                    async def worker(first: int) -> None:
                        for i in range(first, len(requests), in_flight):
                            try:
                                answers[i] = await master.call(requests[i]())
                            except MetadataError as error:
                                if error.errno != errno.EEXIST:
                                    raise
                    async with trio.open_nursery() as workers:
                        for first in range(in_flight):
                            workers.start_soon(worker, first)
                    return answers

                async def phase(kind: str, requests: list[Callable[[], m.Request]]) -> list[Any]:
                    idle_from, idle_cpu = time.monotonic(), process_cpu_s(process.pid)
                    await trio.sleep(0.3)  # the master's background passes and heartbeats, no requests
                    idle_rate = (process_cpu_s(process.pid) - idle_cpu) / (time.monotonic() - idle_from)
                    started, cpu = time.monotonic(), process_cpu_s(process.pid)
                    answers = await each(requests)
                    elapsed = time.monotonic() - started
                    spent = process_cpu_s(process.pid) - cpu - idle_rate * elapsed
                    results[kind] = {"cpu_us": max(spent, 0.0) / len(requests) * 1e6,
                                     "throughput_per_s": len(requests) / elapsed}
                    return answers

                async def stores(names: list[bytes], kinds: bool) -> list[tuple[int, bytes, int]]:
                    """vLLM's stores of `names`, phase by phase (each phase's CPU measured if `kinds`)."""
                    run_phase = phase if kinds else (lambda kind, requests: each(requests))
                    for level in (0, 1):
                        wanted = sorted({chunk_dirs(n)[:level + 1] for n in names} - dirs.keys())
                        made = await run_phase("mkdir", [lambda p=p: m.MkDir(dirs[p[:-1]], p[-1], 0o755, 0, 0)
                                                         for p in wanted]) if wanted else []
                        for path, attr in zip(wanted, made):
                            if attr is None:  # made already (EEXIST): ask for it
                                attr = (await master.call(m.Lookup(dirs[path[:-1]], path[-1]))).attr
                            dirs[path] = attr.ino
                    leaves = [dirs[chunk_dirs(n)] for n in names]
                    temps = [temp_name(n, rng) for n in names]
                    await run_phase("lookup_temp", [lambda p=p, t=t: m.Lookup(p, t) for p, t in zip(leaves, temps)])
                    opened = await run_phase("create", [lambda p=p, t=t: m.Create(p, t, 0o644, 0, 0, node, True)
                                                        for p, t in zip(leaves, temps)])
                    await run_phase("seal", [lambda o=o: m.Seal(o.version, FILE_BYTES, time.time_ns(), CHECKSUMS)
                                             for o in opened])
                    await run_phase("release_write", [lambda o=o: m.Release(o.version, True) for o in opened])
                    await run_phase("rename", [lambda p=p, t=t, n=n: m.Rename(p, t, p, n + b".bin")
                                               for p, t, n in zip(leaves, temps, names)])
                    return [(p, n + b".bin", o.attr.ino) for p, n, o in zip(leaves, names, opened)]

                stored = []
                for first in range(0, files, 5000):
                    stored += await stores([chunk_name(1 << 40 | i, 0) for i in range(first, min(files, first + 5000))],
                                           kinds=False)
                    log(f"  master namespace: {len(stored)} files")
                await stores([chunk_name(1 << 42 | i, 0) for i in range(batch)], kinds=True)
                picks = [rng.choice(stored) for _ in range(batch)]
                await phase("lookup_miss", [lambda p=p: m.Lookup(p[0], chunk_name(1 << 43 | i, 0) + b".bin")
                                            for i, p in enumerate(picks)])
                await phase("lookup_hit", [lambda p=p: m.Lookup(p[0], p[1]) for p in picks])
                opened = await phase("open_read", [lambda p=p: m.OpenRead(p[2]) for p in picks])
                await phase("release_read", [lambda o=o: m.Release(o.version, False) for o in opened])
                await phase("getattr", [lambda p=p: m.GetAttr(p[2]) for p in picks])
                await phase("heartbeat", [lambda: m.Heartbeat(64 << 30, 32 << 30) for _ in picks])
                starts, start = [0], 0  # every entry's position in the model directory's listing
                while True:
                    page = (await master.call(m.ReadDir(model, start, READDIR_PAGE))).entries
                    if not page:
                        break
                    start = page[-1].next_id
                    starts += [entry.next_id for entry in page]
                await phase("readdir_page", [lambda s=rng.choice(starts): m.ReadDir(model, s, READDIR_PAGE)
                                             for _ in picks[: batch // 4]])
                await phase("watch", [lambda p=p: m.WatchNames(p[0], WATCH_LIMIT) for p in picks[: batch // 4]])
                # One request at a time: the round trip a caller waits (p50), for the wire's share.
                for kind, make in (("lookup_miss", lambda i: m.Lookup(model, b"absent-%d" % i)),
                                   ("getattr", lambda i: m.GetAttr(picks[i % len(picks)][2]))):
                    rtts = []
                    for i in range(min(batch, 500)):
                        started = time.perf_counter()
                        await master.call(make(i))
                        rtts.append(time.perf_counter() - started)
                    results[kind]["rtt_p50_us"] = statistics.median(rtts) * 1e6
                await master.aclose()
                nursery.cancel_scope.cancel()

        trio.run(run)
    return {"files": files + batch, "in_flight": in_flight, "kinds": results}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass
class Costs:
    """Service seconds per request kind for the simulation, and the wire's delay each way."""

    samples: dict[str, list[float]]  # the kind's distribution (in-process shape, scaled to the leader's mean)
    mean: dict[str, float]
    one_way_s: float
    source: str

    def draw(self, kind: str, rng: random.Random) -> float:
        return rng.choice(self.samples[kind])


def build_costs(measured: dict[str, Any]) -> Costs:
    """A leader's service time per kind: the real master's CPU per request where it was
    measured (its framing, TLS and save included), else the in-process service plus save
    plus the framing the real master showed on GetAttr (its cheapest request)."""
    local = measured["in_process"]["kinds"]
    remote = measured.get("remote", {}).get("kinds", {})
    framing = 0.0
    if "getattr" in remote:
        framing = max(0.0, remote["getattr"]["cpu_us"] - local["getattr"]["mean_us"] - local["getattr"]["save_us"])
    samples, mean = {}, {}
    for kind, row in local.items():
        base = row["mean_us"] + row["save_us"]
        target = remote[kind]["cpu_us"] if kind in remote and remote[kind]["cpu_us"] > 0 else base + framing
        if kind == "expiry_pass":
            target = base  # the master's own timer, no frame
        scale = target / row["mean_us"] if row["mean_us"] > 0 else 1.0
        samples[kind] = [x * scale * 1e-6 for x in row["samples_us"]] or [target * 1e-6]
        mean[kind] = statistics.fmean(samples[kind])
    one_way = 0.0
    if "lookup_miss" in remote and "rtt_p50_us" in remote["lookup_miss"]:
        one_way = max(0.0, remote["lookup_miss"]["rtt_p50_us"] - remote["lookup_miss"]["cpu_us"]) / 2 * 1e-6
    return Costs(samples, mean, one_way, "kvfs master over TLS" if remote else "in-process service + save")


def cost_table(measured: dict[str, Any]) -> str:
    local = measured["in_process"]["kinds"]
    remote = measured.get("remote", {}).get("kinds", {})
    lines = [f"leader cost per request (in-process: {measured['in_process']['files']} files, "
             f"{measured['in_process']['nodes']} nodes; kvfs master: {measured.get('remote', {}).get('files', 0)} "
             "files, 16 in flight)",
             "| request | service p50 µs | service mean µs | + lmdb save µs | kvfs master CPU µs "
             "| round trip p50 µs | master - (service + save) µs |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for kind in (*KINDS, "push_per_watcher", "expiry_pass"):
        if kind not in local:
            continue
        row, far = local[kind], remote.get(kind, {})
        cpu = far.get("cpu_us")
        lines.append(f"| {kind} | {row['p50_us']:.1f} | {row['mean_us']:.1f} | {row['save_us']:.1f} | "
                     + (f"{cpu:.0f} | " if cpu is not None else "- | ")
                     + (f"{far['rtt_p50_us']:.0f} | " if "rtt_p50_us" in far else "- | ")
                     + (f"{cpu - row['mean_us'] - row['save_us']:.0f} |" if cpu is not None else "- |"))
    return "\n".join(lines)


# Part 2: the simulation ------------------------------------------------------------------

@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    blocks: tuple[int, ...]


def load_trace(path: Path, limit: int) -> list[TraceRequest]:
    """The trace's requests, their full blocks only (vLLM stores and looks up full chunks)."""
    out = []
    with open(path) as lines:
        for line in lines:
            row = json.loads(line)
            full = row["input_length"] // TRACE_BLOCK_TOKENS
            out.append(TraceRequest(row["timestamp"] / 1000.0, tuple(row["hash_ids"][:full])))
            if len(out) >= limit:
                break
    return out


def spread(trace: list[TraceRequest], rng: random.Random) -> list[TraceRequest]:
    """The trace with each request moved to a random time within its timestamp's step: the
    Mooncake traces' arrival times come in steps (3 s in the conversation trace, 628 distinct
    times for 6,015 requests), and a whole step's requests arriving at one instant is an
    artefact of the rounding, not a burst."""
    times = sorted({r.arrival_s for r in trace})
    steps = [b - a for a, b in zip(times, times[1:])]
    step_after = dict(zip(times, steps))
    last = statistics.median(steps) if steps else 0.0
    moved = [TraceRequest(r.arrival_s + rng.uniform(0, step_after.get(r.arrival_s, last)), r.blocks) for r in trace]
    return sorted(moved, key=lambda r: r.arrival_s)


class Leader:
    """One FIFO server: a request waits for every earlier one, then takes its service time."""

    def __init__(self, sim: "Simulation") -> None:
        self.sim = sim
        self.free_at = 0.0
        self.busy: list[tuple[float, float]] = []  # (start, end) of each service
        self.waits: list[float] = []
        self.counts: dict[str, int] = defaultdict(int)
        self.heartbeat_delays: list[float] = []

    def serve(self, kind: str, then: Callable[[], None] | None) -> None:
        """A request arriving now; `then` runs when its answer is back at the caller."""
        now = self.sim.now
        service = self.sim.costs.draw(kind, self.sim.rng)
        start = max(now, self.free_at)
        self.free_at = start + service
        self.busy.append((start, self.free_at))
        self.waits.append(start - now)
        self.counts[kind] += 1
        if kind == "heartbeat":
            self.heartbeat_delays.append(self.free_at - now)
        if then is not None:
            self.sim.at(self.free_at + self.sim.costs.one_way_s, then)


@dataclass
class Directory:
    names: dict[bytes, bool] = field(default_factory=dict)  # name -> a sealed file (False: directory, temp)
    watchers: set[int] = field(default_factory=set)


class Node:
    """One vLLM instance on a kvfs node: its threads, its kernel's dentries, its directory copies."""

    def __init__(self, sim: "Simulation", index: int) -> None:
        self.sim = sim
        self.index = index
        self.dentries: dict[tuple[bytes, bytes], tuple[bool, float]] = {}  # (dir, name) -> (present, until)
        self.asked: dict[bytes, int] = defaultdict(int)
        self.copies: set[bytes] = set()
        self.lookup_queue: deque[Job] = deque()
        self.lookup_busy = False
        self.pools = {"load": Pool(sim, THREADS), "store": Pool(sim, THREADS)}

    # (A process is a generator that yields ("leader", kind) or ("wait", seconds).)

    def resolve(self, directory: bytes, name: bytes) -> Process:
        """A lookup as the node answers it; returns whether the name exists."""
        sim, now = self.sim, self.sim.now
        cached = self.dentries.get((directory, name))
        if cached is not None and cached[1] > now:
            sim.lookups_kernel += 1
            return cached[0]
        entry = sim.dirs[directory].names.get(name) if directory in sim.dirs else None
        if directory in self.copies and (entry is None or entry):  # absent, or a sealed file: the copy answers
            sim.lookups_copy += 1
        else:
            kind = "lookup_temp" if name.endswith(b".tmp") else ("lookup_miss" if entry is None else "lookup_hit")
            yield ("leader", kind)
            entry = sim.dirs[directory].names.get(name) if directory in sim.dirs else None
            self.asked[directory] += 1
            if self.asked[directory] >= LOOKUPS_BEFORE_COPY and directory in sim.dirs and directory not in self.copies:
                yield ("leader", "watch")
                self.copies.add(directory)
                sim.dirs[directory].watchers.add(self.index)
        found = entry is not None
        timeout = sim.entry_timeout_s if found else sim.negative_timeout_s
        self.dentries[(directory, name)] = (found, sim.now + timeout)
        return found

    def path_exists(self, name: bytes) -> Process:
        """access(<model>/<hhh>/<hh>_g0/<name>.bin): each component looked up, up to the first absent."""
        hhh, hh = chunk_dirs(name)
        for directory, component in ((MODEL_DIR, hhh), (hhh, hh), (hhh + b"/" + hh, name + b".bin")):
            if not (yield from self.resolve(directory, component)):
                return False
        return True

    def lookups(self, request: "Job") -> Process:
        for name in request.chunks:
            if not (yield from self.path_exists(name)):
                break
            request.hits += 1
        request.looked_up_at = self.sim.now

    def load(self, request: "Job") -> Process:
        for name in request.chunks[: request.hits]:
            if not (yield from self.path_exists(name)):  # (the kernel's dentries from the lookups, mostly)
                continue
            yield ("leader", "open_read")
            yield ("wait", FILE_BYTES / (self.sim.load_gbs * 1e9))
            yield ("leader", "release_read")

    def store(self, request: "Job") -> Process:
        sim = self.sim
        for name in request.chunks[request.hits:]:
            if (yield from self.path_exists(name)):
                continue  # stored by another node meanwhile
            hhh, hh = chunk_dirs(name)
            leaf = hhh + b"/" + hh
            for directory, component, path in ((MODEL_DIR, hhh, hhh), (hhh, hh, leaf)):
                if not (yield from self.resolve(directory, component)):
                    yield ("leader", "mkdir")
                    sim.change(directory, component, False)
                    sim.dirs.setdefault(path, Directory())
                    self.dentries[(directory, component)] = (True, sim.now + sim.entry_timeout_s)
            temp = name + b".bin_%d.tmp" % sim.rng.getrandbits(63)
            yield from self.resolve(leaf, temp)  # the kernel's lookup before an O_CREAT open
            yield ("leader", "create")
            sim.change(leaf, temp, False)
            yield ("wait", FILE_BYTES / (sim.store_gbs * 1e9))
            yield ("leader", "seal")
            sim.change(leaf, temp, False)
            yield ("leader", "release_write")
            yield ("leader", "rename")
            sim.dirs[leaf].names.pop(temp, None)
            sim.change(leaf, temp, False, removed=True)
            sim.change(leaf, name + b".bin", True)
            self.dentries[(leaf, name + b".bin")] = (True, sim.now + sim.entry_timeout_s)
            self.dentries.pop((leaf, temp), None)

    def arrive(self, request: "Job") -> None:
        self.lookup_queue.append(request)
        if not self.lookup_busy:
            self._next_lookup()

    def _next_lookup(self) -> None:
        if not self.lookup_queue:
            self.lookup_busy = False
            return
        self.lookup_busy = True
        request = self.lookup_queue.popleft()

        def looked_up() -> None:
            self._next_lookup()
            if request.hits:
                self.pools["load"].submit(self.load(request), lambda: self._stores(request))
            else:
                self._stores(request)

        self.sim.run(self.lookups(request), looked_up)

    def _stores(self, request: "Job") -> None:
        if request.hits < len(request.chunks):
            self.pools["store"].submit(self.store(request), lambda: self.sim.served(request))
        else:
            self.sim.served(request)


class Pool:
    """A fixed number of threads taking jobs in order (vLLM's read or write threads)."""

    def __init__(self, sim: "Simulation", threads: int) -> None:
        self.sim, self.idle = sim, threads
        self.queue: deque[tuple[Process, Callable[[], None]]] = deque()

    def submit(self, process: Process, done: Callable[[], None]) -> None:
        self.queue.append((process, done))
        self._start()

    def _start(self) -> None:
        while self.idle and self.queue:
            self.idle -= 1
            process, done = self.queue.popleft()

            def finished(done: Callable[[], None] = done) -> None:
                self.idle += 1
                done()
                self._start()

            self.sim.run(process, finished)


@dataclass
class Job:
    index: int
    node: int
    arrival_s: float
    chunks: tuple[bytes, ...]
    hits: int = 0
    looked_up_at: float = 0.0


@dataclass
class Result:
    nodes: int
    rate_per_node: float
    requests: int
    served: int
    window_s: float
    leader_requests: int
    offered_per_s: float  # leader requests per second: per trace request x request rate, + timers
    mean_service_us: float
    offered_load: float  # offered_per_s * mean service: past 1, one leader cannot keep up
    utilization: float  # the leader's busy share of the middle half of the arrival window
    wait_p50_ms: float
    wait_p99_ms: float
    lookup_p50_ms: float  # a request's arrival to its lookups done (what delays its first token)
    lookup_p99_ms: float
    heartbeat_max_ms: float
    answered_locally: float  # lookups answered by the node (kernel dentries or its directory copy)
    per_request: float  # leader requests per trace request (heartbeats excluded)
    hit_chunks: int
    stored_chunks: int
    saturated: bool
    by_kind: dict[str, float] = field(default_factory=dict)  # leader requests per trace request, by kind


class Simulation:
    def __init__(self, costs: Costs, trace: list[TraceRequest], nodes: int, rate_per_node: float, seed: int,
                 chunk_tokens: int, load_gbs: float = LOAD_GBS, store_gbs: float = STORE_GBS,
                 steps: bool = False, warm: Sequence[TraceRequest] = ()) -> None:
        self.costs, self.rng = costs, random.Random(seed)
        if not steps:
            trace = spread(trace, self.rng)
        self.now = 0.0
        self.events: list[tuple[float, int, Callable[[], None]]] = []
        self.sequence = 0
        self.leader = Leader(self)
        self.entry_timeout_s = ENTRY_TIMEOUT_S["node"]
        self.negative_timeout_s = MountConfig.negative_timeout_s
        self.load_gbs, self.store_gbs = load_gbs, store_gbs
        self.dirs: dict[bytes, Directory] = {MODEL_DIR: Directory()}
        self.nodes = [Node(self, i) for i in range(nodes)]
        self.lookups_kernel = self.lookups_copy = 0
        self.done = 0
        self.lookup_latency: list[float] = []
        self.pushes = 0
        parts = max(1, TRACE_BLOCK_TOKENS // chunk_tokens)
        # A cluster that has run for a while: the chunks of the requests before the simulated
        # ones are stored already (the leader does not see that part; the nodes' caches start empty).
        for request in warm:
            for block in request.blocks:
                for part in range(parts):
                    self.preload(chunk_name(block, part))
        span = max(trace[-1].arrival_s - trace[0].arrival_s, 1e-9)
        scale = len(trace) / span / (nodes * rate_per_node)  # trace seconds -> simulated seconds
        self.jobs = [Job(i, self.rng.randrange(nodes), (r.arrival_s - trace[0].arrival_s) * scale,
                         tuple(chunk_name(b, p) for b in r.blocks for p in range(parts)))
                     for i, r in enumerate(trace)]
        self.window_s = self.jobs[-1].arrival_s or 1e-9
        self.nodes_count, self.rate_per_node = nodes, rate_per_node

    def preload(self, name: bytes) -> None:
        hhh, hh = chunk_dirs(name)
        leaf = hhh + b"/" + hh
        for directory, component, path in ((MODEL_DIR, hhh, hhh), (hhh, hh, leaf)):
            self.dirs.setdefault(directory, Directory()).names[component] = False
            self.dirs.setdefault(path, Directory())
        self.dirs[leaf].names[name + b".bin"] = True

    def at(self, when: float, action: Callable[[], None]) -> None:
        self.sequence += 1
        heapq.heappush(self.events, (when, self.sequence, action))

    def run(self, process: Process, done: Callable[[], None]) -> None:
        """Advances a process to its next request or wait, and on and on until it ends."""
        def advance() -> None:
            for step, argument in process:
                if step == "leader":
                    self.at(self.now + self.costs.one_way_s, lambda kind=argument: self.leader.serve(kind, advance))
                else:
                    self.at(self.now + argument, advance)
                return
            done()
        advance()

    def change(self, directory: bytes, name: bytes, sealed: bool, removed: bool = False) -> None:
        """A name added, changed or removed: the leader pushes it to every node with a copy."""
        entry = self.dirs.setdefault(directory, Directory())
        if not removed:
            entry.names[name] = sealed
        for _ in entry.watchers:
            self.leader.serve("push_per_watcher", None)
            self.pushes += 1

    def served(self, job: Job) -> None:
        self.done += 1
        self.lookup_latency.append(job.looked_up_at - job.arrival_s)

    def heartbeats(self, node: int) -> None:
        def beat() -> None:
            if self.done < len(self.jobs):
                self.leader.serve("heartbeat", None)
                self.at(self.now + HEARTBEAT_S, beat)
        self.at(self.rng.uniform(0, HEARTBEAT_S), beat)

    def expiry(self) -> None:
        interval = MasterSettings().expire_interval_s

        def expire() -> None:
            if self.done < len(self.jobs):
                self.leader.serve("expiry_pass", None)
                self.at(self.now + interval, expire)
        self.at(interval, expire)

    def simulate(self) -> Result:
        for job in self.jobs:
            self.at(job.arrival_s, lambda job=job: self.nodes[job.node].arrive(job))
        for node in range(len(self.nodes)):
            self.heartbeats(node)
        self.expiry()
        while self.events:
            self.now, _, action = heapq.heappop(self.events)
            action()
        leader = self.leader
        # Utilization in the middle half of the arrival window: past the start (empty caches,
        # an empty namespace) and before the end (the last requests' stores run past it).
        low, high = self.window_s / 4, 3 * self.window_s / 4
        busy = sum(max(0.0, min(end, high) - max(start, low)) for start, end in leader.busy)
        total = sum(leader.counts.values())
        mean_service = sum(end - start for start, end in leader.busy) / max(1, total)
        # Offered: the leader requests each trace request brings at the rate requests arrive,
        # plus every node's heartbeats and the master's expiry passes.
        timers = sum(leader.counts[k] for k in ("heartbeat", "expiry_pass"))
        offered = ((total - timers) / len(self.jobs) * (len(self.jobs) - 1) / self.window_s
                   + len(self.nodes) / HEARTBEAT_S + 1 / MasterSettings().expire_interval_s)
        lookups = sum(leader.counts[k] for k in ("lookup_miss", "lookup_hit", "lookup_temp"))
        local = self.lookups_kernel + self.lookups_copy
        return Result(
            nodes=len(self.nodes), rate_per_node=self.rate_per_node, requests=len(self.jobs), served=self.done,
            window_s=self.window_s, leader_requests=total, offered_per_s=offered,
            mean_service_us=mean_service * 1e6, offered_load=offered * mean_service,
            utilization=busy / (high - low),
            wait_p50_ms=percentile(leader.waits, 50) * 1e3, wait_p99_ms=percentile(leader.waits, 99) * 1e3,
            lookup_p50_ms=percentile(self.lookup_latency, 50) * 1e3,
            lookup_p99_ms=percentile(self.lookup_latency, 99) * 1e3,
            heartbeat_max_ms=max(leader.heartbeat_delays, default=0.0) * 1e3,
            answered_locally=local / max(1, local + lookups),
            per_request=(total - timers) / len(self.jobs),
            hit_chunks=leader.counts["open_read"], stored_chunks=leader.counts["create"],
            saturated=offered * mean_service >= 1.0,
            by_kind={kind: count / len(self.jobs) for kind, count in sorted(leader.counts.items())})


def sweep(costs: Costs, trace: list[TraceRequest], nodes: list[int], rates: list[float], seed: int,
          chunk_tokens: int, steps: bool = False, warm: Sequence[TraceRequest] = ()) -> list[Result]:
    results = []
    for rate in rates:
        for count in nodes:
            started = time.monotonic()
            result = Simulation(costs, trace, count, rate, seed, chunk_tokens, steps=steps, warm=warm).simulate()
            log(f"  {count} nodes x {rate:g} req/s: offered load {result.offered_load:.2f}, utilization "
                f"{result.utilization:.2f} ({time.monotonic() - started:.1f} s)")
            results.append(result)
    return results


def sweep_table(results: list[Result], costs: Costs) -> str:
    lines = [f"simulation ({costs.source}; {THREADS} load + {THREADS} store threads and 1 lookup thread per node; "
             f"wire {costs.one_way_s * 1e6:.0f} µs each way)",
             "| nodes | req/s per node | leader req/s | per request | offered load | utilization | wait p50 ms "
             "| wait p99 ms | lookup p50 ms | lookup p99 ms | answered by node | heartbeat max ms | saturated |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in results:
        lines.append(f"| {r.nodes} | {r.rate_per_node:g} | {r.offered_per_s:.0f} | {r.per_request:.0f} | "
                     f"{r.offered_load:.2f} | {r.utilization:.2f} | {r.wait_p50_ms:.2f} | {r.wait_p99_ms:.1f} | "
                     f"{r.lookup_p50_ms:.1f} | {r.lookup_p99_ms:.0f} | {r.answered_locally:.0%} | "
                     f"{r.heartbeat_max_ms:.0f} | {'yes' if r.saturated else 'no'} |")
    return "\n".join(lines)


def breakdown(result: Result, costs: Costs) -> str:
    """Where one point's leader work comes from: requests and service time per trace request, by kind."""
    rows = sorted(result.by_kind.items(), key=lambda kv: -kv[1] * costs.mean[kv[0]])
    total = sum(n * costs.mean[k] for k, n in rows)
    lines = [f"leader work per trace request at {result.nodes} nodes x {result.rate_per_node:g} req/s "
             f"({result.hit_chunks / result.requests:.1f} chunks loaded, {result.stored_chunks / result.requests:.1f} "
             "stored per request)",
             "| request | per trace request | share of leader time |", "| --- | ---: | ---: |"]
    for kind, count in rows:
        lines.append(f"| {kind} | {count:.1f} | {count * costs.mean[kind] / total:.0%} |")
    return "\n".join(lines)


def saturation_lines(results: list[Result]) -> list[str]:
    """Per request rate: the first node count whose offered load passes one leader's capacity."""
    out = []
    for rate in sorted({r.rate_per_node for r in results}):
        row = sorted((r for r in results if r.rate_per_node == rate), key=lambda r: r.nodes)
        first = next((r for r in row if r.saturated), None)
        if first is None:
            out.append(f"at {rate:g} req/s per node: not saturated up to {row[-1].nodes} nodes "
                       f"(offered load {row[-1].offered_load:.2f})")
        else:
            capacity = 1e6 / first.mean_service_us
            out.append(f"at {rate:g} req/s per node: saturated from {first.nodes} nodes "
                       f"({first.offered_per_s:.0f} leader requests/s offered > 1 / mean service = {capacity:.0f}/s)")
    # What one leader serves of this mix: its capacity over the leader requests a trace request brings.
    capacities = [1e6 / r.mean_service_us / (r.per_request + r.nodes / HEARTBEAT_S / (r.nodes * r.rate_per_node))
                  for r in results]
    out.append(f"one leader serves {min(capacities):.0f}-{max(capacities):.0f} trace requests/s in all "
               "(1 / mean service over the leader requests per trace request, heartbeats included)")
    return out


# Command line ----------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small namespace, short trace, few points (tests)")
    parser.add_argument("--files", type=int, default=None, help="namespace size in-process (default 100000)")
    parser.add_argument("--remote-files", type=int, default=None, help="namespace size of kvfs master (default 10000)")
    parser.add_argument("--rounds", type=int, default=None, help="timed requests per kind (default 2000)")
    parser.add_argument("--no-remote", action="store_true", help="skip the kvfs master measurement")
    parser.add_argument("--costs", type=Path, help="measured costs from an earlier --costs-out (skips measuring)")
    parser.add_argument("--costs-out", type=Path, help="write the measured costs (JSON)")
    parser.add_argument("--trace", type=Path, default=TRACES / "conversation_first_half.jsonl")
    parser.add_argument("--requests", type=int, default=None, help="trace requests per point (default 1500)")
    parser.add_argument("--warm", type=int, default=None,
                        help="trace requests stored before the simulated ones (default: as many as --requests)")
    parser.add_argument("--nodes", default=None, help="node counts (default 1,10,20,50,100)")
    parser.add_argument("--rates", default=None, help="requests/s per node (default 0.1,0.2,0.5,1,2)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per chunk file (vLLM's chunk)")
    parser.add_argument("--steps", action="store_true",
                        help="keep the trace's arrival steps (every request of a step at one instant)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the results (JSON)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.files = args.files if args.files is not None else (2000 if quick else 100_000)
    args.remote_files = args.remote_files if args.remote_files is not None else (300 if quick else 10_000)
    args.rounds = args.rounds if args.rounds is not None else (200 if quick else 2000)
    args.requests = args.requests if args.requests is not None else (120 if quick else 1500)
    args.warm = args.warm if args.warm is not None else args.requests
    args.nodes = [int(x) for x in (args.nodes or ("1,4,16" if quick else "1,10,20,50,100")).split(",")]
    args.rates = [float(x) for x in (args.rates or ("0.05,1,50" if quick else "0.1,0.2,0.5,1,2")).split(",")]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.costs is not None:
        measured = json.loads(args.costs.read_text())
    else:
        with tempfile.TemporaryDirectory(prefix="kvfs-sim-") as scratch:
            measured = {"in_process": measure_in_process(args.files, args.rounds, 100, args.seed,
                                                         Path(scratch))}
            if not args.no_remote:
                remote_dir = Path(scratch) / "remote"
                remote_dir.mkdir()
                measured["remote"] = measure_remote(args.remote_files, args.rounds, args.seed, remote_dir)
        if args.costs_out is not None:
            args.costs_out.write_text(json.dumps(measured))
    print(cost_table(measured))
    costs = build_costs(measured)
    print()
    requests = load_trace(args.trace, args.warm + args.requests)
    warm, trace = requests[: args.warm], requests[args.warm:]
    if not trace:
        raise SystemExit(f"{args.trace} holds {len(requests)} requests: none left after --warm {args.warm}")
    log(f"simulating {len(trace)} requests of {args.trace.name} per point, after {len(warm)} stored before")
    results = sweep(costs, trace, args.nodes, args.rates, args.seed, args.chunk_tokens, args.steps, warm)
    print(sweep_table(results, costs))
    print()
    print(breakdown(max(results, key=lambda r: (r.nodes, r.rate_per_node)), costs))
    print()
    for line in saturation_lines(results):
        print(line)
    if args.json is not None:
        args.json.write_text(json.dumps({"costs": {"mean_us": {k: v * 1e6 for k, v in costs.mean.items()},
                                                   "one_way_us": costs.one_way_s * 1e6, "source": costs.source},
                                         "results": [asdict(r) for r in results]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
