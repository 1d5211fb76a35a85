"""What a master holds per file, by the line that allocated it.

Drives the pure metadata service as `bench_metadata.py --layers master` drives a
`kvfs master`: one node, FILES files of 68-byte hex names (`<64 hex>.bin`) in one
directory, each a Create with its kernel reference kept and a Seal with the release
(4 KiB, one chunk checksum, the clock's ns as mtime, as a node sends them), the default
eviction policy, a system clock. Then prints tracemalloc's bytes per file, in all and by
allocation site (traced sizes: pymalloc rounds each block up to 16 B).

Files created within the master's publish grace (30 s) still hold an entry of it: a
run shorter than that counts them for every file (docs/cluster.md).

Usage: python scripts/bench_metadata_sites.py [--files N] [--distinct-checksums]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvfs.clock import SystemClock  # noqa: E402
from kvfs.cluster.master import MasterSettings, MetadataService  # noqa: E402
from kvfs.policy import DEFAULT_POLICY, make_policy  # noqa: E402
from kvfs.wire import messages as m  # noqa: E402

SHARED_CHECKSUM = 0xDEADBEEFCAFEF00D  # one int object for every file: the checksum's own bytes left out
MIN_SHOWN = 0.5  # bytes per file below which a site is not printed


def fill(files: int, distinct_checksums: bool) -> tuple[float, list[tuple[float, float, str]]]:
    """Bytes per file in all, and (bytes, blocks, site) per file for each site, largest first."""
    service = MetadataService(SystemClock(), make_policy(DEFAULT_POLICY), MasterSettings(cluster=True))
    node = service.handle(m.Register("bench", "127.0.0.1:1")).node
    service.handle(m.FinishRegistration(), node)
    directory = service.handle(m.MkDir(1, b"keys", 0o755, 0, 0), node).ino
    gc.collect()
    tracemalloc.start(1)
    before = tracemalloc.take_snapshot()
    names = [f"{i:064x}.bin".encode() for i in range(files)]  # (traced: what the master keeps of them counts)
    for number, name in enumerate(names):
        checksum = int.from_bytes(os.urandom(8), "little") if distinct_checksums else SHARED_CHECKSUM
        opened = service.handle(m.Create(directory, name, 0o644, 0, 0, node, True), node)
        service.handle(m.Seal(opened.version, 4096, time.time_ns(), [checksum], release=True), node)
        if number % 100_000 == 99_999:
            print(f"  {number + 1:,} files", file=sys.stderr, flush=True)
    service.ns.dirty.clear()  # what the owner's save does after each batch
    service.objects.dirty.clear()
    del names
    gc.collect()
    stats = tracemalloc.take_snapshot().compare_to(before, "lineno")
    tracemalloc.stop()
    total = sum(stat.size_diff for stat in stats) / files
    sites = []
    for stat in stats:
        if abs(stat.size_diff) / files >= MIN_SHOWN:
            frame = stat.traceback[0]
            site = "the checksums (made here, kept by the master)" if frame.filename == __file__ \
                else f"{frame.filename.split('kvfs/')[-1]}:{frame.lineno}"
            sites.append((stat.size_diff / files, stat.count_diff / files, site))
    return total, sites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=100_000, help="files to create (default 100,000)")
    parser.add_argument("--distinct-checksums", action="store_true",
                        help="a checksum int of its own per file, as real blocks have (default: one shared)")
    args = parser.parse_args()
    if args.files < 1:
        parser.error("--files must be at least 1")
    total, sites = fill(args.files, args.distinct_checksums)
    print(f"policy {DEFAULT_POLICY}, {args.files:,} files: {total:.1f} B per file traced, names included")
    for size, blocks, site in sites:
        print(f"{size:7.1f} B  {blocks:5.2f} blocks  {site}")


if __name__ == "__main__":
    main()
