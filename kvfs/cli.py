"""The `kvfs` command line: mount, umount."""

from __future__ import annotations

import argparse
import errno
import logging
import os
import sys
import time

from kvfs import __version__
from kvfs.config import MountConfig, default_disk_bytes, default_dram_bytes, format_size, parse_size
from kvfs.errors import KvfsError
from kvfs.policy import POLICIES

log = logging.getLogger("kvfs")


def init_logging(level: str) -> None:
    """One line per event on stderr (journald adds its own timestamps under systemd)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def default_log_file(mountpoint: str) -> str:
    name = os.path.abspath(mountpoint).strip("/").replace("/", "-") or "root"
    return f"/var/log/kvfs/{name}.log"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfs", description="A POSIX filesystem for LLM KV-cache blocks.")
    parser.add_argument("--version", action="version", version=f"kvfs {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    mount = commands.add_parser("mount", help="mount a single-node kvfs (embedded master)")
    mount.add_argument("mountpoint")
    mount.add_argument("--dram", default=None,
                       help=f"DRAM tier size, e.g. 8G (default: a quarter of memory, here {format_size(default_dram_bytes())})")
    mount.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground (for systemd)")
    mount.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    mount.add_argument("--log-file", default=None,
                       help="where a background daemon logs (default: /var/log/kvfs/<mountpoint>.log)")
    mount.add_argument("--eviction-policy", default="lru", choices=sorted(POLICIES))
    mount.add_argument("--entry-timeout", type=float, default=60.0, help="seconds the kernel caches names and attributes")
    mount.add_argument("--negative-timeout", type=float, default=1.0, help="seconds the kernel caches absent names")
    mount.add_argument("--temp-grace", type=float, default=300.0,
                       help="seconds before an abandoned *.tmp file is collected")
    mount.add_argument("--gc-interval", type=float, default=30.0, help="seconds between orphan collections")
    mount.add_argument("--no-allow-other", dest="allow_other", action="store_false",
                       help="only the mounting user may access the mount")
    ssd = mount.add_argument_group("SSD tier (off unless --disk is given)")
    ssd.add_argument("--disk", default=None, help="directory on the NVMe for the SSD tier (segment files, index)")
    ssd.add_argument("--disk-size", default=None,
                     help="SSD tier size, preallocated (default: half the free space of --disk's file system)")
    ssd.add_argument("--offload", default="eager", choices=["eager", "watermark"],
                     help="eager: copy every sealed file to SSD; watermark: only when DRAM use passes the high mark")
    ssd.add_argument("--high-watermark", type=float, default=0.9, help="fraction of DRAM that starts offloading")
    ssd.add_argument("--low-watermark", type=float, default=0.7, help="fraction of DRAM offloading brings DRAM-only data to")
    ssd.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=True,
                     help="O_DIRECT on the segment files (default on)")
    ssd.add_argument("--backpressure-timeout", type=float, default=30.0,
                     help="seconds a writer may wait for the offloader before ENOSPC")

    umount = commands.add_parser("umount", help="unmount a kvfs mount")
    umount.add_argument("mountpoint")
    umount.add_argument("--lazy", action="store_true", help="detach now even if busy")
    return parser


def run_mount(args: argparse.Namespace) -> int:
    from kvfs.fuse.mount import mount

    config = MountConfig(
        mountpoint=os.path.abspath(args.mountpoint),
        dram_bytes=parse_size(args.dram, "--dram") if args.dram else default_dram_bytes(),
        eviction_policy=args.eviction_policy,
        entry_timeout_s=args.entry_timeout,
        negative_timeout_s=args.negative_timeout,
        temp_grace_s=args.temp_grace,
        gc_interval_s=args.gc_interval,
        allow_other=args.allow_other,
        disk_path=os.path.abspath(args.disk) if args.disk else None,
        disk_bytes=(parse_size(args.disk_size, "--disk-size") if args.disk_size
                    else default_disk_bytes(args.disk) if args.disk else 0),
        offload=args.offload,
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        direct_io=args.direct_io,
        backpressure_timeout_s=args.backpressure_timeout,
    )
    log_file = None if args.foreground else (args.log_file or default_log_file(config.mountpoint))
    code = mount(config, args.foreground, log_file)
    if code == 0 and not args.foreground:
        print(f"kvfs mounted on {config.mountpoint} ({format_size(config.dram_bytes)} DRAM); log: {log_file}")
    return code


def run_umount(args: argparse.Namespace) -> int:
    from kvfs.fuse.mount import find_mount, unmount

    mountpoint = os.path.abspath(args.mountpoint)
    info = find_mount(mountpoint)
    if info is None or not info.fstype.startswith("fuse"):
        raise KvfsError(errno.EINVAL, f"{mountpoint} is not a kvfs mount")
    unmount(mountpoint, lazy=args.lazy)
    deadline = time.monotonic() + 10
    while find_mount(mountpoint) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    init_logging(getattr(args, "log_level", "info"))
    try:
        return {"mount": run_mount, "umount": run_umount}[args.command](args)
    except KvfsError as error:
        log.error("%s", error)
        return 1
    except OSError as error:
        log.error("%s: %s", error.filename or args.command, error.strerror or error)
        return 1
