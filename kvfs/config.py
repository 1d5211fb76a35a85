"""Configuration of a kvfs mount, with size parsing and machine-derived defaults."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from kvfs.errors import ConfigError
from kvfs.policy import DEFAULT_POLICY

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str, field: str = "size") -> int:
    """Parses '512M', '4G', '1.5GiB' or a plain byte count (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"{field}: cannot parse size {text!r} (examples: 512M, 4G, 1073741824)")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def format_size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


DEFAULT_NODE_METRICS = "0.0.0.0:9740"  # node_exporter style: every interface, a fixed port
DEFAULT_MASTER_METRICS = "0.0.0.0:9741"


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT (or [IPv6]:PORT) as (host, port); ValueError if it is not that."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def check_address(address: str, field: str) -> None:
    """A HOST:PORT setting: a clear error naming the field, at start rather than at first use."""
    try:
        split_address(address)
    except ValueError:
        raise ConfigError(f"{field}: {address!r} is not HOST:PORT") from None


ETCD_SCHEME = "etcd://"
DEFAULT_CLUSTER = "default"  # the election's name in etcd when etcd://... names none (as kvfs master --cluster)
_CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class MasterTarget:
    """Where a node (or a command) finds the master: one fixed HOST:PORT, or the leader that
    the masters of `cluster` elect in etcd, found through any of `etcd` (HOST:PORT each)."""

    address: str | None = None
    etcd: tuple[str, ...] = ()
    cluster: str = DEFAULT_CLUSTER

    @property
    def endpoints(self) -> list[str]:
        """The etcd members' client URLs (the v3 JSON gateway is plain HTTP here)."""
        return [f"http://{member}" for member in self.etcd]

    @property
    def etcd_url(self) -> str:
        """etcd://H:P,H:P without the cluster, as kvfs.net.etcd.parse_endpoints reads it."""
        return ETCD_SCHEME + ",".join(self.etcd)


def parse_master(text: str, field: str = "master") -> MasterTarget:
    """`HOST:PORT`, or `etcd://HOST:PORT[,HOST:PORT...][/CLUSTER]`; ConfigError naming `field`
    and the fault otherwise."""
    if not text.startswith(ETCD_SCHEME):
        check_address(text, field)
        return MasterTarget(address=text)
    members, _, cluster = text[len(ETCD_SCHEME):].partition("/")
    cluster = cluster or DEFAULT_CLUSTER
    if not _CLUSTER_NAME.match(cluster):
        raise ConfigError(f"{field}: {cluster!r} in {text!r} is not a cluster name (letters, digits, '.', '_', "
                          f"'-', at most 64)")
    etcd = tuple(member.strip() for member in members.split(",") if member.strip())
    if not etcd:
        raise ConfigError(f"{field}: {text!r} names no etcd member (etcd://HOST:PORT[,HOST:PORT][/CLUSTER])")
    for member in etcd:
        check_address(member, f"{field} (etcd member)")
    return MasterTarget(etcd=etcd, cluster=cluster)


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_dram_bytes() -> int:
    """A quarter of physical memory: enough to matter, leaving the rest to the inference server."""
    return max(256 << 20, physical_memory() // 4)


@dataclass(frozen=True)
class MountConfig:
    """Everything a single-node mount needs; fields are documented in docs/configuration.md."""

    mountpoint: str
    dram_bytes: int
    eviction_policy: str = DEFAULT_POLICY
    entry_timeout_s: float = 60.0  # positive dentries and attributes cached by the kernel (kvfs mount: 3600)
    negative_timeout_s: float = 1.0  # absent names cached by the kernel
    temp_suffix: str = ".tmp"
    temp_grace_s: float = 300.0  # sealed temp files untouched this long are orphans
    publish_grace_s: float = 30.0  # new files closed, not yet renamed or read, are evicted last this long
    unsealed_per_user: int | None = None  # cap on a non-root user's files open for writing; None: dram / 2; 0: none
    gc_interval_s: float = 30.0
    read_ahead_kb: int = 8192  # set on the mount's bdi after mounting
    max_background: int = 64  # set on the FUSE connection after mounting
    allow_other: bool = True  # let inference servers running as other users in
    max_tasks: int = 64  # concurrent request handlers in the daemon
    disk_path: str | None = None  # the SSD tier's directory; None: DRAM only
    disk_bytes: int = 0
    offload: str = "eager"  # or "watermark"
    high_watermark: float = 0.9
    low_watermark: float = 0.7
    direct_io: bool = True
    io_engine: str = "auto"  # SSD I/O: auto (io_uring, else threads), io_uring, threads
    backpressure_timeout_s: float = 30.0
    # Cluster mode (`kvfs node`): the master's HOST:PORT or etcd://... (parse_master); None runs an
    # embedded master.
    master: str | None = None
    listen: str = "127.0.0.1:0"  # the peer server (chunk reads by other nodes)
    advertise: str | None = None  # the host other nodes reach the peer server at (default: listen host)
    node_name: str = ""  # stable identity across restarts (default: hostname:mountpoint)
    tls: Any = None  # kvfs.security.credentials.Tls: the node's identity bundle (cluster mode)
    master_wait_s: float = 10.0  # how long a request waits for an unreachable master
    metrics_listen: str | None = DEFAULT_NODE_METRICS  # the Prometheus endpoint; None: off
    transport: str = "auto"  # chunks between nodes: auto (RDMA where both have it), tcp, rdma
    rdma_device: str | None = None  # e.g. mlx5_0; None: the first active RoCE v2 / InfiniBand port
    # Chunks between nodes in TLS (True), or in the clear after a TLS setup with peers that
    # have it off too (False: a trusted, isolated network only; docs/cluster.md, Security).
    peer_encryption: bool = True

    def __post_init__(self) -> None:
        if self.dram_bytes < (16 << 20):
            raise ConfigError(f"dram: {self.dram_bytes} bytes is below the 16 MiB minimum")
        if self.dram_bytes > physical_memory() * 9 // 10:
            raise ConfigError(f"dram: {format_size(self.dram_bytes)} is more than 90% of this machine's "
                              f"{format_size(physical_memory())} of memory")
        for name in ("entry_timeout_s", "negative_timeout_s", "temp_grace_s", "publish_grace_s", "gc_interval_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must not be negative")
        if not self.temp_suffix:
            raise ConfigError("temp_suffix: must not be empty")
        if self.io_engine not in ("auto", "io_uring", "threads"):
            raise ConfigError(f"io_engine: {self.io_engine!r} is not auto, io_uring or threads")
        if self.transport not in ("auto", "tcp", "rdma"):
            raise ConfigError(f"transport: {self.transport!r} is not auto, tcp or rdma")
        if self.offload not in ("eager", "watermark"):
            raise ConfigError(f"offload: {self.offload!r} is not eager or watermark")
        if not 0 < self.low_watermark < self.high_watermark <= 1:
            raise ConfigError("watermarks: need 0 < low < high <= 1")
        for name in ("listen", "metrics_listen"):
            if getattr(self, name) is not None:
                check_address(getattr(self, name), name)
        if self.master is not None:
            parse_master(self.master)
        if self.disk_path is not None and self.disk_bytes < (64 << 20):
            raise ConfigError(f"disk_size: {self.disk_bytes} bytes is below the 64 MiB minimum")


def unsealed_cap(config: MountConfig) -> int:
    """Bytes of unsealed files one user may hold (0: no cap): half the DRAM tier by default, so
    that one user's open files cannot pin the tier that every user's files share."""
    return config.dram_bytes // 2 if config.unsealed_per_user is None else config.unsealed_per_user


def default_disk_bytes(path: str) -> int:
    """Half of the free space of the file system that holds `path` (it is preallocated)."""
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe) or "/"
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize // 2
