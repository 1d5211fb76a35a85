"""The `kvfs` command line: mount, node, master, status, fsck, umount."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import NoReturn

from kvfs import __version__, preflight
from kvfs.wire import messages as m
from kvfs.config import (DEFAULT_MASTER_METRICS, DEFAULT_NODE_METRICS, MountConfig, check_address,
                         default_disk_bytes, default_dram_bytes, format_size, parse_size)
from kvfs.config_sources import parse_with_sources
from kvfs.errors import CommandError, ConfigError, KvfsError, reason_of
from kvfs.fstab import mount_helper_argv
from kvfs.policy import DEFAULT_POLICY, POLICIES

log = logging.getLogger("kvfs")


class JournalFormatter(logging.Formatter):
    """For stderr connected to journald: a `<priority>` prefix it turns into the entry's
    level (so `journalctl -p warning` works), and no timestamp (it adds its own)."""

    PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

    def format(self, record: logging.LogRecord) -> str:
        priority = self.PRIORITIES.get(record.levelno, 6)
        return f"<{priority}>" + super().format(record)


def stderr_is_journal() -> bool:
    """systemd sets JOURNAL_STREAM to the device:inode of the stream it gave us."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return expected == f"{st.st_dev}:{st.st_ino}"


def init_logging(level: str) -> None:
    """One line per event on stderr: `time LEVEL logger: message`, or for journald
    `<priority>logger: message`."""
    handler = logging.StreamHandler(sys.stderr)
    if stderr_is_journal():
        handler.setFormatter(JournalFormatter("%(name)s: %(message)s"))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def default_log_file(mountpoint: str) -> str:
    name = os.path.abspath(mountpoint).strip("/").replace("/", "-") or "root"
    return f"/var/log/kvfs/{name}.log"


DEFAULT_TLS_DIR = "/etc/kvfs/tls"
DEFAULT_CA_DIR = "/etc/kvfs/ca"
DEFAULT_MASTER_LISTEN = "0.0.0.0:7400"
DEFAULT_MASTER_DATA = "/var/lib/kvfs/master"


# How long the kernel may answer a present name or its attributes by itself. On a single
# node every change passes through the kernel or is pushed to it (eviction, collection):
# expiry would only send lookups of unchanged names to the daemon. A cluster node's kernel
# also holds attributes of files other nodes may rewrite: those expire within a minute.
ENTRY_TIMEOUT_S = {"mount": 3600.0, "node": 60.0}


def seconds(text: str) -> float:
    """A duration option: a finite number of seconds, 0 or more. NaN or infinity would turn
    a bound into none (or fail later, inside the daemon), a negative one into no wait at all."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def positive_seconds(text: str) -> float:
    """The period of a loop: above 0 (at 0 it would run without pause)."""
    value = seconds(text)
    if value == 0:
        raise ValueError(f"{text!r} is not a period in seconds (above 0)")
    return value


def _add_store_options(command: argparse.ArgumentParser, entry_timeout_s: float = ENTRY_TIMEOUT_S["mount"]) -> None:
    """Options of a node's store and mount, shared by `mount` and `node`."""
    command.add_argument("--dram", default=None,
                         help=f"DRAM tier size, e.g. 8G (default: a quarter of memory, here {format_size(default_dram_bytes())})")
    command.add_argument("-f", "--foreground", action="store_true", help="stay in the foreground (for systemd)")
    command.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    command.add_argument("--log-file", default=None,
                         help="where a background daemon logs (default: /var/log/kvfs/<mountpoint>.log)")
    command.add_argument("--eviction-policy", default=DEFAULT_POLICY, choices=sorted(POLICIES))
    command.add_argument("--entry-timeout", type=seconds, default=entry_timeout_s,
                         help="seconds the kernel caches names and attributes")
    command.add_argument("--negative-timeout", type=seconds, default=1.0, help="seconds the kernel caches absent names")
    command.add_argument("--temp-grace", type=seconds, default=300.0,
                         help="seconds before an abandoned *.tmp file is collected")
    command.add_argument("--unsealed-per-user", default=None,
                         help="bytes of files open for writing one user (not root) may hold; a write past it "
                              "gets EDQUOT (default: half the DRAM tier; 0: no cap)")
    command.add_argument("--publish-grace", type=seconds, default=30.0,
                         help="seconds after close during which a new file not yet renamed or read is evicted last")
    command.add_argument("--gc-interval", type=positive_seconds, default=30.0, help="seconds between orphan collections")
    command.add_argument("--no-allow-other", dest="allow_other", action="store_false",
                         help="only the mounting user may access the mount")
    command.add_argument("--nonempty", action="store_true",
                         help="mount over a mount point that is not empty (its entries are hidden)")
    command.add_argument("--start-timeout", type=seconds, default=120.0,
                         help="seconds a background start may take (reaching the master included) before "
                              "the daemon is stopped (default 120)")
    ssd = command.add_argument_group("SSD tier (off unless --disk is given)")
    ssd.add_argument("--disk", default=None, help="directory on the NVMe for the SSD tier (segment files, index)")
    ssd.add_argument("--disk-size", default=None,
                     help="SSD tier size, preallocated (default: half the free space of --disk's file system)")
    ssd.add_argument("--disk-fit", action="store_true",
                     help="take what fits when --disk-size is more than the free space (else refuse)")
    ssd.add_argument("--offload", default="eager", choices=["eager", "watermark"],
                     help="eager: copy every sealed file to SSD; watermark: only when DRAM use passes the high mark")
    ssd.add_argument("--high-watermark", type=float, default=0.9, help="fraction of DRAM that starts offloading")
    ssd.add_argument("--low-watermark", type=float, default=0.7, help="fraction of DRAM offloading brings DRAM-only data to")
    ssd.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=True,
                     help="O_DIRECT on the segment files (default on)")
    ssd.add_argument("--io-engine", default="auto", choices=["auto", "io_uring", "threads"],
                     help="SSD I/O through io_uring (auto: when the kernel allows it) or a thread pool")
    ssd.add_argument("--backpressure-timeout", type=seconds, default=30.0,
                     help="seconds a writer may wait for the offloader before ENOSPC")


def _add_metrics(command: argparse.ArgumentParser, default: str) -> None:
    command.add_argument("--metrics-listen", default=default,
                         help=f"HOST:PORT of the Prometheus endpoint, /metrics (default {default})")
    command.add_argument("--no-metrics", dest="metrics", action="store_false", help="no metrics endpoint")


def _add_common(command: argparse.ArgumentParser, tls: bool = True) -> None:
    command.add_argument("--config", default=None,
                         help="TOML file; the table named after this command sets defaults for its options")
    if tls:
        command.add_argument("--tls-dir", default=DEFAULT_TLS_DIR,
                             help=f"this machine's identity bundle: ca.crt, identity.crt, identity.key, from "
                                  f"`kvfs ca issue` (default {DEFAULT_TLS_DIR})")


def _add_status_source(command: argparse.ArgumentParser) -> None:
    command.add_argument("mountpoint", nargs="?", help="a single-node mount to ask (instead of --master)")
    command.add_argument("--master", default=None, help="the master's HOST:PORT, or etcd://HOST:PORT[,HOST:PORT][/CLUSTER] to ask the leader etcd names")


class CommandParser(argparse.ArgumentParser):
    """Usage errors as one line, like every other failure of the command."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"kvfs: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="kvfs", description="A POSIX filesystem for LLM KV-cache blocks.")
    parser.add_argument("--version", action="version", version=f"kvfs {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    mount = commands.add_parser("mount", help="mount a single-node kvfs (embedded master)")
    mount.add_argument("mountpoint")
    _add_store_options(mount, ENTRY_TIMEOUT_S["mount"])
    _add_metrics(mount, DEFAULT_NODE_METRICS)
    _add_common(mount, tls=False)

    node = commands.add_parser("node", help="run a cluster node: mount, contribute DRAM/SSD, serve peers")
    node.add_argument("--master", required=True,
                      help="the master's HOST:PORT, or etcd://HOST:PORT[,HOST:PORT][/CLUSTER]: the leader of the "
                           "masters of CLUSTER (default: default) elected in etcd, followed as it changes")
    node.add_argument("--mount", dest="mountpoint", required=True, help="where to mount the cluster's namespace")
    node.add_argument("--listen", default="127.0.0.1:0",
                      help="HOST:PORT of this node's peer server, for chunk reads by other nodes (default 127.0.0.1:0)")
    node.add_argument("--advertise", default=None, help="host other nodes reach this one at (default: the --listen host)")
    node.add_argument("--name", default=None,
                      help="stable node name, kept across restarts; must be its certificate's name "
                           "(default: the certificate's name)")
    node.add_argument("--master-wait", type=seconds, default=10.0,
                      help="seconds a request waits for an unreachable master before failing with EIO")
    node.add_argument("--transport", default="auto", choices=["auto", "tcp", "rdma"],
                      help="chunks between nodes: auto (RDMA READs where both nodes have RDMA, else TCP), "
                           "tcp, or rdma (refuse to start without it)")
    node.add_argument("--rdma-device", default=None,
                      help="the RDMA device to use, e.g. mlx5_0 (default: the first active port)")
    node.add_argument("--peer-encryption", default="on", choices=["on", "off"],
                      help="chunks between nodes encrypted and authenticated after an authenticated TLS setup "
                           "(on: kvfs's AES-256-GCM records), or, with peers that have it off too, in the clear "
                           "(off: a trusted, isolated network only)")
    _add_store_options(node, ENTRY_TIMEOUT_S["node"])
    _add_metrics(node, DEFAULT_NODE_METRICS)
    _add_common(node)

    master = commands.add_parser("master", help="run the metadata master")
    master.add_argument("--listen", default=DEFAULT_MASTER_LISTEN,
                        help=f"HOST:PORT to serve nodes on (default {DEFAULT_MASTER_LISTEN})")
    master.add_argument("--data", default=DEFAULT_MASTER_DATA,
                        help=f"directory for the master's state, lmdb (default {DEFAULT_MASTER_DATA})")
    master.add_argument("--eviction-policy", default=DEFAULT_POLICY, choices=sorted(POLICIES))
    master.add_argument("--temp-grace", type=seconds, default=300.0,
                        help="seconds before an abandoned *.tmp file is collected")
    master.add_argument("--publish-grace", type=seconds, default=30.0,
                        help="seconds after close during which a new file not yet renamed or read is evicted last")
    master.add_argument("--dead-after", type=seconds, default=2.5,
                        help="seconds without a heartbeat before a node is declared dead")
    master.add_argument("--forget-dead-after", type=seconds, default=7 * 86400.0,
                        help="seconds a node may stay dead before it is forgotten as by remove-node, its files "
                             "leaving the namespace (default 7 days; 0: never)")
    master.add_argument("--relocate-slice", type=int, default=1024,
                        help="entries a directory rename's walk looks at per step, between requests (the files "
                             "whose SSD records move; default 1024)")
    master.add_argument("--etcd", default=None,
                        help="etcd endpoints http://HOST:PORT[,HOST:PORT...]: masters elect a leader there and keep "
                             "the state there (--data is not used); the others stand by")
    master.add_argument("--cluster", default="default", help="with --etcd: the cluster's name in etcd (/kvfs/NAME/)")
    master.add_argument("--lease-ttl", type=int, default=3,
                        help="with --etcd: seconds a leader that stopped renewing its lease keeps it (default 3)")
    master.add_argument("--advertise", default=None,
                        help="with --etcd: HOST:PORT nodes reach this master at (default: the bound --listen)")
    master.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    _add_metrics(master, DEFAULT_MASTER_METRICS)
    _add_common(master)

    status = commands.add_parser("status", help="the cluster's nodes (or one mount's): state, capacity, use, hits")
    _add_status_source(status)
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _add_common(status)

    top = commands.add_parser("top", help="live rates per node (lookups, hits, reads, writes, evictions)")
    _add_status_source(top)
    top.add_argument("--interval", type=seconds, default=2.0, help="seconds between refreshes (default 2)")
    top.add_argument("--iterations", type=int, default=0, help="stop after this many refreshes (default: never)")
    _add_common(top)

    du = commands.add_parser("du", help="per top-level directory (per model): files, bytes by tier, "
                                        "hit rate, reads/s")
    du.add_argument("path", nargs="?", help="a kvfs mount, or a directory in it (instead of --master)")
    du.add_argument("--master", default=None, help="the master's HOST:PORT, or etcd://HOST:PORT[,HOST:PORT][/CLUSTER] to ask the leader etcd names")
    du.add_argument("--interval", type=seconds, default=1.0,
                    help="seconds between the two samples that give the rates (0: no rates)")
    du.add_argument("--json", action="store_true", help="machine-readable output")
    _add_common(du)

    inspect = commands.add_parser("inspect", help="where a file's chunks live, checksums, version, use, leases")
    inspect.add_argument("path", help="a file in a kvfs mount")
    inspect.add_argument("--json", action="store_true", help="machine-readable output")

    remove = commands.add_parser("remove-node", help="forget a node that is down for good (its files go)")
    remove.add_argument("name", help="the node's name, as `kvfs status` shows it")
    remove.add_argument("--master", required=True, help="the master's HOST:PORT, or etcd://HOST:PORT[,HOST:PORT][/CLUSTER] to ask the leader etcd names")
    _add_common(remove)

    check = commands.add_parser("check", help="the preflight of mount/node/master as a table: memory, disk "
                                              "space, io_uring, FUSE, ports, credentials, the mount point")
    check.add_argument("mountpoint", nargs="?", help="where kvfs would be mounted")
    check.add_argument("--master", default=None, help="a node's master HOST:PORT (checks that it answers)")
    check.add_argument("--listen", default=None, help="a node's or the master's HOST:PORT to serve on")
    _add_store_options(check)
    _add_metrics(check, DEFAULT_NODE_METRICS)
    _add_common(check)

    completion = commands.add_parser("completion", help="print the shell completion script (install.sh "
                                                        "installs it)")
    completion.add_argument("shell", choices=["bash"])

    fsck = commands.add_parser("fsck", help="check an SSD tier offline (index against segments), or repair it")
    fsck.add_argument("--disk", required=True, help="the SSD tier's directory (not in use by a mount)")
    fsck.add_argument("--repair", action="store_true", help="rebuild or fix the index, keeping every intact file")

    ca = commands.add_parser("ca", help="the cluster's certificate authority: create it, issue identities")
    ca_commands = ca.add_subparsers(dest="ca_command", required=True)
    ca_init = ca_commands.add_parser("init", help="create the CA's key and certificate")
    ca_init.add_argument("--dir", default=DEFAULT_CA_DIR, help=f"where to keep them (default {DEFAULT_CA_DIR})")
    ca_init.add_argument("--force", action="store_true", help="replace an existing CA (every identity must be "
                                                             "issued again)")
    ca_issue = ca_commands.add_parser("issue", help="issue an identity's bundle (identity.crt, identity.key, "
                                                    "ca.crt) for --tls-dir")
    ca_issue.add_argument("name", help="the identity: a node's --name, 'master', or an operator's name")
    ca_issue.add_argument("--role", required=True, choices=["master", "node", "admin", "client"],
                          help="what it may do: serve metadata, be that node, change the cluster, read status")
    ca_issue.add_argument("--address", action="append", default=[],
                          help="an IP address a node may advertise (repeat for several)")
    ca_issue.add_argument("--out", required=True, help="the bundle's directory (copy it to the machine's "
                                                       "/etc/kvfs/tls)")
    ca_issue.add_argument("--ca-dir", default=DEFAULT_CA_DIR, help=f"the CA's directory (default {DEFAULT_CA_DIR})")
    ca_issue.add_argument("--force", action="store_true", help="replace an existing bundle")

    umount = commands.add_parser("umount", help="unmount a kvfs mount")
    umount.add_argument("mountpoint")
    umount.add_argument("--lazy", action="store_true", help="detach now even if busy")
    return parser


def _tls(args: argparse.Namespace, *roles: str):  # type: ignore[no-untyped-def]
    """This process's identity bundle from --tls-dir, which must be of one of ROLES."""
    from kvfs.security.credentials import Tls

    tls = Tls.load(os.path.abspath(args.tls_dir), roles[0])
    tls.require_role(*roles)
    return tls


def _node_tls(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """A node's bundle; its name is the node's name (--name, if given, must be the same)."""
    tls = _tls(args, "node")
    if args.name and args.name != tls.identity.name:
        raise ConfigError(f"--name {args.name!r}: the certificate in {tls.directory} is for node "
                          f"{tls.identity.name!r} (issue one for this name: `kvfs ca issue {args.name} --role node "
                          f"--address IP`)")
    return tls


def _disk_bytes(args: argparse.Namespace) -> int:
    if not args.disk:
        return 0
    size = parse_size(str(args.disk_size), "--disk-size") if args.disk_size else default_disk_bytes(args.disk)
    return preflight.fitted_disk_bytes(args.disk, size) if args.disk_fit else size


def _mount_config(args: argparse.Namespace, **cluster) -> MountConfig:
    return MountConfig(
        mountpoint=os.path.abspath(args.mountpoint),
        dram_bytes=parse_size(str(args.dram), "--dram") if args.dram else default_dram_bytes(),
        eviction_policy=args.eviction_policy,
        entry_timeout_s=args.entry_timeout,
        negative_timeout_s=args.negative_timeout,
        temp_grace_s=args.temp_grace,
        unsealed_per_user=(parse_size(str(args.unsealed_per_user), "--unsealed-per-user")
                           if args.unsealed_per_user is not None else None),
        publish_grace_s=args.publish_grace,
        gc_interval_s=args.gc_interval,
        allow_other=args.allow_other,
        disk_path=os.path.abspath(args.disk) if args.disk else None,
        disk_bytes=_disk_bytes(args),
        offload=args.offload,
        high_watermark=args.high_watermark,
        low_watermark=args.low_watermark,
        direct_io=args.direct_io,
        io_engine=args.io_engine,
        backpressure_timeout_s=args.backpressure_timeout,
        metrics_listen=args.metrics_listen if args.metrics else None,
        **cluster,
    )


def _store_checks(config: MountConfig, nonempty: bool) -> list[preflight.Check]:
    """The preflight of a mount or node, before anything is allocated."""
    checks = [preflight.check_memory(config.dram_bytes), preflight.check_fuse(),
              preflight.check_mountpoint(config.mountpoint, nonempty)]
    if config.disk_path is not None:
        checks.append(preflight.check_disk(config.disk_path, config.disk_bytes))
        if config.io_engine == "io_uring":  # auto: the daemon's own probe falls back to threads
            checks.append(preflight.check_io_uring(config.io_engine, config.disk_path))
    if config.metrics_listen is not None:
        checks.append(preflight.check_port(config.metrics_listen, "metrics-listen"))
    if config.master is not None:
        checks.append(preflight.check_port(config.listen, "listen"))
    return checks


def _start(config: MountConfig, args: argparse.Namespace) -> int:
    preflight.refuse_on_failure(_store_checks(config, args.nonempty))
    from kvfs.daemons.node import mount  # after the checks: a refusal need not load the daemon (1.7 s)
    log_file = None if args.foreground else (args.log_file or default_log_file(config.mountpoint))
    code = mount(config, args.foreground, log_file, args.start_timeout)
    if code == 0 and not args.foreground:
        print(f"kvfs mounted on {config.mountpoint} ({format_size(config.dram_bytes)} DRAM); log: {log_file}")
    return code


def run_mount(args: argparse.Namespace) -> int:
    return _start(_mount_config(args), args)


def run_node(args: argparse.Namespace) -> int:
    tls = _node_tls(args)
    config = _mount_config(args, master=args.master, listen=args.listen, advertise=args.advertise,
                           node_name=tls.identity.name, tls=tls, master_wait_s=args.master_wait,
                           transport=args.transport, rdma_device=args.rdma_device,
                           peer_encryption=args.peer_encryption == "on")
    return _start(config, args)


def run_master(args: argparse.Namespace) -> int:
    import trio

    from kvfs.daemons.master import MasterConfig, MasterProcess

    check_address(args.listen, "listen")
    etcd = None
    if args.etcd:
        from kvfs.net.etcd import parse_endpoints

        try:
            etcd = parse_endpoints(args.etcd)
        except ValueError as error:
            raise ConfigError(f"--etcd: {error}") from None
        if args.lease_ttl < 2:
            raise ConfigError(f"--lease-ttl {args.lease_ttl}: at least 2 s (renewed every sixth of it)")
        if args.advertise:
            check_address(args.advertise, "advertise")
        elif args.listen.rpartition(":")[0] in ("0.0.0.0", "::", "[::]"):
            raise ConfigError(f"--listen {args.listen} with --etcd: give --advertise HOST:PORT, the address the "
                              f"leader key tells nodes (all addresses is none of them)")
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", args.cluster):
            raise ConfigError(f"--cluster {args.cluster!r}: letters, digits, '.', '_' and '-' only")
    checks = [preflight.check_port(args.listen, "listen")]
    if args.metrics:
        check_address(args.metrics_listen, "metrics_listen")
        checks.append(preflight.check_port(args.metrics_listen, "metrics-listen"))
    preflight.refuse_on_failure(checks)
    config = MasterConfig(args.listen, os.path.abspath(args.data), _tls(args, "master"), args.eviction_policy,
                          temp_grace_s=args.temp_grace, publish_grace_s=args.publish_grace,
                          dead_after_s=args.dead_after, forget_dead_after_s=args.forget_dead_after,
                          relocate_slice=max(1, args.relocate_slice),
                          metrics_listen=args.metrics_listen if args.metrics else None, etcd=etcd,
                          cluster=args.cluster, lease_ttl_s=args.lease_ttl, advertise=args.advertise)
    if etcd is not None:
        from kvfs.daemons.leader import ElectedMaster

        trio.run(ElectedMaster(config).run)
        return 0
    trio.run(MasterProcess(config).run)
    return 0


def ask_master(args: argparse.Namespace, request):  # type: ignore[no-untyped-def]
    """One request to the master named by --master, as the client or admin of --tls-dir."""
    import ssl

    import trio

    from kvfs.net.rpc import RemoteMaster
    from kvfs.config import parse_master, split_address
    from kvfs.net.etcd import EtcdError

    target = parse_master(args.master, "--master")
    tls = _tls(args, "admin", "client")

    async def call():  # type: ignore[no-untyped-def]
        async with trio.open_nursery() as nursery:
            with trio.fail_after(10):
                host, port = split_address(target.address or await _etcd_leader(target))
                master = await RemoteMaster.connect(host, port, tls, nursery)
                try:
                    return await master.call(request)
                finally:
                    await master.aclose()

    from kvfs.wire.auth import AuthError
    from kvfs.wire.protocol import ProtocolError
    from kvfs.concurrency import single_error

    refused = (AuthError, ProtocolError, ssl.SSLError, EOFError, trio.BrokenResourceError)
    try:
        return trio.run(call)
    except BaseExceptionGroup as group:
        error = single_error(group, (KvfsError, OSError, trio.TooSlowError, EtcdError) + refused)
        if error is None:
            raise
    except (KvfsError, OSError, trio.TooSlowError, EtcdError) + refused as raised:
        error = raised
    if isinstance(error, EtcdError):  # etcd unreachable, or no master leads now
        raise CommandError(errno.EHOSTUNREACH, f"master {args.master}: {error}")
    if isinstance(error, trio.TooSlowError):
        raise CommandError(errno.ETIMEDOUT, f"master {args.master}: no answer within 10 s")
    if isinstance(error, (EOFError, trio.BrokenResourceError)) and not isinstance(error.__cause__, ssl.SSLError):
        raise CommandError(errno.ECONNRESET, f"master {args.master} closed the connection before admitting this "
                                             f"client (a master standing by does so: name etcd://... to reach the "
                                             f"leader): {error or type(error).__name__}")
    if isinstance(error, refused):
        raise CommandError(errno.EACCES, f"master {args.master} refused this client ({tls.identity} of "
                                         f"{tls.directory}; is it issued by the master's CA?): "
                                         f"{error or type(error).__name__}")
    if isinstance(error, OSError):
        raise CommandError(error.errno or errno.EIO, f"master {args.master}: {reason_of(error)}")
    raise error


async def _etcd_leader(target) -> str:  # type: ignore[no-untyped-def]
    """HOST:PORT of the leader etcd names for `target` (a MasterTarget with etcd members)."""
    from kvfs.net.etcd import EtcdClient, EtcdError, find_leader, parse_endpoints

    etcd = EtcdClient(parse_endpoints(target.etcd_url), timeout_s=2.0)
    try:
        found = await find_leader(etcd, target.cluster)
    finally:
        await etcd.aclose()
    if found is None:
        raise EtcdError(f"no master leads cluster {target.cluster!r} now (etcd {target.etcd_url}); retry shortly")
    return found[0]


def _check_master(master: str) -> preflight.Check:
    """`check --master`: whether the master's port answers; with etcd://, the leader's that etcd names."""
    import trio

    from kvfs.config import parse_master
    from kvfs.net.etcd import EtcdError

    if not master.startswith("etcd://"):
        return preflight.check_master(master)  # (a malformed address fails there, as a check)
    try:
        leader = trio.run(_etcd_leader, parse_master(master, "--master"))
    except (ConfigError, EtcdError) as error:
        return preflight.Check("master", preflight.FAIL, f"{master}: {error}")
    return preflight.check_master(leader)


def run_remove_node(args: argparse.Namespace) -> int:
    removed = ask_master(args, m.RemoveNode(args.name))
    files = removed.files or len(removed.entries)  # (a master before Removed.files lists them all)
    print(f"removed node {args.name}: {files} files, {format_size(removed.freed_bytes)}")
    return 0


def _cluster_info(args: argparse.Namespace) -> tuple[str, m.ClusterInfo]:
    """The cluster's state from --master, or a single-node mount's from its stats attribute."""
    from kvfs.status import info_from_mount_stats

    if args.master:
        return f"master {args.master}", ask_master(args, m.ClusterStatus())
    if not args.mountpoint:
        raise ConfigError("name a mount (kvfs status /mnt/kvfs) or the master (--master HOST:PORT)")
    mountpoint = kvfs_mount_root(args.mountpoint)
    try:
        stats = json.loads(os.getxattr(mountpoint, "user.kvfs.stats"))
    except OSError as error:
        raise KvfsError(error.errno or errno.EIO, f"{mountpoint}: cannot read its statistics") from None
    return f"mount {mountpoint}", info_from_mount_stats(mountpoint, stats)


def kvfs_mount_root(path: str) -> str:
    """The root of the kvfs mount that holds `path`; a clear error for a stale mount or none."""
    from kvfs.fuse.mount import mount_holding

    path = os.path.abspath(path)
    info = mount_holding(path)
    if info is None or info.fstype != "fuse.kvfs":
        where = f"it is on {info.fstype} at {info.mountpoint}" if info is not None else "no mount holds it"
        raise CommandError(errno.EINVAL, f"{path} is not in a kvfs mount ({where})")
    try:
        os.statvfs(info.mountpoint)
    except OSError as error:
        if error.errno == errno.ENOTCONN:
            raise CommandError(errno.ENOTCONN, f"{info.mountpoint} is a stale kvfs mount: its daemon died (mount "
                                               f"it again to clean it up, or 'kvfs umount {info.mountpoint}')") from None
        raise CommandError(error.errno or errno.EIO, f"{info.mountpoint}: {error.strerror}") from None
    return info.mountpoint


def run_status(args: argparse.Namespace) -> int:
    import msgspec

    from kvfs.status import render_status

    source, info = _cluster_info(args)
    print(json.dumps(msgspec.to_builtins(info), indent=2) if args.json else render_status(source, info))
    return 0


def run_top(args: argparse.Namespace) -> int:
    from kvfs.status import Sample, render_top

    if args.interval <= 0:
        raise ConfigError("interval: must be positive")
    interactive = sys.stdout.isatty()
    previous = Sample(time.monotonic(), _cluster_info(args)[1])
    shown = 0
    try:
        while not args.iterations or shown < args.iterations:
            time.sleep(args.interval)
            source, info = _cluster_info(args)
            current = Sample(time.monotonic(), info)
            screen = render_top(source, previous, current)
            print(("\x1b[H\x1b[2J" if interactive else "") + screen, flush=True)  # clear, as top(1) does
            previous, shown = current, shown + 1
    except KeyboardInterrupt:
        pass
    return 0


def _dir_usage(args: argparse.Namespace, files: bool) -> tuple[str, str | None, m.DirUsageInfo]:
    """(source, the top-level directory PATH is in or None, the usage) from --master or a mount."""
    import msgspec

    from kvfs.node.xattrs import ROOT_USAGE, ROOT_USAGE_COUNTERS

    if args.master:
        return f"master {args.master}", None, ask_master(args, m.DirUsage(files=files))
    if not args.path:
        raise ConfigError("name a mount (kvfs du /mnt/kvfs) or the master (--master HOST:PORT)")
    root = kvfs_mount_root(args.path)
    inside = os.path.relpath(os.path.abspath(args.path), root)
    top = None if inside == "." else inside.split(os.sep)[0]
    name = (ROOT_USAGE if files else ROOT_USAGE_COUNTERS).decode()
    try:
        raw = os.getxattr(root, name)
    except OSError as error:
        raise KvfsError(error.errno or errno.EIO, f"{root}: cannot read {name}") from None
    return f"mount {root}", top, msgspec.json.decode(raw, type=m.DirUsageInfo)


def run_du(args: argparse.Namespace) -> int:
    import msgspec

    from kvfs.du import render_du, select

    if args.interval < 0:
        raise ConfigError("interval: must not be negative")
    previous, started = None, time.monotonic()
    if args.interval > 0:
        previous = _dir_usage(args, files=False)[2]
        time.sleep(args.interval)
    source, top, current = _dir_usage(args, files=True)
    seconds = time.monotonic() - started
    current.dirs = select(current.dirs, top)
    if args.json:
        print(json.dumps(msgspec.to_builtins(current), indent=2))
    else:
        print(render_du(source, previous, current, seconds))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    from kvfs.inspect import file_facts, render_facts

    facts = file_facts(os.path.abspath(args.path))
    print(json.dumps(facts, indent=2, sort_keys=True) if args.json else render_facts(args.path, facts))
    return 0


def run_check(args: argparse.Namespace) -> int:
    checks: list[preflight.Check] = []
    try:
        dram = parse_size(str(args.dram), "--dram") if args.dram else default_dram_bytes()
        checks.append(preflight.check_memory(dram))
        checks.append(preflight.check_fuse())
        if args.mountpoint:
            checks.append(preflight.check_mountpoint(os.path.abspath(args.mountpoint), args.nonempty))
        if args.disk:
            size = _disk_bytes(args)
            checks += [preflight.check_disk(args.disk, size), preflight.check_io_uring(args.io_engine, args.disk)]
    except ConfigError as error:
        checks.append(preflight.Check("settings", preflight.FAIL, str(error)))
    if args.metrics:
        checks.append(preflight.check_port(args.metrics_listen, "metrics-listen"))
    if args.listen:
        checks.append(preflight.check_port(args.listen, "listen"))
    if args.master or os.path.exists(args.tls_dir):
        checks.append(preflight.check_credentials(args.tls_dir))
    if args.master:
        checks.append(_check_master(args.master))
    print(preflight.render(checks))
    return 1 if preflight.failures(checks) else 0


def run_completion(args: argparse.Namespace) -> int:
    from kvfs.completion import bash_completion

    print(bash_completion(build_parser()), end="")
    return 0


def run_fsck(args: argparse.Namespace) -> int:
    """0: clean or repaired; 2: problems found and left alone."""
    from pathlib import Path

    from kvfs.disk.fsck import fsck, render

    directory = Path(os.path.abspath(args.disk))
    report = fsck(directory, args.repair)
    print(render(directory, report))
    return 0 if report.clean or report.repaired else 2


def run_umount(args: argparse.Namespace) -> int:
    from kvfs.fuse.mount import find_mount, unmount

    mountpoint = os.path.abspath(args.mountpoint)
    info = find_mount(mountpoint)
    if info is None or not info.fstype.startswith("fuse"):
        raise CommandError(errno.EINVAL, f"{mountpoint} is not a kvfs mount")
    unmount(mountpoint, lazy=args.lazy)
    deadline = time.monotonic() + 10
    while find_mount(mountpoint) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


def run_ca(args: argparse.Namespace) -> int:
    from kvfs.security import ca

    if args.ca_command == "init":
        issued = ca.init_ca(Path(os.path.abspath(args.dir)), overwrite=args.force)
        print(f"kvfs: CA created: {issued.cert} (give it to every machine), {issued.key} (keep it here, mode 0600)")
        return 0
    issued = ca.issue(Path(os.path.abspath(args.ca_dir)), args.name, args.role, Path(os.path.abspath(args.out)),
                      args.address, overwrite=args.force)
    print(f"kvfs: issued {args.role} {args.name!r}: {issued.cert.parent}/ (ca.crt, identity.crt, identity.key); "
          f"install it as the machine's --tls-dir (default /etc/kvfs/tls)")
    return 0


COMMANDS = {"mount": run_mount, "node": run_node, "master": run_master, "status": run_status, "top": run_top,
            "du": run_du, "inspect": run_inspect, "remove-node": run_remove_node, "check": run_check,
            "fsck": run_fsck, "completion": run_completion, "umount": run_umount, "ca": run_ca}


def fail(message: str) -> int:
    """Every failure of the command: one line on stderr (with its priority for journald), a
    non-zero exit."""
    print(f"{'<3>' if stderr_is_journal() else ''}kvfs: error: {message}", file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    init_logging("info")
    argv = sys.argv[1:] if argv is None else argv
    command = next((arg for arg in argv if not arg.startswith("-")), "kvfs")
    try:
        if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:  # called by mount.fuse3?
            argv = mount_helper_argv(argv) or argv
        args = parse_with_sources(parser, argv)
        command = args.command
        init_logging(getattr(args, "log_level", "info"))
        return COMMANDS[args.command](args)
    except KvfsError as error:
        return fail(str(error))
    except BrokenPipeError:  # `kvfs du | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as error:
        where = error.filename or command
        return fail(f"{where}: {error.strerror or error}")
    except KeyboardInterrupt:
        return fail(f"{command}: interrupted") + 129  # 130, as a shell reports SIGINT
    except Exception as error:  # a bug: still one line; the traceback with --log-level debug
        log.debug("%s failed", command, exc_info=True)
        return fail(f"{command}: {type(error).__name__}: {error}")
