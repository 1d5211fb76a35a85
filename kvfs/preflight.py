"""Checks before anything is allocated: memory, disk space, io_uring, FUSE, ports, credentials,
the mount point. `kvfs mount`, `kvfs node` and `kvfs master` refuse to start on a failed check;
`kvfs check` runs the same checks and prints them as a table.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

from kvfs.config import format_size, split_address
from kvfs.errors import ConfigError

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    name: str
    result: str  # ok, warn or fail
    detail: str


def available_memory() -> int:
    """MemAvailable: what can be allocated without swapping or pushing others out."""
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_memory(dram_bytes: int) -> Check:
    available = available_memory()
    if dram_bytes > available:
        return Check("memory", FAIL, f"--dram {format_size(dram_bytes)} is more than the "
                                     f"{format_size(available)} of memory available")
    return Check("memory", OK, f"--dram {format_size(dram_bytes)} of {format_size(available)} available")


def _existing_segments(disk_path: str) -> int:
    """Bytes already held by the tier's segment files (reused on a restart)."""
    total = 0
    for segment in Path(disk_path, "segments").glob("segment-*.dat"):
        try:
            total += segment.stat().st_blocks * 512
        except OSError:
            pass
    return total


def disk_room(disk_path: str) -> tuple[int, str]:
    """The bytes an SSD tier in `disk_path` can have (free space plus its own segment files),
    and the existing directory whose file system was measured."""
    probe = os.path.abspath(disk_path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize + _existing_segments(disk_path), probe


FIT_RESERVE = 0.05  # --disk-fit leaves this much of the free space to others


def fitted_disk_bytes(disk_path: str, disk_bytes: int) -> int:
    """`--disk-fit`: the asked size, or when less is free, 95% of what is (whole MiB)."""
    room, _ = disk_room(disk_path)
    if disk_bytes <= room:
        return disk_bytes
    return int(room * (1 - FIT_RESERVE)) // (1 << 20) * (1 << 20)


def check_disk(disk_path: str, disk_bytes: int) -> Check:
    try:
        room, measured = disk_room(disk_path)
    except OSError as error:
        return Check("disk space", FAIL, f"--disk {disk_path}: {error.strerror}")
    if disk_bytes > room:
        return Check("disk space", FAIL,
                     f"--disk-size {format_size(disk_bytes)} is more than the {format_size(room)} free in "
                     f"{measured} (--disk-fit takes what fits)")
    return Check("disk space", OK, f"--disk-size {format_size(disk_bytes)} of {format_size(room)} free in {measured}")


def check_io_uring(io_engine: str, disk_path: str | None = None) -> Check:
    """io_uring proven in a child process, in the SSD tier's directory when it exists already."""
    from kvfs.disk.probe import probe_io_uring

    if io_engine == "threads":
        return Check("io_uring", OK, "not used (--io-engine threads)")
    reason = probe_io_uring(Path(disk_path) if disk_path and os.path.isdir(disk_path) else None)
    if reason is None:
        return Check("io_uring", OK, "usable")
    if io_engine == "io_uring":
        return Check("io_uring", FAIL, f"io_engine io_uring: unavailable here: {reason}")
    return Check("io_uring", WARN, f"{reason}; the SSD tier uses threads")


def check_fuse() -> Check:
    try:
        fd = os.open("/dev/fuse", os.O_RDWR)
    except OSError as error:
        return Check("fuse", FAIL, f"/dev/fuse: {error.strerror} (load the fuse module: modprobe fuse)")
    os.close(fd)
    if shutil.which("fusermount3") is None:
        return Check("fuse", FAIL, "fusermount3 is not installed (apt-get install fuse3)")
    return Check("fuse", OK, "/dev/fuse and fusermount3")


def check_port(address: str, what: str) -> Check:
    """Whether a server can listen on `address` (port 0: any free port)."""
    name = f"port {what}"
    try:
        host, port = split_address(address)
    except ValueError as error:
        return Check(name, FAIL, f"--{what}: {error}")
    if port == 0:
        return Check(name, OK, f"{address} (a free port)")
    try:
        family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do
            sock.bind((host, port))
    except socket.gaierror as error:
        return Check(name, FAIL, f"--{what} {address}: cannot resolve {host} ({error.strerror})")
    except OSError as error:
        return Check(name, FAIL, f"--{what} {address}: {error.strerror}")
    return Check(name, OK, f"{address} is free")


def check_credentials(directory: str, role: str = "ROLE") -> Check:
    """The identity bundle (--tls-dir) must be complete, its key readable by its owner only,
    and its certificate loadable."""
    from kvfs.security.credentials import Tls

    try:
        tls = Tls.load(directory, role)
    except ConfigError as error:
        return Check("credentials", FAIL, str(error))
    return Check("credentials", OK, f"{directory}: {tls.identity}")


def check_mountpoint(mountpoint: str, nonempty: bool) -> Check:
    from kvfs.fuse.mount import find_mount

    name = "mount point"
    try:
        entries = os.listdir(mountpoint)
    except FileNotFoundError:
        return Check(name, OK, f"{mountpoint} (created at mount)")
    except NotADirectoryError:
        return Check(name, FAIL, f"{mountpoint} is not a directory")
    except OSError as error:
        if error.errno == errno.ENOTCONN:
            return Check(name, WARN, f"{mountpoint}: stale mount of a daemon that died (cleaned up at mount)")
        return Check(name, FAIL, f"{mountpoint}: {error.strerror}")
    existing = find_mount(mountpoint)
    if existing is not None and existing.fstype.startswith("fuse"):
        return Check(name, FAIL, f"{mountpoint} is already mounted ({existing.fstype}); "
                                 f"run 'kvfs umount {mountpoint}' first")
    if entries and not nonempty:
        return Check(name, FAIL, f"{mountpoint} is not empty ({len(entries)} entries would be hidden); "
                                 f"--nonempty mounts over them")
    return Check(name, OK, f"{mountpoint}" + (f" (not empty: {len(entries)} entries hidden)" if entries else ""))


def failures(checks: list[Check]) -> list[Check]:
    return [check for check in checks if check.result == FAIL]


def refuse_on_failure(checks: list[Check]) -> None:
    """Raises one error naming every failed check (a daemon does not start on any)."""
    failed = failures(checks)
    if failed:
        raise ConfigError("; ".join(check.detail for check in failed))


def render(checks: list[Check]) -> str:
    width = max(len(check.name) for check in checks)
    lines = [f"{'CHECK':<{width}}  RESULT  DETAIL"]
    lines += [f"{check.name:<{width}}  {check.result:<6}  {check.detail}" for check in checks]
    return "\n".join(lines)


def check_master(address: str, timeout: float = 3.0) -> Check:
    """Whether the master's port answers (the handshake is the node's own)."""
    try:
        host, port = split_address(address)
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except ValueError as error:
        return Check("master", FAIL, f"--master: {error}")
    except socket.timeout:
        return Check("master", FAIL, f"master {address}: no answer within {timeout:.0f} s")
    except OSError as error:
        return Check("master", FAIL, f"master {address}: {error.strerror or error}")
    return Check("master", OK, f"{address} answers")
