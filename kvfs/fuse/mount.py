"""The mount point and its kernel connection: finding mounts, stale-mount cleanup, unmounting, tuning."""

from __future__ import annotations

import errno
import logging
import os
import re
import subprocess
from dataclasses import dataclass
from typing import Iterator

from kvfs.config import MountConfig
from kvfs.errors import KvfsError

log = logging.getLogger("kvfs.mount")

FUSECTL = "/sys/fs/fuse/connections"


@dataclass(frozen=True)
class MountInfo:
    mountpoint: str
    major: int
    minor: int
    fstype: str


def _mounts() -> Iterator[MountInfo]:
    """Every mount, in /proc/self/mountinfo's order (a later one is on top of an earlier one)."""
    with open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            major, minor = fields[2].split(":")
            # The kernel escapes space, tab, newline and backslash as octal \ooo.
            point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[4])
            yield MountInfo(point, int(major), int(minor), fields[fields.index("-") + 1])


def find_mount(mountpoint: str) -> MountInfo | None:
    """The mount at `mountpoint`, read from /proc/self/mountinfo (never touches the mount itself)."""
    target = os.path.realpath(mountpoint)
    found = None
    for mount in _mounts():
        if mount.mountpoint == target:
            found = mount  # the last one is on top
    return found


def mount_holding(path: str) -> MountInfo | None:
    """The mount a path lies in (the deepest mount point above it), from /proc/self/mountinfo."""
    target = os.path.realpath(path)
    found = None
    for mount in _mounts():
        point = mount.mountpoint
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and (found is None or len(point) >= len(found.mountpoint)):
            found = mount
    return found


def unmount(mountpoint: str, lazy: bool = False) -> None:
    command = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [mountpoint]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise KvfsError(errno.EBUSY, f"cannot unmount {mountpoint}: {result.stderr.strip() or 'fusermount3 failed'}")


def prepare_mountpoint(mountpoint: str) -> None:
    """Creates the mount point if needed and clears a stale mount left by a killed daemon."""
    try:
        os.statvfs(mountpoint)  # never answered from the kernel's caches, unlike stat
    except FileNotFoundError:
        os.makedirs(mountpoint, exist_ok=True)
        log.info("created mount point %s", mountpoint)
    except OSError as error:
        if error.errno != errno.ENOTCONN:
            raise KvfsError(error.errno or errno.EIO, f"mount point {mountpoint}: {error.strerror}") from None
        log.warning("%s: stale mount of a daemon that died (%s); unmounting it", mountpoint, error.strerror)
        unmount(mountpoint, lazy=True)
    existing = find_mount(mountpoint)
    if existing is not None and existing.fstype.startswith("fuse"):
        raise KvfsError(errno.EBUSY, f"{mountpoint} is already mounted ({existing.fstype}); run 'kvfs umount {mountpoint}' first")
    if not os.path.isdir(mountpoint):
        raise KvfsError(errno.ENOTDIR, f"mount point {mountpoint} is not a directory")


def tune_connection(mountpoint: str, config: MountConfig) -> None:
    """Raises readahead and background-request limits: both are set per mount, after mounting."""
    info = find_mount(mountpoint)
    if info is None:
        return
    if os.path.isdir(FUSECTL) and not os.listdir(FUSECTL):  # fusectl not mounted yet (no systemd)
        subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], capture_output=True)
    settings = {
        f"/sys/class/bdi/{info.major}:{info.minor}/read_ahead_kb": config.read_ahead_kb,
        f"{FUSECTL}/{info.minor}/max_background": config.max_background,
        f"{FUSECTL}/{info.minor}/congestion_threshold": config.max_background * 3 // 4,
    }
    for path, value in settings.items():
        try:
            with open(path, "w") as knob:
                knob.write(str(value))
        except OSError as error:
            log.warning("cannot tune %s to %s: %s (performance may be lower)", path, value, error.strerror)
