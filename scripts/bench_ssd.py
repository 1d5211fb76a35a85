"""Benchmark the SSD tier: cold reads through the mount against raw O_DIRECT reads of the
same bytes, and the cost of eager offload to writers, side by side in one run.

- cold SSD load: files whose DRAM copies were dropped (control "drop-dram"), page
  cache dropped, first touch: the daemon reads and verifies every chunk from the
  segment files and serves the read buffer.
- raw: the same extents of the same segment files read with O_DIRECT through the
  io_uring engine, without FUSE, chunks of a file in parallel as kvfs does.
- store with eager offload on (SSD tier) against off (DRAM only), writing less than
  the DRAM tier so that writers never wait: the price of offload running beside them.

Usage (as root): python scripts/bench_ssd.py [--disk DIR] [--sizes 2,32] [--total 512M] [--rounds 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import drop_page_cache, prepare_machine, start_daemon, store_files  # noqa: E402
from kvfs.config import parse_size  # noqa: E402
from kvfs.disk.probe import open_engine  # noqa: E402
from kvfs.disk.segments import SEGMENT_SIZE  # noqa: E402

# The daemons started here run side by side: metrics on ports of their own, not 9740/9741.
os.environ.setdefault("KVFS_METRICS_LISTEN", "127.0.0.1:0")

MiB = 1 << 20


def parallel_load(root: Path, prefix: str, count: int, size: int, threads: int) -> float:
    """The vLLM loader: `threads` workers, each loading its share of the files. Returns GB/s."""
    import threading

    buffers = [mmap.mmap(-1, size) for _ in range(threads)]
    workers = [threading.Thread(target=load_share, args=(root, prefix, range(i, count, threads), buffers[i]))
               for i in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return count * size / (time.perf_counter() - start) / 1e9


def load_share(root: Path, prefix: str, indices: range, buffer: mmap.mmap) -> None:
    for i in indices:
        fd = os.open(root / f"{prefix}{i}.bin", os.O_RDONLY)
        got = os.readv(fd, [buffer])
        os.close(fd)
        assert got == len(buffer), f"short read: {got}"


def raw_read(segment_dir: Path, files: list[Path]) -> float:
    """O_DIRECT io_uring reads of the extents behind `files`, no FUSE. Returns GB/s."""
    extents = []
    for path in files:
        spec = os.getxattr(path, "user.kvfs.ssd_extents").decode()
        extents.append([tuple(map(int, part.split("+"))) for part in spec.split(",")])
    fds: dict[int, int] = {}

    for chunks in extents:
        for offset, _ in chunks:
            index = offset // SEGMENT_SIZE
            if index not in fds:
                fds[index] = os.open(segment_dir / f"segment-{index:05d}.dat", os.O_RDONLY | os.O_DIRECT)

    async def read_file(engine, chunks, view: memoryview) -> int:
        position = total = 0
        async with trio.open_nursery() as reads:  # a file's chunks in parallel, as kvfs does
            for offset, length in chunks:
                padded = -(-length // 4096) * 4096
                reads.start_soon(engine.read_into, fds[offset // SEGMENT_SIZE], offset % SEGMENT_SIZE,
                                 view[position : position + padded])
                position += padded
                total += length
        return total

    async def main() -> float:
        engine = open_engine()
        region = mmap.mmap(-1, 64 * MiB)
        region.madvise(23)  # MADV_POPULATE_WRITE: faulted in before the clock starts, as kvfs's buffers are
        view = memoryview(region)
        done = 0

        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            start = time.perf_counter()
            for chunks in extents:
                done += await read_file(engine, chunks, view)
            elapsed = time.perf_counter() - start
            nursery.cancel_scope.cancel()
        engine.close()
        return done / elapsed / 1e9

    try:
        return trio.run(main)
    finally:
        for fd in fds.values():
            os.close(fd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--disk", default=None, help="directory for the SSD tier (default: a temporary one)")
    parser.add_argument("--sizes", default="2,32")
    parser.add_argument("--total", default="512M")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prepare_machine()
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    total = parse_size(args.total)
    results: dict[str, list[float]] = {}

    def record(metric: str, value: float) -> None:
        results.setdefault(metric, []).append(value)

    with tempfile.TemporaryDirectory(prefix="kvfs-bench-ssd-") as scratch:
        base = Path(scratch)
        disk = Path(args.disk) if args.disk else base / "disk"
        command = [sys.executable, "-m", "kvfs", "mount", "-f", "--log-level", "warning", "--dram", "2G"]
        ssd = start_daemon("kvfs-ssd", command[:4] + [str(base / "ssd")] + command[4:] +
                           ["--disk", str(disk), "--disk-size", "4G"], base / "ssd")
        dram_only = start_daemon("kvfs-dram", command[:4] + [str(base / "dram")] + command[4:], base / "dram")
        try:
            for round_ in range(args.rounds):
                print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
                for size in sizes:
                    label = f"{size // MiB}MiB"
                    count = max(4, total // size)
                    buffer = mmap.mmap(-1, size)
                    buffer.write(os.urandom(size))
                    prefix = f"r{round_}-{label}-"
                    record(f"store {label} DRAM only", store_files(dram_only.path, prefix, count, buffer))
                    record(f"store {label} eager offload", store_files(ssd.path, prefix, count, buffer))
                    os.setxattr(ssd.path, "user.kvfs.control", b"sync")
                    os.setxattr(ssd.path, "user.kvfs.control", b"drop-dram")
                    files = [ssd.path / f"{prefix}{i}.bin" for i in range(count)]
                    # raw and kvfs alternate (the virtual disk caches on its host: the
                    # second reader of the same bytes is favoured, so each goes first half
                    # of the time).
                    for _ in range(2):
                        drop_page_cache()
                        record(f"raw O_DIRECT {label}", raw_read(disk / "segments", files))
                        os.setxattr(ssd.path, "user.kvfs.control", b"drop-dram")  # undo promotions
                        drop_page_cache()
                        record(f"load cold SSD {label}", parallel_load(ssd.path, prefix, count, size, 1))
                    os.setxattr(ssd.path, "user.kvfs.control", b"drop-dram")
                    drop_page_cache()
                    record(f"load cold SSD {label} 4 readers", parallel_load(ssd.path, prefix, count, size, 4))
                    for target in (ssd, dram_only):
                        for i in range(count):
                            os.unlink(target.path / f"{prefix}{i}.bin")
        finally:
            for target in (ssd, dram_only):
                target.process.terminate()
                target.process.wait(timeout=120)

    print(f"{'metric':<30}{'GB/s':>10}")
    for metric, values in results.items():
        print(f"{metric:<30}{statistics.median(values):>10.2f}")
    print()
    for size in sizes:
        label = f"{size // MiB}MiB"
        cold = statistics.median(results[f"load cold SSD {label}"])
        raw = statistics.median(results[f"raw O_DIRECT {label}"])
        eager = statistics.median(results[f"store {label} eager offload"])
        plain = statistics.median(results[f"store {label} DRAM only"])
        print(f"{label}: cold SSD / raw = {cold / raw:.2f} (target >= 0.80); "
              f"store cost of eager offload = {1 - eager / plain:.0%} (target < 20%)")


if __name__ == "__main__":
    main()
