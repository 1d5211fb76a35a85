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
network) is shown too, and the same load from the smallest pyfuse3 file system
(scripts/trivialfs.py, its files in its own memory): the ceiling of any load served
through pyfuse3 on this machine, against which Mooncake's get is set too. And the same
files loaded through node A's own mount ("on A"): every step of B's load (the lookup, the
master's OpenRead, the FUSE reads) but the transfer, which B's cross-node load cannot beat.

Mooncake Store (its PyPI package in a venv of its own, scripts/mooncake_peer.py) is
measured in the same run: its master, a writer client and reader clients in a network
namespace on loopback over TCP, readers that lend the store no memory, so that each
`get_into` (and each `batch_get_into` of BATCH objects) crosses TCP from the writer's
memory, as kvfs's node B loads from node A. One reader process, and PARALLEL at once.
kvfs's and Mooncake's loads alternate (which goes first swaps every round), and with
--hog both are measured again beside a process that keeps about HOG_SHARE of a core
busy, so that each one's loss under a competing CPU load is shown. Rounds interleave
the transfers; the tables show medians and kvfs/Mooncake ratios of medians.

Every party shares this machine's cores, so a load's throughput is bounded by the CPU it
spends: each load but the raw ones also records, per file (object) loaded, the CPU (user +
system, every thread, from /proc/PID/stat) of the processes that serve it, and the reader's
own (getrusage of this process, which runs nothing else meanwhile; every other party is a
process of its own), as "cpu ROLE METRIC" in ms: kvfs's master, A, B and reader; the
single-node mount's and trivialfs's daemon and reader; Mooncake's master, writer and
readers. The last table sets kvfs's open beside Mooncake's get, by process.

kvfs's cluster connections are set up in TLS 1.3; B's chunk connections to A then leave TLS
for kvfs's own AES-256-GCM records (--peer-encryption on, the default), or, with
--peer-encryption off (both nodes run with `kvfs node --peer-encryption off`), for plain
frames (docs/cluster.md, Security). Raw Python TCP and TLS in the same run show what
encryption costs a Python transfer.

Usage (as root): python scripts/bench_cluster.py [--sizes 2,32] [--total 512M] [--rounds 3]
                 [--hog] [--peer-encryption on|off] [--install-mooncake] [--mooncake-venv DIR] [--transfers-only] [--json FILE]
       python scripts/bench_cluster.py --report FILE [--sizes ...]   (the tables of a saved run)
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import re
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from multiprocessing import Process
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import mooncake_peer  # noqa: E402
from bench import drop_page_cache, lookups_per_second, prepare_machine, start_daemon, store_files  # noqa: E402
from kvfs.config import parse_size  # noqa: E402

# The daemons started here run side by side: metrics on ports of their own, not 9740/9741.
os.environ.setdefault("KVFS_METRICS_LISTEN", "127.0.0.1:0")

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
PARALLEL = 4  # readers (raw TCP streams, Mooncake reader processes) in the parallel rows
BATCH = 8  # objects per Mooncake batch_get_into
HOG_SHARE = 0.8  # of one core, the competing load of --hog
Record = Callable[[str, float], None]  # appends one round's figure to a metric
TICK = os.sysconf("SC_CLK_TCK")  # /proc/PID/stat counts CPU in these per second


def process_cpu(pid: int) -> float:
    """Seconds of CPU (user + system) that process PID has spent, every thread's, exited ones too."""
    # After the parenthesised name (which may hold spaces): utime and stime are fields 14 and 15.
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def own_cpu() -> float:
    """Seconds of CPU this process (the reader) has spent, all its threads; its children not."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class CpuSpan:
    """The CPU each party spends over a `with` block: `spent` maps a role to seconds.

    `pids` maps roles to the processes summed into them; `reader` adds this process as the
    role "reader", which must then run nothing but the load (it holds one thread at the start)."""

    def __init__(self, pids: dict[str, list[int]], reader: bool) -> None:
        self.pids, self.reader = pids, reader
        self.start: dict[str, float] = {}
        self.own = 0.0
        self.spent: dict[str, float] = {}

    def others(self) -> dict[str, float]:
        return {role: sum(process_cpu(pid) for pid in pids) for role, pids in self.pids.items()}

    def __enter__(self) -> CpuSpan:
        if self.reader and len(os.listdir("/proc/self/task")) != 1:
            # A thread left running here would be counted as the load's.
            raise SystemExit(f"the benchmark runs {len(os.listdir('/proc/self/task'))} threads before a load")
        self.start = self.others()
        self.own = own_cpu() if self.reader else 0.0  # read last: the reads above are not the load's
        return self

    def __exit__(self, *_: object) -> None:
        own = own_cpu() if self.reader else 0.0  # read first, for the same reason
        self.spent = {role: seconds - self.start[role] for role, seconds in self.others().items()}
        if self.reader:
            self.spent["reader"] = own - self.own


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
    # Listening first: the receiver's connections wait in the backlog while the buffers fill
    # (seconds on a loaded machine), not against a connect deadline.
    listener = socket.create_server(("127.0.0.1", port_holder))
    region = mmap.mmap(-1, size * count)
    region.write(os.urandom(size) * count)
    payloads = [memoryview(region)[i * size : (i + 1) * size] for i in range(count)]
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
    deadline = time.monotonic() + 60
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


# vLLM 0.29+ opens its loads with O_DIRECT once its start-up probe found it works (as it does on
# kvfs), 0.23-0.26 always: `--o-direct` loads so (the buffers are page-aligned mmaps).
LOAD_FLAGS = os.O_RDONLY


def load_in_threads(root: Path, prefix: str, indices: range, size: int, buffers: list[mmap.mmap]) -> None:
    """vLLM's load (open, one read, close) of files `indices`, split over one thread per buffer."""

    def load(share: range, buffer: mmap.mmap) -> None:
        for i in share:
            fd = os.open(root / f"{prefix}{i}.bin", LOAD_FLAGS)
            got = os.readv(fd, [buffer])
            os.close(fd)
            assert got == size, f"short read: {got}"

    threads = [threading.Thread(target=load, args=(indices[r :: len(buffers)], buffer))
               for r, buffer in enumerate(buffers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def cold_load(root: Path, prefix: str, count: int, size: int, readers: int = 1,
              cpu: AbstractContextManager[object] | None = None) -> float:
    """Files 0..count-1 loaded by `readers` threads, cold; `cpu` (a CpuSpan) spans the load alone."""
    drop_page_cache()
    buffers = [mmap.mmap(-1, size) for _ in range(readers)]
    with cpu or nullcontext():
        start = time.perf_counter()
        load_in_threads(root, prefix, range(count), size, buffers)
        elapsed = time.perf_counter() - start
    return count * size / elapsed / 1e9


def lookup_then_load(root: Path, prefix: str, count: int, size: int, readers: int = 1, batch: int = 16,
                     cpu: AbstractContextManager[object] | None = None) -> float:
    """vLLM's pattern per request: its lookup thread checks that each chunk's file exists
    (`access`, serially), then the loaders load them; `batch` chunks per request. Cold;
    `cpu` (a CpuSpan) spans the loads alone."""
    drop_page_cache()
    buffers = [mmap.mmap(-1, size) for _ in range(readers)]
    with cpu or nullcontext():
        start = time.perf_counter()
        for first in range(0, count, batch):
            request = range(first, min(count, first + batch))
            for i in request:
                assert os.access(root / f"{prefix}{i}.bin", os.F_OK)
            load_in_threads(root, prefix, request, size, buffers)
        elapsed = time.perf_counter() - start
    return count * size / elapsed / 1e9


def spin(share: float, period: float = 0.01) -> None:
    """Busy for SHARE of every PERIOD, asleep for the rest: a competing CPU load."""
    while True:
        start = time.monotonic()
        while time.monotonic() - start < share * period:
            pass
        time.sleep((1 - share) * period)


@contextmanager
def competing_load(share: float) -> Iterator[None]:
    hog = Process(target=spin, args=(share,), daemon=True)
    hog.start()
    try:
        yield
    finally:
        hog.kill()
        hog.join()


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


def node_command(name: str, master: str, mountpoint: Path, dram: str, bundle: Path,
                 peer_encryption: str = "on") -> list[str]:
    return [sys.executable, "-m", "kvfs", "node", "--master", master, "--mount", str(mountpoint), "--name", name,
            "--tls-dir", str(bundle), "-f", "--dram", dram, "--log-level", "warning",
            "--peer-encryption", peer_encryption]


def mooncake_venv(args: argparse.Namespace) -> Path | None:
    """The venv to measure Mooncake from (installing it if asked), or None with the reason printed."""
    venv = Path(args.mooncake_venv)
    if args.install_mooncake and mooncake_peer.missing(venv) is not None and os.geteuid() == 0:
        print(f"installing {mooncake_peer.PACKAGE} into {venv}", file=sys.stderr, flush=True)
        mooncake_peer.install(venv)
    why = mooncake_peer.missing(venv)
    if why is None:
        return venv
    print(f"Mooncake is not measured ({why}). To measure it beside kvfs: "
          f"{mooncake_peer.how_to_install(venv)} (or run with --install-mooncake)", flush=True)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,32", help="file sizes in MiB, comma-separated")
    parser.add_argument("--total", default="512M", help="bytes per size and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dram", default="2G", help="each node's DRAM tier")
    parser.add_argument("--lookups", type=int, default=20000, help="distinct absent names per round")
    parser.add_argument("--transfers-only", action="store_true", help="skip the lookup measurements")
    parser.add_argument("--hog", action="store_true",
                        help=f"measure kvfs and Mooncake again beside a process busy {HOG_SHARE:g} of a core")
    parser.add_argument("--json", help="also write every round's figures to this file")
    parser.add_argument("--mooncake-venv", default=str(mooncake_peer.VENV),
                        help="the venv that holds Mooncake Store's package")
    parser.add_argument("--install-mooncake", action="store_true",
                        help=f"create that venv and pip install {mooncake_peer.PACKAGE} if it is missing")
    parser.add_argument("--peer-encryption", default="on", choices=["on", "off"],
                        help="both nodes' --peer-encryption (on: chunks from A to B in kvfs's encrypted records "
                             "after the TLS setup; off: in the clear)")
    parser.add_argument("--o-direct", action="store_true",
                        help="loads open with O_DIRECT, as vLLM's do once its probe found O_DIRECT works")
    parser.add_argument("--report", metavar="JSON", help="print the tables of a run's --json file, measuring nothing")
    args = parser.parse_args()
    global LOAD_FLAGS
    LOAD_FLAGS = os.O_RDONLY | (os.O_DIRECT if args.o_direct else 0)
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    if args.report:
        saved: dict[str, list[float]] = json.loads(Path(args.report).read_text())
        report(saved, sizes, any(k.startswith("mooncake") for k in saved), any(k.endswith(" hog") for k in saved),
               not any(k.startswith("absent") for k in saved))
        return
    prepare_machine()
    venv = mooncake_venv(args)
    total = parse_size(args.total)
    results: dict[str, list[float]] = {}
    loads = ["", " hog"] if args.hog else [""]

    def record(metric: str, value: float) -> None:
        results.setdefault(metric, []).append(value)

    with tempfile.TemporaryDirectory(prefix="kvfs-bench-cluster-") as scratch:
        base = Path(scratch)
        bundles = issue_bundles(base)
        os.environ["KVFS_TLS_DIR"] = str(bundles["bench"])
        master, address = start_master(base, bundles["master"])
        processes = [master]
        # The writer's segment holds one size's objects of a round (and the allocator's slack).
        mooncake = (mooncake_peer.MooncakeSide(venv, base, PARALLEL, total + PARALLEL * max(sizes) + 256 * MiB,
                                               max(sizes), BATCH) if venv is not None else nullcontext())
        try:
            encryption = args.peer_encryption
            a = start_daemon("node-a", node_command("a", address, base / "a", args.dram, bundles["a"], encryption),
                             base / "a")
            b = start_daemon("node-b", node_command("b", address, base / "b", args.dram, bundles["b"], encryption),
                             base / "b")
            single = start_daemon("single", [sys.executable, "-m", "kvfs", "mount", str(base / "single"), "-f",
                                             "--dram", "256M", "--log-level", "warning"], base / "single")
            # The smallest pyfuse3 file system, its files in its own memory: the ceiling of a
            # load through this stack on this machine, with no network and no metadata at all.
            floor = start_daemon("trivial", [sys.executable, "scripts/trivialfs.py", str(base / "trivial")],
                                 base / "trivial")
            processes += [a.process, b.process, single.process, floor.process]
            pids = {name: target.process.pid for name, target in
                    (("A", a), ("B", b), ("local", single), ("floor", floor)) if target.process is not None}
            pids["master"] = master.pid
            with mooncake as side:
                for round_ in range(args.rounds):
                    print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
                    for size in sizes:
                        transfers(record, round_, size, total, a.path, b.path, single.path, floor.path, bundles,
                                  side, loads, pids)
                    if not args.transfers_only:
                        lookups(record, round_, a.path, b.path, single.path, args.lookups)
                    if args.json:  # after every round: a run cut short keeps what it measured
                        Path(args.json).write_text(json.dumps(results, indent=1))
        finally:
            for process in reversed(processes):
                if process is not None:
                    process.terminate()
                    process.wait(timeout=60)
    report(results, sizes, venv is not None, args.hog, args.transfers_only)


def transfers(record: Record, round_: int, size: int, total: int, a: Path, b: Path, single: Path, floor: Path,
              bundles: dict[str, Path], mooncake: mooncake_peer.MooncakeSide | None, loads: list[str],
              pids: dict[str, int]) -> None:
    """One round of one size: raw TCP and TLS, kvfs B<-A beside Mooncake (alternating), local,
    and the smallest pyfuse3 file system's local load; with the CPU of each load but the raw ones
    (`pids`: the processes of kvfs's "master", "A", "B", "local" and the "floor" file system)."""
    count = max(PARALLEL, total // size)
    label = f"{size // MiB}MiB"
    buffer = mmap.mmap(-1, size)
    buffer.write(os.urandom(size))
    prefix = f"r{round_}-{label}-"
    store_files(a, prefix, count, buffer)
    local_count = min(count, 96 * MiB // size)
    store_files(single, prefix, local_count, buffer)
    store_files(floor, prefix, local_count, buffer)
    if mooncake is not None:
        mooncake.put(prefix, count, size)
        if round_ == 0:
            before = mooncake.loopback_bytes()  # a check that Mooncake's gets cross TCP
            mooncake.get(prefix, count, size, 1, 1)
            record(f"mooncake loopback share {label}", (mooncake.loopback_bytes() - before) / (count * size))
    cluster = {role: [pids[role]] for role in ("master", "A", "B")}

    def measured(metric: str, files: int, cpu: CpuSpan, measure: Callable[[CpuSpan], float]) -> None:
        """Records the load's GB/s and, as "cpu ROLE METRIC", each party's ms of CPU per file."""
        record(metric, measure(cpu))
        for role, seconds in cpu.spent.items():
            record(f"cpu {role} {metric}", seconds * 1000 / files)

    def mooncake_get(cpu: CpuSpan, readers: int, batch: int) -> float:
        assert mooncake is not None
        with cpu:
            return mooncake.get(prefix, count, size, readers, batch)

    for streams in (1, PARALLEL):
        cell = f"{label} x{streams}"
        record(f"raw TCP {cell}", raw_tcp(size, count, streams))
        record(f"raw TLS {cell}", raw_tcp(size, count, streams, bundles["a"]))
        # kvfs and Mooncake alternate; which one goes first swaps every round. Each step: its
        # metric, the files (objects) it loads, the processes whose CPU it counts, the load.
        got = count // streams * streams  # Mooncake's readers share the objects evenly
        steps: list[tuple[str, int, Callable[[], CpuSpan], Callable[[CpuSpan], float]]] = [
            (f"cross-node {cell}", count, lambda: CpuSpan(cluster, reader=True),
             lambda cpu: cold_load(b, prefix, count, size, streams, cpu=cpu)),
            (f"mooncake get {cell}", got, lambda: CpuSpan(mooncake.pids(streams), reader=False),
             lambda cpu: mooncake_get(cpu, streams, 1)),
            (f"lookup first {cell}", count, lambda: CpuSpan(cluster, reader=True),
             lambda cpu: lookup_then_load(b, prefix, count, size, streams, cpu=cpu)),
            (f"mooncake batch {cell}", got, lambda: CpuSpan(mooncake.pids(streams), reader=False),
             lambda cpu: mooncake_get(cpu, streams, BATCH))]
        if mooncake is None:
            steps = steps[0::2]
        elif round_ % 2:
            steps = [steps[1], steps[0], steps[3], steps[2]]
        for load in loads[round_ % 2 :] + loads[: round_ % 2]:
            with competing_load(HOG_SHARE) if load else nullcontext():
                for metric, files, span, measure in steps:
                    measured(metric + load, files, span(), measure)
        # The same files loaded through A's own mount: every step of B's load but the transfer
        # (the directory copy's lookup, the master's OpenRead, A's DRAM): what B's load can reach.
        measured(f"on owner {cell}", count, CpuSpan(cluster, reader=True),
                 lambda cpu: cold_load(a, prefix, count, size, streams, cpu=cpu))
        for metric, root, role in ((f"local {cell}", single, "local"), (f"pyfuse3 floor {cell}", floor, "floor")):
            measured(metric, local_count, CpuSpan({"daemon": [pids[role]]}, reader=True),
                     lambda cpu: cold_load(root, prefix, local_count, size, streams, cpu=cpu))
    for i in range(count):
        os.unlink(a / f"{prefix}{i}.bin")
    for i in range(local_count):
        os.unlink(single / f"{prefix}{i}.bin")
        os.unlink(floor / f"{prefix}{i}.bin")
    if mooncake is not None:
        mooncake.remove(prefix, count)


def lookups(record: Record, round_: int, a: Path, b: Path, single: Path, count: int) -> None:
    for name, target in (("node", b), ("single", single)):
        misses = [target / f"{round_}-{i:062x}.miss" for i in range(count)]
        record(f"absent lookups/s {name}", lookups_per_second(misses, 1))
        # vLLM's lookup thread asks for the same keys every scheduler step: the
        # kernel's negative entries (1 s) answer the repeats.
        record(f"repeated absent lookups/s {name}", lookups_per_second(misses[:2000], 5))
    first, steady = present_elsewhere(a, b, round_)
    record("present lookups/s node first step", first)
    record("present lookups/s node later steps", steady)
    record("present lookups/s single cold", present_cold(single, round_))


def paired(kvfs: list[float], mooncake: list[float]) -> float:
    """The median of kvfs/Mooncake over rounds, each ratio of two loads measured back to back:
    steadier than a ratio of medians when the machine's load drifts between rounds."""
    return statistics.median(k / m for k, m in zip(kvfs, mooncake))


def spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


KVFS_ROLES = ("master", "A", "B", "reader")  # the parties of a cross-node load, as "cpu ROLE METRIC" names them
MOONCAKE_ROLES = ("master", "writer", "readers")
ALONE_ROLES = ("daemon", "reader")  # a single file system's load: its one daemon and the reader


def cpu_report(results: dict[str, list[float]], sizes: list[int], mooncake: bool) -> None:
    """The CPU per file loaded, by process: kvfs's open beside Mooncake's get, and the other loads' sums."""

    def sums(metric: str, roles: tuple[str, ...]) -> list[float]:
        """Each round's CPU per file, all ROLES together."""
        return [sum(each) for each in zip(*(results[f"cpu {role} {metric}"] for role in roles))]

    def roles(metric: str, names: tuple[str, ...]) -> str:
        return "".join(f"{statistics.median(results[f'cpu {role} {metric}']):>8.2f}" for role in names)

    def total(values: list[float]) -> str:
        return f"{f'{statistics.median(values):.2f} ({spread(values)})':>22}"

    others = [("lookup,open", "lookup first", KVFS_ROLES), ("local", "local", ALONE_ROLES),
              ("floor", "pyfuse3 floor", ALONE_ROLES)]
    if mooncake:
        others.insert(1, ("MC batch", "mooncake batch", MOONCAKE_ROLES))
    if any(metric.startswith("cpu A on owner ") for metric in results):  # (runs saved before it have none)
        others.insert(-2, ("on A", "on owner", KVFS_ROLES))
    print("CPU per file loaded, by process (ms of user + system time, every thread): medians over rounds; "
          "sums: the median of each round's sum (range)")
    print(f"{'':<12}{'kvfs open (B<-A)':^54}" + (f"{'Mooncake get':^46}{'':>14}" if mooncake else "")
          + f"{'sums of the other loads':^{13 * len(others)}}")
    print(f"{'cell':<12}" + "".join(f"{role:>8}" for role in KVFS_ROLES) + f"{'sum':>22}"
          + ("".join(f"{role:>8}" for role in MOONCAKE_ROLES) + f"{'sum':>22}{'kvfs/MC':>14}" if mooncake else "")
          + "".join(f"{name:>13}" for name, _, _ in others))
    for size in sizes:
        for streams in (1, PARALLEL):
            cell = f"{size // MiB}MiB x{streams}"
            kvfs = sums(f"cross-node {cell}", KVFS_ROLES)
            row = f"{cell:<12}{roles(f'cross-node {cell}', KVFS_ROLES)}{total(kvfs)}"
            if mooncake:
                get = sums(f"mooncake get {cell}", MOONCAKE_ROLES)
                ratio = f"{statistics.median(kvfs) / statistics.median(get):.2f} [{paired(kvfs, get):.2f}]"
                row += f"{roles(f'mooncake get {cell}', MOONCAKE_ROLES)}{total(get)}{ratio:>14}"
            row += "".join(f"{statistics.median(sums(f'{metric} {cell}', parties)):>13.2f}"
                           for _, metric, parties in others)
            print(row)
    print("(per file" + (" or object" if mooncake else "") + " loaded. master, A, B, daemon"
          + (" and Mooncake's processes" if mooncake else "") + ": utime + stime of /proc/PID/stat,")
    print(f" counted in ticks of {1000 / TICK:g} ms per process and load; reader: this process's getrusage over "
          "the load, its N threads together;")
    if mooncake:
        print(" Mooncake xN: its N reader processes summed. kvfs/MC: ratio of the median sums [the median of each "
              "round's ratio];")
        print(" above 1, a kvfs load costs more CPU than a Mooncake get. MC batch: batch_get_into (master, writer, "
              "readers);")
    print(" lookup,open: kvfs's lookup then load (master, A, B, reader); on A: the same files through A's own mount"
          " (master, A, B, reader);")
    print(" local: the single-node mount, floor:")
    print(" scripts/trivialfs.py (each its daemon and the reader))")
    print()


def report(results: dict[str, list[float]], sizes: list[int], mooncake: bool, hog: bool, transfers_only: bool) -> None:
    def median(metric: str) -> float:
        return statistics.median(results[metric])

    print(f"{'transfer':<24}{'raw TCP':>9}{'raw TLS':>9}{'kvfs B<-A':>11}{'kvfs local':>12}{'kvfs/raw':>10}"
          f"{'/rawTLS':>9}{'/local':>8}   (GB/s)")
    for size in sizes:
        for pattern, metric in (("open", "cross-node"), ("lookup, open", "lookup first")):
            for streams in (1, PARALLEL):
                label = f"{size // MiB}MiB x{streams}"
                raw, raw_tls, kvfs, local = (median(f"{m} {label}") for m in ("raw TCP", "raw TLS", metric, "local"))
                print(f"{label + ' ' + pattern:<24}{raw:>9.2f}{raw_tls:>9.2f}{kvfs:>11.2f}{local:>12.2f}"
                      f"{kvfs / raw:>10.2f}{kvfs / raw_tls:>9.2f}{kvfs / local:>8.2f}")
    print("(xN: N readers at once, N connections for raw TCP and TLS; vLLM loads with 16 threads. 'open': open,")
    print(" read, close per file; 'lookup, open': vLLM's lookup thread checks 16 files exist, then they load)")
    print()
    if mooncake:
        print(f"kvfs B<-A beside Mooncake Store over TCP (get_into; batch: batch_get_into of {BATCH}), "
              "medians and ranges (GB/s); ratios of the medians, and [the median of each round's ratio]")
        print(f"{'cell':<12}{'kvfs open':>18}{'kvfs lookup,open':>18}{'MC get':>18}{'MC batch':>18}"
              f"{'open/get':>14}{'lookup/get':>14}{'open/batch':>14}")
        for size in sizes:
            for streams in (1, PARALLEL):
                cell = f"{size // MiB}MiB x{streams}"
                names = (f"cross-node {cell}", f"lookup first {cell}", f"mooncake get {cell}",
                         f"mooncake batch {cell}")
                open_, lookup, get, batch = (median(n) for n in names)
                shown = "".join(f"{f'{median(n):.2f} ({spread(results[n])})':>18}" for n in names)
                ratios = "".join(f"{f'{ratio:.2f} [{paired(results[k], results[m]):.2f}]':>14}" for ratio, k, m in (
                    (open_ / get, names[0], names[2]), (lookup / get, names[1], names[2]),
                    (open_ / batch, names[0], names[3])))
                print(f"{cell:<12}{shown}{ratios}")
        print("(Mooncake xN: N reader processes; kvfs xN: N reader threads on node B's mount. Bytes on the "
              "namespace's loopback per byte got: "
              + ", ".join(f"{median(f'mooncake loopback share {s // MiB}MiB'):.2f}" for s in sizes) + ")")
        print()
        print("the ceiling of a load through pyfuse3 here: the smallest pyfuse3 file system (scripts/trivialfs.py) "
              "loading the same files from its own memory, no network; kvfs's own local load beside it; and the "
              "same files loaded through node A's own mount (on A: all of B's load but the transfer)")
        owner = any(metric.startswith("on owner ") for metric in results)  # (runs saved before it have none)
        print(f"{'cell':<12}{'pyfuse3 floor':>18}{'kvfs local':>18}" + (f"{'kvfs on A':>18}" if owner else "")
              + f"{'MC get':>18}{'floor/get':>14}{'local/get':>14}" + (f"{'on A/get':>14}" if owner else ""))
        for size in sizes:
            for streams in (1, PARALLEL):
                cell = f"{size // MiB}MiB x{streams}"
                names = (f"pyfuse3 floor {cell}", f"local {cell}", *([f"on owner {cell}"] if owner else []),
                         f"mooncake get {cell}")
                shown = "".join(f"{f'{median(n):.2f} ({spread(results[n])})':>18}" for n in names)
                get = names[-1]
                ratios = "".join(f"{f'{median(k) / median(get):.2f} [{paired(results[k], results[get]):.2f}]':>14}"
                                 for k in names[:-1])
                print(f"{cell:<12}{shown}{ratios}")
        print("(where floor/get is below 1, no file system served through pyfuse3 on this machine, with or without "
              "a network, loads as fast as Mooncake's get in that cell; where on A/get is, neither does a kvfs "
              "load that needs no transfer at all)")
        print()
    if hog:
        print(f"beside a competing load of {HOG_SHARE:g} core: medians quiet -> loaded (GB/s), the change, "
              "[the median of each round's change]")
        kinds = [("kvfs open", "cross-node"), ("kvfs lookup,open", "lookup first")]
        if mooncake:
            kinds += [("MC get", "mooncake get"), ("MC batch", "mooncake batch")]
        print(f"{'cell':<12}" + "".join(f"{name:>30}" for name, _ in kinds))
        for size in sizes:
            for streams in (1, PARALLEL):
                cell = f"{size // MiB}MiB x{streams}"
                row = ""
                for _, metric in kinds:
                    quiet, loaded = median(f"{metric} {cell}"), median(f"{metric} {cell} hog")
                    each = paired(results[f"{metric} {cell} hog"], results[f"{metric} {cell}"]) - 1
                    row += f"{f'{quiet:.2f} -> {loaded:.2f} {loaded / quiet - 1:+.0%} [{each:+.0%}]':>30}"
                print(f"{cell:<12}{row}")
        print()
    if any(metric.startswith("cpu ") for metric in results):  # runs saved before it was measured have none
        cpu_report(results, sizes, mooncake)
    if not mooncake:
        print("Mooncake was not measured: no ratios to it (see the first line of the output)")
    if transfers_only:
        return
    for kind in ("absent", "repeated absent"):
        node, single = (median(f"{kind} lookups/s {n}") for n in ("node", "single"))
        print(f"{kind} lookups/s: cluster node {node:,.0f} (master in another process), "
              f"single-node mount {single:,.0f}, ratio {node / single:.2f}")
    first, later, cold = (median(f"present lookups/s {kind}")
                          for kind in ("node first step", "node later steps", "single cold"))
    print(f"present lookups/s of names written on node A, through node B: first step {first:,.0f}, "
          f"later steps {later:,.0f}; single-node mount, kernel entries dropped: {cold:,.0f}")
    print("targets: kvfs/Mooncake >= 1 in every cell (aim 1.5), a loss under load no larger than Mooncake's, "
          "absent lookups >= 20000/s, present lookups through B >= 20000/s")


if __name__ == "__main__":
    main()
