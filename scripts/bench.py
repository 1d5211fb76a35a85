"""Benchmark kvfs against tmpfs and a trivial pyfuse3 filesystem, side by side in one run.

Measures, for each file size, store and load throughput with the vLLM fs-tier
pattern (one write per file then rename; one read per file), cold (page cache
dropped, the daemon serves), with O_DIRECT, and warm (kernel page cache), plus
access() lookups per second for hits, repeated misses and distinct misses, and
present names in vLLM's lookup pattern (every chunk file of the queued requests
checked with access() once per scheduler step, after vLLM stored them: write a
temp file, rename): `stat` right after the store, the steps that follow, and
the same lookups once the kernel dropped its entries (every one reaches the
file system). bindfs over a tmpfs directory is measured too when it is
installed (apt-get install bindfs). Rounds are interleaved across the
filesystems so that machine noise hits all of them; the table shows medians and
the ratios the targets are stated in.

Usage (as root): python scripts/bench.py [--sizes 2,32] [--total 512M] [--rounds 3] [--lookups-only]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvfs.config import parse_size  # noqa: E402
from kvfs.fuse.mount import find_mount  # noqa: E402

# The daemons started here run side by side: metrics on ports of their own, not 9740/9741.
os.environ.setdefault("KVFS_METRICS_LISTEN", "127.0.0.1:0")

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent


def warm_guest_memory(nbytes: int) -> None:
    """Touches (then frees) memory once, so that page-cache pages the run allocates are not
    a virtual machine's first touch of them: on this VM a first touch of guest memory is
    several times slower than any later one, which made measurements depend on how much
    memory earlier runs had happened to use."""
    import mmap as _mmap

    region = _mmap.mmap(-1, nbytes)
    try:
        region.madvise(23)  # MADV_POPULATE_WRITE
    except OSError:
        for offset in range(0, nbytes, 4096):
            region[offset] = 1
    region.close()


def available_memory() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def prepare_machine() -> None:
    """Refuses to run without root, then warms guest memory (half of what is available, at
    most 12 GiB: half of all memory got a run killed by the OOM killer while other work
    held much of it)."""
    if os.geteuid() != 0:
        raise SystemExit("run as root: the benchmark mounts file systems and drops the page cache")
    print("warming guest memory", file=sys.stderr, flush=True)
    warm_guest_memory(min(12 << 30, available_memory() // 2))


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


@dataclass
class Target:
    name: str
    path: Path
    process: subprocess.Popen | None = None
    results: dict[str, list[float]] = field(default_factory=dict)

    def record(self, metric: str, value: float) -> None:
        self.results.setdefault(metric, []).append(value)

    def median(self, metric: str) -> float:
        return statistics.median(self.results[metric])


def start_daemon(name: str, command: list[str], mountpoint: Path) -> Target:
    mountpoint.mkdir(parents=True)
    log = open(mountpoint.parent / f"{name}.log", "wb")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    deadline = time.monotonic() + 30
    while find_mount(str(mountpoint)) is None or os.stat(mountpoint).st_ino != 1:
        if process.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{name} did not mount; see {log.name}")
        time.sleep(0.05)
    time.sleep(0.2)  # let post-mount tuning (readahead) land before measuring
    return Target(name, mountpoint, process)


def store_files(root: Path, prefix: str, count: int, buffer: mmap.mmap) -> float:
    """vLLM's store: create exclusive, one write, close, rename. Returns GB/s."""
    start = time.perf_counter()
    for i in range(count):
        final = root / f"{prefix}{i}.bin"
        tmp = root / f"{prefix}{i}.bin_1.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC, 0o644)
        os.write(fd, buffer)
        os.close(fd)
        os.rename(tmp, final)
    return count * len(buffer) / (time.perf_counter() - start) / 1e9


def load_files(root: Path, prefix: str, count: int, buffer: mmap.mmap, direct: bool = False) -> float:
    """vLLM's load: open, one read of the whole file, close. Returns GB/s."""
    start = time.perf_counter()
    for i in range(count):
        fd = os.open(root / f"{prefix}{i}.bin", os.O_RDONLY | (os.O_DIRECT if direct else 0))
        got = os.readv(fd, [buffer])
        os.close(fd)
        assert got == len(buffer), f"short read: {got}"
    return count * len(buffer) / (time.perf_counter() - start) / 1e9


def lookups_per_second(paths: list[Path], repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        for path in paths:
            os.access(path, os.F_OK)
    return repeat * len(paths) / (time.perf_counter() - start)


def drop_dentries() -> None:
    """The kernel forgets cached names and inodes (as under memory pressure)."""
    Path("/proc/sys/vm/drop_caches").write_text("2")


def present_lookups(target: Target, round_: int, keys: int = 2048, steps: int = 5) -> None:
    """vLLM's lookup thread on names that exist: it stored each chunk file (temp file,
    one write, rename), then checks every key with access() once per scheduler step."""
    paths = [target.path / f"p{round_}-{i:062x}.bin" for i in range(keys)]
    block = bytes(4096)
    for path in paths:
        tmp = path.with_name(path.name + "_7.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, block)
        os.close(fd)
        os.rename(tmp, path)
    start = time.perf_counter()
    for path in paths:
        os.stat(path)
    target.record("stat after store/s", keys / (time.perf_counter() - start))
    target.record("lookup present/s", lookups_per_second(paths, steps))
    drop_dentries()
    target.record("lookup present cold/s", lookups_per_second(paths, 1))
    for path in paths:
        os.unlink(path)


def measure_round(target: Target, sizes: list[int], total: int, round_: int, lookups: int,
                  lookups_only: bool = False) -> None:
    present_lookups(target, round_)
    for size in ([] if lookups_only else sizes):
        count = max(4, total // size)
        buffer = mmap.mmap(-1, size)
        buffer.write(os.urandom(size))
        label = f"{size // MiB}MiB"
        prefix = f"r{round_}-{label}-"
        target.record(f"store {label}", store_files(target.path, prefix, count, buffer))
        drop_page_cache()
        target.record(f"load cold {label}", load_files(target.path, prefix, count, buffer))
        target.record(f"load warm {label}", load_files(target.path, prefix, count, buffer))
        drop_page_cache()
        target.record(f"load O_DIRECT {label}", load_files(target.path, prefix, count, buffer, direct=True))
        for i in range(count):
            os.unlink(target.path / f"{prefix}{i}.bin")
    keys = target.path  # flat, like an LMCache directory (the trivial fs has no subdirectories)
    hits = [keys / f"{round_}-{i:062x}.bin" for i in range(1000)]
    for path in hits:
        path.write_bytes(b"")
    target.record("lookup hit/s", lookups_per_second(hits, max(1, lookups // 1000)))
    misses = [keys / f"{round_}-{i:062x}.miss" for i in range(2000)]
    target.record("lookup miss distinct/s", lookups_per_second(misses, 1))
    target.record("lookup miss repeated/s", lookups_per_second(misses, max(1, lookups // 2000)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,32", help="file sizes in MiB, comma-separated")
    parser.add_argument("--total", default="512M", help="bytes stored per size and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dram", default="2G", help="kvfs DRAM tier")
    parser.add_argument("--lookups", type=int, default=20000)
    parser.add_argument("--lookups-only", action="store_true", help="skip the store and load rows")
    args = parser.parse_args()
    prepare_machine()
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    total = parse_size(args.total)

    with tempfile.TemporaryDirectory(prefix="kvfs-bench-") as scratch:
        base = Path(scratch)
        tmpfs = base / "tmpfs"
        tmpfs.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4G", "kvfs-bench", str(tmpfs)], check=True)
        targets = [Target("tmpfs", tmpfs)]
        try:
            targets.append(start_daemon("trivial", [sys.executable, "scripts/trivialfs.py", str(base / "trivial")],
                                        base / "trivial"))
            targets.append(start_daemon("kvfs", [sys.executable, "-m", "kvfs", "mount", str(base / "kvfs"), "-f",
                                                 "--dram", args.dram, "--log-level", "warning"], base / "kvfs"))
            if shutil.which("bindfs"):
                (tmpfs / "bindfs-source").mkdir()
                (base / "bindfs").mkdir()
                targets.append(Target("bindfs", base / "bindfs"))  # unmounted below, even if mounting fails
                subprocess.run(["bindfs", str(tmpfs / "bindfs-source"), str(base / "bindfs")], check=True, timeout=30)
            for round_ in range(args.rounds):
                for target in targets:
                    print(f"round {round_ + 1}/{args.rounds}: {target.name}", file=sys.stderr, flush=True)
                    measure_round(target, sizes, total, round_, args.lookups,
                                  args.lookups_only or target.name == "bindfs")
        finally:
            for target in targets:
                if target.process is not None:
                    target.process.terminate()
                    target.process.wait(timeout=30)
                if target.name == "bindfs" and find_mount(str(target.path)) is not None:
                    subprocess.run(["fusermount3", "-u", str(target.path)], check=False)
            subprocess.run(["umount", str(tmpfs)], check=False)
    report(targets)


def report(targets: list[Target]) -> None:
    tmpfs, trivial, kvfs = targets[:3]
    bindfs = targets[3] if len(targets) > 3 else None
    names = [t.name for t in targets]
    print(f"{'metric':<26}" + "".join(f"{name:>12}" for name in names)
          + f"{'kvfs/trivial':>14}{'kvfs/tmpfs':>12}" + (f"{'kvfs/bindfs':>13}" if bindfs else ""))
    for metric in kvfs.results:
        values = [t.median(metric) if metric in t.results else float("nan") for t in targets]
        lookup = "/s" in metric
        unit = "" if lookup else " GB/s"
        cells = "".join(f"{v:>12.0f}" if lookup else f"{v:>12.2f}" for v in values)
        ratios = f"{values[2] / values[1]:>14.2f}{values[2] / values[0]:>12.2f}"
        if bindfs is not None:
            ratios += f"{values[2] / values[3]:>13.2f}" if metric in bindfs.results else f"{'':>13}"
        print(f"{metric + unit:<26}{cells}{ratios}")
    print()
    print("targets: load cold >= 0.80 x trivial, load warm >= 0.80 x tmpfs, lookup miss >= 20000/s, "
          "lookup present >= bindfs")


if __name__ == "__main__":
    main()
