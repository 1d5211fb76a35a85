"""A node's daemon (`kvfs mount`, `kvfs node`): its parts built and run, its start in the
background with readiness told to the starting command, its shutdown."""

from __future__ import annotations

import errno
import faulthandler
import logging
import os
import signal
import socket
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, NoReturn

import lmdb
import pyfuse3
import trio

from kvfs import progress, systemd
from kvfs.clock import SystemClock
from kvfs.cluster.embedded import EmbeddedMaster
from kvfs.net.link import MasterLink
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.net.rdma import RdmaExporter, RdmaTransport, open_rdma
from kvfs.net.transport import PeerServer, TcpTransport
from kvfs.net.verbs import RdmaDevice
from kvfs.concurrency import single_error
from kvfs.config import MountConfig, format_size, split_address, unsealed_cap
from kvfs.errors import CommandError, KvfsError
from kvfs.fuse.mount import find_mount, prepare_mountpoint, tune_connection
from kvfs.fuse.operations import KvfsOperations
from kvfs.metrics.exporter import serve_metrics
from kvfs.metrics.node import NodeMetrics
from kvfs.node.service import Node
from kvfs.node.dirrecords import DirectoryRecords, restore_directories
from kvfs.node.membership import HEARTBEAT_S
from kvfs.policy import make_policy
from kvfs.disk.engine import AlignedIo
from kvfs.disk.index import DiskIndex
from kvfs.disk.probe import open_engine
from kvfs.disk.tier import SsdTier
from kvfs.store.buffers import ReadBufferPool
from kvfs.store.dram import DramTier
from kvfs.store.tiered import TieredStore, TierSettings

log = logging.getLogger("kvfs.mount")

SHUTDOWN_FLUSH_S = 120
STOP_GRACE_S = 10
READ_BUFFERS = 64  # chunk buffers for reads served from SSD (256 MiB): 16 readers of 16 MiB files


class Daemon:
    """One mounted kvfs file system and its background tasks."""

    def __init__(self, config: MountConfig) -> None:
        self.config = config
        clock = SystemClock()
        settings = MasterSettings(temp_suffix=config.temp_suffix.encode(), temp_grace_s=config.temp_grace_s,
                                  publish_grace_s=config.publish_grace_s, root_uid=os.getuid(), root_gid=os.getgid())
        self.service = MetadataService(clock, make_policy(config.eviction_policy), settings)
        self.dram = DramTier(config.dram_bytes)
        self._stop_faulting = threading.Event()
        self._faulting = threading.Thread(target=self._fault_in_dram, name="kvfs-fault-in", daemon=True)
        self.engine: AlignedIo | None = None
        ssd = None
        read_buffers = None
        if config.disk_path is not None:
            read_buffers = ReadBufferPool(READ_BUFFERS, self.dram.chunk_size)
            disk_path = Path(config.disk_path)
            disk_path.mkdir(parents=True, exist_ok=True)
            self.engine = open_engine(config.io_engine, disk_path)
            ssd = SsdTier(disk_path, config.disk_bytes, self.engine, self.dram.chunk_size, config.direct_io)
            log.info("SSD tier: %s in %s (%s I/O, %s offload)", format_size(ssd.capacity), config.disk_path,
                     self.engine.kind, config.offload)
        tier_settings = TierSettings(config.offload, config.high_watermark, config.low_watermark,
                                     config.backpressure_timeout_s, config.eviction_policy)
        if config.master is not None and read_buffers is None:  # remote reads land in read buffers
            read_buffers = ReadBufferPool(READ_BUFFERS, self.dram.chunk_size)
        self.store = TieredStore(self.dram, ssd, tier_settings, read_buffers)
        transport: TcpTransport | RdmaTransport | None = None
        self.rdma: RdmaDevice | None = None
        if config.master is not None:
            assert read_buffers is not None
            transport = TcpTransport(config.tls, plaintext=not config.peer_encryption)
            self.rdma = open_rdma(config.transport, config.rdma_device)
            if self.rdma is not None:
                transport = RdmaTransport(self.rdma, config.tls, transport, read_buffers)
        self.node = Node(EmbeddedMaster(self.service), self.store, clock, forget_entries=self._forget_entries,
                         transport=transport,
                         invalidate_attrs=self._invalidate_attrs if config.master is not None else None,
                         unsealed_per_user=unsealed_cap(config), temp_suffix=settings.temp_suffix,
                         temp_grace_s=config.temp_grace_s)
        self.operations = KvfsOperations(self.node, config)
        self.link: MasterLink | None = None
        self.peer_server: PeerServer | None = None
        self._mounted = False
        self.unsaved = (0, 0)  # files (and bytes) a clean stop could not copy to SSD
        self.directories: DirectoryRecords | None = None  # a single-node mount's, with an SSD tier

    def _forget_entries(self, entries: list[tuple[int, bytes, int]]) -> None:
        # Names removed by eviction, collection or another node, not by this kernel: drop
        # its cached dentries, from pyfuse3's invalidation thread (never inside a handler).
        # Only for inodes it references: a cluster node hears of every name removed
        # anywhere (each published temp file), and its kernel never saw most of them.
        for parent, name, ino in entries:
            if self.operations.lookups.known(ino):
                pyfuse3.invalidate_entry_async(parent, name, ignore_enoent=True)

    @staticmethod
    async def _invalidate_attrs(ino: int) -> None:
        # From a thread: the notification is a write to /dev/fuse that must not block the loop.
        await trio.to_thread.run_sync(lambda: pyfuse3.invalidate_inode(ino, attr_only=True))

    def _fault_in_dram(self) -> None:
        """Faults the DRAM tier in behind a mount that already serves, telling how far it got."""
        capacity = format_size(self.dram.capacity)
        pace = progress.Every(2.0)

        def tell(done: int, total: int) -> None:
            if done < total and pace.due():
                progress.report(f"faulting in the DRAM tier: {format_size(done)} of {capacity} "
                                f"({100 * done // total}%)", log)
        try:
            seconds = self.dram.arena.populate(self._stop_faulting, tell)
        except KvfsError as error:
            log.error("%s; its pages fault in on first use", error)
            return
        if seconds is not None:
            log.info("faulted in the %s DRAM tier in %.1f s", capacity, seconds)
            if self._mounted:
                systemd.notify(f"STATUS=serving {self.config.mountpoint}")

    def run(self, on_ready: Callable[[], None] = lambda: None) -> int:
        """Serves until stopped; the exit status: 1 if a clean stop lost files (named in the log)."""
        prepare_mountpoint(self.config.mountpoint)
        self._faulting.start()
        try:
            trio.run(self._main, on_ready)
        except BaseExceptionGroup as group:  # a task's failure to start, wrapped by its nursery
            error = single_error(group, (KvfsError, OSError, KeyboardInterrupt))
            if error is None:
                raise
            raise error from None
        finally:
            self._stop_faulting.set()
            self._faulting.join()
            if self._mounted:
                pyfuse3.close(unmount=True)
                log.info("unmounted %s", self.config.mountpoint)
            if self.store.ssd is not None:
                self.store.ssd.close()
            if self.engine is not None:
                self.engine.close()
            if self.rdma is not None:
                self.rdma.close()
        return 1 if self.unsaved[0] else 0

    def _mount(self) -> None:
        mountpoint = self.config.mountpoint
        options = set(pyfuse3.default_options) | {"fsname=kvfs", "subtype=kvfs", "noatime"}
        if self.config.allow_other and os.getuid() == 0:
            options.add("allow_other")
        try:
            pyfuse3.init(self.operations, mountpoint, options)
        except RuntimeError as error:  # libfuse refused the mount; its reason is on stderr
            raise KvfsError(errno.EIO, f"cannot mount {mountpoint}: {error}") from None
        self._mounted = True
        log.info("mounted kvfs on %s: DRAM tier %s, eviction %s", mountpoint,
                 format_size(self.dram.capacity), self.config.eviction_policy)

    async def _main(self, on_ready: Callable[[], None]) -> None:
        async with trio.open_nursery() as nursery:
            if self.engine is not None:
                await nursery.start(self.engine.run)
            nursery.start_soon(self.store.run)
            if self.config.master is not None:
                await self._join_cluster(nursery)
            elif self.store.ssd is not None:
                await self.node.recover(self.config.temp_suffix.encode())
                self._restore_directories(self.store.ssd.index)
            if self.config.metrics_listen is not None:
                await nursery.start(serve_metrics, self.config.metrics_listen, self._metrics().describe)
            self._mount()
            await self._serve(on_ready)
            nursery.cancel_scope.cancel()

    def _restore_directories(self, index: DiskIndex) -> None:
        """Brings back the directories' records, then saves each change of one from now on."""
        try:
            restore_directories(self.service, index)
        except lmdb.Error as error:  # a garbled table: the files are back, their directories root's
            log.warning("cannot read the directory records in %s (%s); directories come back root's with mode "
                        "0755", index.env.path(), error)
        master = self.node.master
        assert isinstance(master, EmbeddedMaster)
        master.directories = self.directories = DirectoryRecords(index, self.service.ns)
        self.directories.save_all_now()

    def _metrics(self) -> NodeMetrics:
        if self.config.master is None:
            return NodeMetrics(self.node, self.operations.operation_stats, embedded=self.service)
        return NodeMetrics(self.node, self.operations.operation_stats, peer_server=self.peer_server,
                           name=self._node_name())

    def _node_name(self) -> str:
        return self.config.node_name or f"{socket.gethostname()}:{self.config.mountpoint}"

    async def _join_cluster(self, nursery: trio.Nursery) -> None:
        """Starts the peer server, then registers with the master (reporting the SSD's files)."""
        config = self.config
        host, port = split_address(config.listen)
        exporter = None
        if self.rdma is not None:
            exporter = RdmaExporter(self.rdma, self.store)
            nursery.start_soon(self.rdma.run_completions)
            nursery.start_soon(exporter.expire_leases)
        self.peer_server = PeerServer(self.store, config.tls, exporter, plaintext=not config.peer_encryption)
        if not config.peer_encryption:
            log.warning("peer encryption is off: chunks to and from nodes that have it off too cross the network "
                        "in the clear, after an authenticated TLS setup (checksums detect corruption, not "
                        "forgery; for a trusted, isolated network only)")
        bound = await nursery.start(self.peer_server.serve, host, port)
        advertised = config.advertise or (host if host not in ("0.0.0.0", "::", "") else socket.gethostname())
        address = f"{advertised}:{bound}"
        name = self._node_name()
        self.node.membership.adopt_disk()
        self.link = MasterLink(config.master, config.tls, lambda remote: self.node.membership.join(remote, name, address),
                               config.master_wait_s, on_notify=self.node.membership.names_changed)
        self.node.use_master(self.link)
        log.info("peer server on %s; joining master %s as %r", address, config.master, name)
        await nursery.start(self.link.run)
        nursery.start_soon(self._heartbeats)
        nursery.start_soon(self.node.membership.acknowledge_forever)
        nursery.start_soon(self.node.membership.record_moves.run, self.store.refresh_records)

    async def _heartbeats(self) -> None:
        assert self.link is not None
        while True:
            await trio.sleep(HEARTBEAT_S)
            try:
                if not await self.node.membership.heartbeat():
                    await self.link.reconnect()
            except Exception:
                log.exception("heartbeat failed")

    async def _serve(self, on_ready: Callable[[], None]) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_on_signal)
            nursery.start_soon(self.operations.run_forgetter)
            nursery.start_soon(self._collect_orphans)
            nursery.start_soon(systemd.keep_watchdog_fed)
            if self.directories is not None:
                nursery.start_soon(self.directories.run)
            nursery.start_soon(trio.to_thread.run_sync, self._confirm_mounted, on_ready, trio.lowlevel.current_trio_token())
            await pyfuse3.main(max_tasks=self.config.max_tasks)
            systemd.notify("STOPPING=1")
            await self._flush_to_disk()
            nursery.cancel_scope.cancel()

    async def _flush_to_disk(self) -> None:
        """On a clean stop, copies what is only in DRAM to SSD so that a restart finds it
        (failed copies are tried once more), and names what it could not copy."""
        store = self.store
        if store.ssd is None:
            return
        if self.directories is not None:  # the mkdirs not saved yet
            await self.directories.save()
        store.retry_now()
        pending = store.queue_all_dram_only()
        if pending:
            log.info("stopping: copying %d files still only in DRAM to %s", pending, store.ssd.directory)
            systemd.notify(f"STATUS=stopping: copying {pending} files to SSD")
        with trio.move_on_after(SHUTDOWN_FLUSH_S) as scope:
            await store.wait_offloaded()
            await store.flush_removals_now()  # quarantined and deleted files must not come back
        files, nbytes = self.unsaved = store.unsaved()
        if not files:
            return
        why = (f"the copy did not finish within {SHUTDOWN_FLUSH_S} s" if scope.cancelled_caught
               else store.faults.last_error() or "the SSD tier is full")
        log.error("stopping: %d files (%s) could not be copied to %s and are lost: %s", files, format_size(nbytes),
                  store.ssd.directory, why)
        systemd.notify(f"STATUS=stopped: {files} files ({format_size(nbytes)}) could not be copied to SSD")

    async def _stop_on_signal(self) -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                log.info("received %s, unmounting", signal.Signals(signum).name)
                break
        systemd.notify(f"STOPPING=1\nSTATUS=unmounting {self.config.mountpoint}")
        # Detach the mount and keep serving until the kernel has released every open
        # file: a RELEASE still queued for a file closed just before the signal seals
        # that file, which a plain stop would lose. Open files bound the wait.
        await trio.to_thread.run_sync(lambda: subprocess.run(
            ["fusermount3", "-u", "-z", self.config.mountpoint], capture_output=True))
        await trio.sleep(STOP_GRACE_S)
        log.warning("files were still open %d s after unmounting; stopping anyway", STOP_GRACE_S)
        pyfuse3.terminate()

    async def _collect_orphans(self) -> None:
        while True:
            await trio.sleep(self.config.gc_interval_s)
            try:
                await self.node.collect_orphans()
            except Exception:
                log.exception("collecting orphaned temp files failed")

    def _confirm_mounted(self, on_ready: Callable[[], None], token: trio.lowlevel.TrioToken) -> None:
        """Checks from another thread that the mount answers, then tunes it and reports ready."""
        mountpoint = self.config.mountpoint
        deadline = time.monotonic() + 30
        while True:
            try:
                if os.stat(mountpoint).st_ino == pyfuse3.ROOT_INODE and find_mount(mountpoint):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                log.error("%s did not come up within 30 s; stopping", mountpoint)
                trio.from_thread.run_sync(pyfuse3.terminate, trio_token=token)
                return
            time.sleep(0.01)
        tune_connection(mountpoint, self.config)
        log.info("%s is ready", mountpoint)
        on_ready()
        systemd.notify(f"READY=1\nSTATUS=serving {mountpoint}")


def mount(config: MountConfig, foreground: bool, log_file: str | None = None, start_timeout: float = 120.0) -> int:
    """Mounts kvfs; in the background unless `foreground`, returning once the mount is up.

    In the background the daemon's stderr (its log) goes to `log_file`, its start-up progress
    to this process's terminal, and a daemon that is not up within `start_timeout` seconds is
    stopped (a KvfsError says why).
    """
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` dumps the stacks of a hung daemon
    # SIGINT stops a start too (a node waiting for its master, recovering its SSD files), as it
    # stops a serving node. A shell's `&` starts its jobs with SIGINT ignored, and Python and
    # trio then leave it ignored: such a node would wait out its start deaf to SIGINT.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if foreground:
        return Daemon(config).run()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_end)
        try:
            _wait_until_up(pid, read_end, config.mountpoint, start_timeout)
        finally:
            os.close(read_end)
        return 0
    os.close(read_end)
    _run_daemon(config, write_end, log_file)


def _wait_until_up(pid: int, status_fd: int, mountpoint: str, timeout: float) -> None:
    """Follows the daemon's start through its status pipe: lines `status TEXT`, then `ready` or
    `error TEXT` (`warning TEXT` for what holds it up). Progress goes to a terminal only (a
    failure stays one line)."""
    deadline = time.monotonic() + timeout
    shown = sys.stderr.isatty()
    last, blocker, buffered = "", "", b""
    try:
        while True:
            ready, _, _ = select.select([status_fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                _stop_daemon(pid, mountpoint)
                why = blocker or last
                raise CommandError(errno.ETIMEDOUT, f"{mountpoint}: the daemon was not up within {timeout:.0f} s"
                                                   f"{f' ({why})' if why else ''}; stopped it (--start-timeout)")
            chunk = os.read(status_fd, 4096)
            if not chunk:
                _, code = os.waitpid(pid, 0)
                reason = (f"killed by {signal.Signals(-os.waitstatus_to_exitcode(code)).name}"
                          if os.WIFSIGNALED(code) else f"exit status {os.waitstatus_to_exitcode(code)}")
                raise CommandError(errno.EIO, f"{mountpoint}: the daemon exited before the mount came up ({reason}"
                                              f"{f'; last: {last}' if last else ''})")
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                kind, _, text = line.decode(errors="replace").partition(" ")
                if kind == "ready":
                    return
                if kind == "error":
                    os.waitpid(pid, 0)
                    raise CommandError(errno.EIO, text)
                if kind == "warning":
                    blocker = text
                last = text
                if shown:
                    print(f"kvfs: {text}", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        _stop_daemon(pid, mountpoint)
        raise CommandError(errno.EINTR, f"{mountpoint}: interrupted; stopped the daemon (pid {pid})") from None


def _stop_daemon(pid: int, mountpoint: str) -> None:
    """Stops a daemon that never came up, and any mount it left."""
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    if find_mount(mountpoint) is not None:
        subprocess.run(["fusermount3", "-u", "-z", mountpoint], capture_output=True)


def _run_daemon(config: MountConfig, status_fd: int, log_file: str | None) -> NoReturn:
    """The forked daemon: its own session, its log in `log_file`, its start told on `status_fd`."""
    os.setsid()
    with open(os.devnull, "rb") as devnull:
        os.dup2(devnull.fileno(), 0)
    if log_file:
        os.makedirs(os.path.dirname(os.path.abspath(log_file)), exist_ok=True)
        with open(log_file, "ab") as log_output:
            os.dup2(log_output.fileno(), 1)
            os.dup2(log_output.fileno(), 2)
    lock = threading.Lock()
    open_fd = [status_fd]

    def send(line: str) -> None:
        with lock:
            if open_fd:
                try:
                    os.write(open_fd[0], (line.replace("\n", " ") + "\n").encode())
                except OSError:  # the starting command is gone (interrupted)
                    pass
                if line.startswith(("ready", "error ")):
                    os.close(open_fd.pop())

    progress.listen(lambda text, level: send(f"{'warning' if level >= logging.WARNING else 'status'} {text}"))

    def ready() -> None:
        progress.stop_listening()
        send("ready")

    code = 1
    try:
        code = Daemon(config).run(ready)
    except (KvfsError, OSError) as error:
        log.error("%s", error)
        send(f"error {error}")
    except KeyboardInterrupt:  # `kill -INT` of the daemon itself (its own session: no terminal's ^C)
        log.info("interrupted (SIGINT); stopped")
        send(f"error {config.mountpoint}: the daemon was interrupted (SIGINT) before the mount came up")
    except BaseException as error:  # a bug: the command still hears why; the fork never returns
        log.exception("the daemon failed")
        send(f"error {type(error).__name__}: {error}")
    finally:
        os._exit(code)
