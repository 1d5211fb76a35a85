"""Fixtures that mount a real kvfs in a child process.

A mount fixture fails the test that made the daemon log an error or a traceback
it did not expect, and fails teardown if the daemon does not unmount cleanly.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvfs.fuse.mount import find_mount

UNEXPECTED = re.compile(r" (ERROR|CRITICAL) |Traceback")
# Daemons run side by side: each serves metrics on a port of its own (its log names it),
# and none reads a configuration file of the machine running the tests.
os.environ["KVFS_METRICS_LISTEN"] = "127.0.0.1:0"
os.environ["KVFS_CONFIG"] = os.devnull

# The test session's cluster CA (a temporary directory) and the bundles it issued, by
# (name, role, addresses): the master's, each node's (named after its --name, with its
# addresses) and an admin's, which every command of a test uses unless it says otherwise.
_TLS_ROOT = Path(tempfile.mkdtemp(prefix="kvfs-test-tls-"))
atexit.register(shutil.rmtree, _TLS_ROOT, True)
_bundles: dict[tuple[str, str, tuple[str, ...]], str] = {}


def session_ca() -> Path:
    """The session's CA directory (ca.crt, ca.key), created on first use."""
    from kvfs.security import ca

    directory = _TLS_ROOT / "ca"
    if not (directory / "ca.key").exists():
        ca.init_ca(directory)
    return directory


def tls_dir(name: str, role: str = "node", addresses: tuple[str, ...] = ("127.0.0.1",)) -> str:
    """A bundle of the session's CA for NAME in ROLE (a --tls-dir)."""
    from kvfs.security import ca

    key = (name, role, tuple(addresses) if role == "node" else ())
    if key not in _bundles:
        out = _TLS_ROOT / f"bundle-{len(_bundles)}"
        ca.issue(session_ca(), name, role, out, list(key[2]))
        _bundles[key] = str(out)
    return _bundles[key]


def load_tls(name: str, role: str = "node", addresses: tuple[str, ...] = ("127.0.0.1",)) -> Any:
    """The `Tls` of such a bundle, for servers and clients run inside the test process."""
    from kvfs.security.credentials import Tls

    return Tls.load(tls_dir(name, role, addresses))


def foreign_tls(name: str, role: str = "node", addresses: tuple[str, ...] = ("127.0.0.1",)) -> Any:
    """A `Tls` for NAME in ROLE issued by another CA than the session's (a stranger's)."""
    from kvfs.security import ca
    from kvfs.security.credentials import Tls

    other = _TLS_ROOT / "other-ca"
    if not (other / "ca.key").exists():
        ca.init_ca(other)
    out = _TLS_ROOT / f"foreign-{name}-{role}"
    if not out.exists():
        ca.issue(other, name, role, out, list(addresses) if role == "node" else [])
    return Tls.load(out)


ADMIN_TLS = tls_dir("operator", "admin")
os.environ["KVFS_TLS_DIR"] = ADMIN_TLS  # kvfs status, du, remove-node of the tests


def metrics_url(log_text: str) -> str:
    """The metrics endpoint a daemon's log announced last."""
    found = re.findall(r"metrics on (http://\S+)", log_text)
    assert found, "the daemon did not announce its metrics endpoint"
    return found[-1]


class KvfsMount:
    """A kvfs daemon running in the foreground in a child process."""

    def __init__(self, root: Path, dram: str, *extra: str, master: str | None = None,
                 prefix: list[str] | None = None, addresses: tuple[str, ...] = ("127.0.0.1",)) -> None:
        self.root = root
        self.path = root / "mnt"
        self.path.mkdir()
        self.log_path = root / "kvfs.log"
        if master is None:
            self.args = [sys.executable, "-m", "kvfs", "mount", str(self.path), "--foreground",
                         "--dram", dram, "--log-level", "debug", *extra]
        else:
            self.args = [sys.executable, "-m", "kvfs", "node", "--master", master, "--mount", str(self.path),
                         "--name", root.name, "--tls-dir", tls_dir(root.name, "node", addresses), "--foreground",
                         "--dram", dram, "--log-level", "debug", *extra]
        self.args = [*(prefix or []), *self.args]  # e.g. nsenter into a network namespace (tests/netns.py)
        self.allowed_errors: list[str] = []
        self._log_offset = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.stop_status: int | None = None  # the exit status of the last stop by SIGTERM

    def start(self) -> None:
        start_offset = len(self.log_text())
        self.stop_status = None
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        try:
            self.wait_ready(start_offset)
        except BaseException:  # a daemon that never became ready is not left running, nor its mount
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            if find_mount(str(self.path)) is not None:
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
            raise

    def wait_ready(self, start_offset: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while "is ready" not in self.log_text()[start_offset:]:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"kvfs exited with {self.process.returncode}:\n{self.log_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvfs did not become ready:\n{self.log_text()}")
            time.sleep(0.02)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def metrics_url(self) -> str:
        return metrics_url(self.log_text())

    def new_errors(self) -> list[str]:
        """Unexpected error lines logged since the last call."""
        text = self.log_text()
        fresh, self._log_offset = text[self._log_offset:], len(text)
        lines = [line for line in fresh.splitlines() if UNEXPECTED.search(line)]
        return [line for line in lines if not any(allowed in line for allowed in self.allowed_errors)]

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.stop_status = self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
                raise AssertionError(f"kvfs did not stop on SIGTERM:\n{self.log_text()[-4000:]}")
        if find_mount(str(self.path)) is not None:
            subprocess.run(["fusermount3", "-u", "-z", str(self.path)], capture_output=True)
            raise AssertionError(f"{self.path} still mounted after the daemon exited")

    def kill(self) -> None:
        """kill -9: leaves a stale mount behind, as a crashed daemon does."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()


def wait_until(condition: Any, what: str = "condition", timeout: float = 15.0) -> float:
    """Polls for something another process does asynchronously (a heartbeat, a restart, a
    heal) until it holds, at most `timeout` seconds; returns how long that took."""
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.05)
    return time.monotonic() - started


def is_stored(path: Path) -> bool:
    """Whether kvfs still holds a file. An open asks the daemon; stat may still be answered
    for a moment from a kernel entry of an evicted file, whose invalidation is asynchronous."""
    try:
        open(path, "rb").close()
    except FileNotFoundError:
        return False
    return True


def run_writers_then_readers(writers: list, readers: list, done) -> None:
    """Runs writer and reader threads together; once the writers finish, sets `done` (the
    readers' signal to do one last round and stop) and waits for the readers."""
    threads = [threading.Thread(target=w) for w in writers], [threading.Thread(target=r) for r in readers]
    for thread in threads[0] + threads[1]:
        thread.start()
    for thread in threads[0]:
        thread.join()
    done.set()
    for thread in threads[1]:
        thread.join()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (made here): a file system whose room is known and
    small. Unmounted lazily at the end (a daemon of the test may still hold it a moment)."""
    path.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "kvfs-test", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


def _mount(tmp_root: Path, dram: str, *extra: str) -> Iterator[KvfsMount]:
    mount = KvfsMount(tmp_root, dram, *extra)
    mount.start()
    try:
        yield mount
    finally:
        errors = mount.new_errors()
        mount.stop()
        assert not errors, "kvfs logged unexpected errors:\n" + "\n".join(errors)
        # A clean stop that could not save every file exits 1 (and names them): never silently.
        assert mount.stop_status in (None, 0), (f"kvfs exited with {mount.stop_status} on a clean stop:\n"
                                                + mount.log_text()[-3000:])


@pytest.fixture(scope="module")
def shared_mount(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvfsMount]:
    """One mount for a module's tests; each test works in its own directory."""
    yield from _mount(tmp_path_factory.mktemp("kvfs"), "1G")


@pytest.fixture
def kvfs_dir(shared_mount: KvfsMount) -> Iterator[Path]:
    directory = shared_mount.path / f"t-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    yield directory
    errors = shared_mount.new_errors()
    assert not errors, "kvfs logged unexpected errors:\n" + "\n".join(errors)


@pytest.fixture
def make_mount(tmp_path: Path) -> Iterator:
    """Mounts kvfs with given options for one test: make_mount('64M', '--temp-grace', '1')."""
    mounts: list[Iterator[KvfsMount]] = []

    def make(dram: str = "64M", *extra: str) -> KvfsMount:
        root = Path(tempfile.mkdtemp(dir=tmp_path))
        generator = _mount(root, dram, *extra)
        mounts.append(generator)
        return next(generator)

    yield make
    for generator in reversed(mounts):
        next(generator, None)


def start_master_process(argv: list[str], log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Starts a `kvfs master` command with its output appended to LOG_PATH; returns the process
    and the address it listens on, once it says so (30 s at most)."""
    def text() -> str:
        return log_path.read_text(errors="replace") if log_path.exists() else ""

    offset = len(text())
    with open(log_path, "ab") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
        found = re.search(r"master listening on (\S+)", text()[offset:])
        if found:
            return process, found.group(1)
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"kvfs master did not start:\n{text()}")
        time.sleep(0.02)


class MasterDaemon:
    """`kvfs master` in a child process, on an ephemeral loopback port."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "master-data"
        self.log_path = root / "master.log"
        self.address = ""
        self.process: subprocess.Popen[bytes] | None = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, port: int = 0, host: str = "127.0.0.1") -> None:
        self.host = host
        self.process, self.address = start_master_process(
            [sys.executable, "-m", "kvfs", "master", "--listen", f"{host}:{port}", "--data", str(self.data),
             "--tls-dir", tls_dir("master", "master"), "--log-level", "debug"], self.log_path)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    @property
    def metrics_url(self) -> str:
        return metrics_url(self.log_text())

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=30)


class Cluster:
    """A master and nodes, each node a real mount, all on loopback (or, given a tests/netns.py
    Network, the master on its bridge and each node in a namespace of its own)."""

    def __init__(self, root: Path, network: Any = None) -> None:
        self.root = root
        self.network = network
        self.master = MasterDaemon(root)
        self.master.start(host=network.address if network is not None else "127.0.0.1")
        self.nodes: list[KvfsMount] = []
        self.hosts: dict[str, Any] = {}  # node name -> its netns Host

    def add_node(self, dram: str = "256M", *extra: str, name: str | None = None) -> KvfsMount:
        node_root = self.root / (name or f"node{len(self.nodes) + 1}")
        node_root.mkdir()
        prefix = None
        addresses: tuple[str, ...] = ("127.0.0.1",)
        if self.network is not None:
            host = self.hosts[node_root.name] = self.network.add_host()
            prefix = host.prefix
            addresses = (host.address, "127.0.0.1")
            extra = ("--listen", f"{host.address}:0", *extra)
        node = KvfsMount(node_root, dram, *extra, master=self.master.address, prefix=prefix, addresses=addresses)
        node.start()
        self.nodes.append(node)
        return node

    def errors(self) -> list[str]:
        return [f"{node.root.name}: {line}" for node in self.nodes for line in node.new_errors()]

    def close(self) -> list[str]:
        errors = self.errors()
        failures: list[BaseException] = []
        try:
            for node in reversed(self.nodes):  # every node is stopped, even after one failed to stop
                try:
                    if node.process is not None and node.process.poll() is None:
                        node.stop()
                    elif find_mount(str(node.path)) is not None:
                        subprocess.run(["fusermount3", "-u", "-z", str(node.path)], capture_output=True)
                except AssertionError as failure:
                    failures.append(failure)
        finally:
            self.master.stop()
        if failures:
            raise failures[0]
        return errors


@contextlib.contextmanager
def busy_cpus(count: int) -> Iterator[None]:
    """Processes that spin (the machine's other work): the daemons get their CPU late."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    """Busy processes on every core for the test's length: a loaded machine, where the kernel's
    asynchronous requests (RELEASE, invalidations) and the daemons' tasks come late."""
    with busy_cpus(os.cpu_count() or 2):
        yield


@pytest.fixture
def netns_cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A master on a bridge and nodes each in a network namespace of their own
    (cluster.hosts[name].cut() partitions one silently; .heal() ends it)."""
    import netns

    why = netns.available()
    if why is not None:
        pytest.fail(f"network namespaces: {why}")
    network = netns.Network()
    try:
        with running_cluster(tmp_path, network) as started:
            try:
                yield started
            finally:
                for host in network.hosts:
                    host.heal()
    finally:
        network.close()


@contextlib.contextmanager
def running_cluster(root: Path, network: Any = None) -> Iterator[Cluster]:
    """A Cluster, stopped at the end; any unexpected error a daemon logged fails the test."""
    started = Cluster(root, network)
    try:
        yield started
    finally:
        errors = started.close()
        assert not errors, "kvfs logged unexpected errors:\n" + "\n".join(errors)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    """A master on loopback; add nodes with cluster.add_node(dram, *flags)."""
    with running_cluster(tmp_path) as started:
        yield started


@pytest.fixture
def etcd_cluster(tmp_path: Path) -> Iterator[Any]:
    """A 3-member etcd on loopback (tests/etcd.py), killed by PID at teardown."""
    from etcd import EtcdCluster

    with EtcdCluster(tmp_path, members=3) as started:
        yield started
