"""A real etcd cluster on loopback for tests: `EtcdCluster(tmp_path, members=3)`.

Each member is an /usr/bin/etcd process on free loopback ports with its data under the
test's directory; `kill(i)` (SIGKILL), `stop(i)`/`cont(i)` (SIGSTOP/SIGCONT: a frozen
member), `restart(i)` (after a kill, same data) and `close()` (every member killed by
PID). `endpoints` is the clients' "http://127.0.0.1:P,..." list.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

ETCD = os.environ.get("KVFS_TEST_ETCD", "/usr/bin/etcd")
START_TIMEOUT_S = 30.0


def free_ports(count: int) -> list[int]:
    """Ports free on loopback now (held open together, so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class EtcdCluster:
    def __init__(self, root: Path, members: int = 3, flags: tuple[str, ...] = ()) -> None:
        if not os.access(ETCD, os.X_OK):
            raise RuntimeError(f"no etcd at {ETCD}: install it (Debian: etcd-server) or set KVFS_TEST_ETCD")
        self.flags = flags  # more etcd flags for every member (a benchmark's larger txns)
        self.root = root / "etcd"
        self.root.mkdir(parents=True, exist_ok=True)
        ports = free_ports(2 * members)
        self.client_ports = ports[:members]
        self.peer_ports = ports[members:]
        self.names = [f"m{i}" for i in range(members)]
        self.processes: list[subprocess.Popen[bytes] | None] = [None] * members
        self.stopped: set[int] = set()
        self.initial = ",".join(f"{name}=http://127.0.0.1:{port}" for name, port in zip(self.names, self.peer_ports))
        self.token = f"kvfs-test-{os.getpid()}-{self.client_ports[0]}"
        started = time.monotonic()
        try:
            for i in range(members):
                self._spawn(i, "new")
            self.wait_healthy()
        except BaseException:
            self.close()
            raise
        self.start_s = time.monotonic() - started

    @property
    def endpoints(self) -> str:
        return ",".join(self.urls)

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.client_ports]

    def log_path(self, i: int) -> Path:
        return self.root / f"{self.names[i]}.log"

    def log_text(self, i: int) -> str:
        path = self.log_path(i)
        return path.read_text(errors="replace") if path.exists() else ""

    def _spawn(self, i: int, state: str) -> None:
        name = self.names[i]
        with open(self.log_path(i), "ab") as log:
            self.processes[i] = subprocess.Popen(
                [ETCD, "--name", name, "--data-dir", str(self.root / name),
                 "--listen-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
                 "--advertise-client-urls", f"http://127.0.0.1:{self.client_ports[i]}",
                 "--listen-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer_ports[i]}",
                 "--initial-cluster", self.initial, "--initial-cluster-state", state,
                 "--initial-cluster-token", self.token,
                 "--heartbeat-interval", "100", "--election-timeout", "1000",
                 "--logger", "zap", "--log-outputs", "stderr", *self.flags],
                stdout=log, stderr=subprocess.STDOUT)

    def _get(self, i: int, path: str, timeout: float = 1.0) -> dict:
        with urllib.request.urlopen(f"{self.urls[i]}{path}", timeout=timeout) as response:
            return json.loads(response.read())

    def healthy(self, i: int) -> bool:
        """Whether member I answers /health with a leader in sight (quorum)."""
        try:
            return self._get(i, "/health").get("health") in ("true", True)
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, members: list[int] | None = None, timeout: float = START_TIMEOUT_S) -> float:
        """Waits until every running member (or those named) reports health; returns how long."""
        started = time.monotonic()
        wanted = members if members is not None else [
            i for i, p in enumerate(self.processes) if p is not None and p.poll() is None and i not in self.stopped]
        while not all(self.healthy(i) for i in wanted):
            for i in wanted:
                process = self.processes[i]
                if process is None or process.poll() is not None:
                    raise RuntimeError(f"etcd member {self.names[i]} exited:\n{self.log_text(i)[-3000:]}")
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"etcd not healthy within {timeout:g} s:\n"
                                   + "\n".join(self.log_text(i)[-1500:] for i in wanted))
            time.sleep(0.05)
        return time.monotonic() - started

    def raft_leader(self) -> int:
        """The index of the member that is etcd's own (raft) leader now."""
        for i in range(len(self.urls)):
            if i in self.stopped or self.processes[i] is None or self.processes[i].poll() is not None:
                continue
            request = urllib.request.Request(f"{self.urls[i]}/v3/maintenance/status", b"{}")
            try:
                with urllib.request.urlopen(request, timeout=1.0) as response:
                    status = json.loads(response.read())
            except (OSError, ValueError, urllib.error.URLError):
                continue
            if status.get("leader") == status.get("header", {}).get("member_id"):
                return i
        raise RuntimeError("no etcd member says it leads")

    def _note(self, i: int, what: str) -> None:
        """Marks a fault in the member's log, in etcd's own form, to time what followed."""
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
        with open(self.log_path(i), "a") as log:
            log.write(json.dumps({"level": "info", "ts": stamp, "msg": f"test: {what}"}) + "\n")

    def kill(self, i: int) -> None:
        process = self.processes[i]
        assert process is not None
        if i in self.stopped:
            self.cont(i)
        process.kill()
        process.wait()
        self._note(i, "killed (SIGKILL)")

    def stop(self, i: int) -> None:
        """SIGSTOP: the member is frozen (its sockets stay open and silent)."""
        process = self.processes[i]
        assert process is not None and process.poll() is None
        process.send_signal(signal.SIGSTOP)
        self.stopped.add(i)
        self._note(i, "stopped (SIGSTOP)")

    def cont(self, i: int) -> None:
        process = self.processes[i]
        assert process is not None
        process.send_signal(signal.SIGCONT)
        self.stopped.discard(i)
        self._note(i, "continued (SIGCONT)")

    def restart(self, i: int) -> None:
        """Starts member I again on its data (after kill)."""
        process = self.processes[i]
        if process is not None and process.poll() is None:
            self.kill(i)
        self._spawn(i, "existing")

    def close(self) -> None:
        for i, process in enumerate(self.processes):
            if process is None:
                continue
            if process.poll() is None:
                if i in self.stopped:
                    process.send_signal(signal.SIGCONT)
                process.kill()
            process.wait()
        self.stopped.clear()

    def __enter__(self) -> "EtcdCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leader(cluster: EtcdCluster, name: str = "default") -> tuple[str, int] | None:
    """(address, epoch) of the master leading cluster NAME, as etcd says, or None; any
    member that answers will do."""
    import base64

    key = base64.b64encode(f"/kvfs/{name}/leader".encode()).decode()
    for url in cluster.urls:
        request = urllib.request.Request(f"{url}/v3/kv/range", json.dumps({"key": key}).encode())
        try:
            with urllib.request.urlopen(request, timeout=1.0) as response:
                answer = json.loads(response.read())
        except (OSError, ValueError, urllib.error.URLError):
            continue
        kvs = answer.get("kvs") or []
        if not kvs:
            return None
        value = json.loads(base64.b64decode(kvs[0]["value"]))
        return value["address"], int(kvs[0]["create_revision"])
    return None


def state_keys(cluster: EtcdCluster, name: str = "default") -> dict[bytes, bytes]:
    """Every record of cluster NAME's master state in etcd (key -> value)."""
    import base64

    prefix = f"/kvfs/{name}/state/".encode()
    end = prefix[:-1] + bytes([prefix[-1] + 1])
    body = json.dumps({"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(end).decode()})
    for url in cluster.urls:
        try:
            with urllib.request.urlopen(urllib.request.Request(f"{url}/v3/kv/range", body.encode()),
                                        timeout=5.0) as response:
                answer = json.loads(response.read())
        except (OSError, ValueError, urllib.error.URLError):
            continue
        return {base64.b64decode(kv["key"]): base64.b64decode(kv.get("value", "")) for kv in answer.get("kvs") or []}
    raise RuntimeError("no etcd member answered")


class ElectedMaster:
    """`kvfs master --etcd` in a child process, on an ephemeral loopback port."""

    def __init__(self, root: Path, etcd: EtcdCluster, name: str = "master", cluster: str = "default",
                 lease_ttl: int | None = None, metrics_listen: str | None = None) -> None:
        import sys

        from conftest import tls_dir

        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path = root / "master.log"
        self.argv = [sys.executable, "-m", "kvfs", "master", "--listen", "127.0.0.1:0", "--etcd", etcd.endpoints,
                     "--cluster", cluster, "--tls-dir", tls_dir(name, "master"), "--log-level", "debug"]
        if lease_ttl is not None:  # (None: the default operators run, 3 s)
            self.argv += ["--lease-ttl", str(lease_ttl)]
        if metrics_listen is not None:  # (port 0: a free one, named in the log)
            self.argv += ["--metrics-listen", metrics_listen]
        self.process: subprocess.Popen[bytes] | None = None
        self.address = ""
        self.stopped = False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> "ElectedMaster":
        from conftest import start_master_process

        self.process, self.address = start_master_process(self.argv, self.log_path)
        return self

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def kill(self) -> None:
        assert self.process is not None
        if self.stopped:
            self.cont()
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
        self.stopped = False

    def close(self) -> int | None:
        """SIGTERM (then SIGKILL after 30 s); the exit status."""
        if self.process is None:
            return None
        if self.stopped:
            self.cont()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                return self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise AssertionError(f"kvfs master did not stop on SIGTERM:\n{self.log_text()[-3000:]}")
        return self.process.returncode
