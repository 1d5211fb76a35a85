"""Mooncake Store beside kvfs in scripts/bench_cluster.py: its master and clients in a
network namespace of their own, on loopback, over TCP.

Two halves, both standard library only:

- `MooncakeSide` (imported by bench_cluster.py, run by kvfs's Python) creates the
  namespace, starts `mooncake_master` (with its HTTP metadata server), one writer client
  and the reader clients, and drives them;
- `main()` is one client, run by the Python of the venv that holds Mooncake's package
  (`mooncake-transfer-engine-non-cuda`), which joins the master over TCP and then answers
  commands, one per line on stdin, one reply line on stdout (logs go to stderr):

    put PREFIX COUNT SIZE          store objects PREFIX0..PREFIX<COUNT-1> of SIZE bytes
                                   (put_from the registered buffer, random bytes)
    remove PREFIX COUNT            remove them
    get PREFIX FIRST STEP COUNT SIZE BATCH
                                   load objects FIRST, FIRST+STEP, ... (COUNT of them)
                                   with get_into into one registered buffer (BATCH 1)
                                   or batch_get_into of BATCH objects per call into
                                   BATCH registered buffers; replies "START END" (the
                                   monotonic clock, shared by every process on the host)
    quit

The writer mounts a segment that holds the objects; a reader mounts none, so that every
object it gets lies in another process's memory and crosses TCP.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import re
import subprocess
import sys
import time
from pathlib import Path

VENV = Path("/opt/kvfs-bench/mooncake")
PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
MASTER_RPC = "127.0.0.1:50051"  # fixed ports: the namespace is the benchmark's alone
METADATA = "http://127.0.0.1:8080/metadata"


def how_to_install(venv: Path) -> str:
    return f"python3 -m venv {venv} && {venv}/bin/pip install {PACKAGE}"


def install(venv: Path) -> None:
    """Mooncake's package in a venv of its own (kvfs's venv stays as it is)."""
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", PACKAGE], check=True)


def missing(venv: Path) -> str | None:
    """Why Mooncake cannot be measured from VENV, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for name in ("python", "mooncake_master"):
        if not (venv / "bin" / name).exists():
            return f"{venv / 'bin' / name} is missing"
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import mooncake.store"], capture_output=True)
    if probe.returncode != 0:
        return f"{venv}/bin/python cannot import mooncake.store: {probe.stderr.decode().strip()[-300:]}"
    return None


def check_exec(process: subprocess.Popen, program: str) -> None:
    """That `ip netns exec` exec'd PROGRAM in its own process and nothing there forked: the
    Popen's pid is then all of PROGRAM, whose CPU bench_cluster.py reads. Called once PROGRAM
    answered. (The venv's mooncake_master is a script that execs the package's binary of that name.)"""
    task = Path(f"/proc/{process.pid}")
    running = os.path.basename(task.joinpath("cmdline").read_bytes().split(b"\0")[0].decode(errors="replace"))
    if running != os.path.basename(program):
        raise SystemExit(f"process {process.pid} runs {running}, not {program}: its CPU would not be Mooncake's")
    if any(children(thread) for thread in task.joinpath("task").iterdir()):
        raise SystemExit(f"{program} (process {process.pid}) started processes of its own: its CPU would be missed")


def children(thread: Path) -> str:
    """The pids of the processes a thread (/proc/PID/task/TID) started, or "" (also once it exited)."""
    try:
        return thread.joinpath("children").read_text().strip()
    except FileNotFoundError:
        return ""


class Peer:
    """A client process (main() below) and its command pipe."""

    def __init__(self, command: list[str], log: Path, env: dict[str, str]) -> None:
        self.log = log
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=open(log, "wb"), env=env, text=True)
        self.expect("ready")
        check_exec(self.process, command[command.index("exec") + 2])

    def send(self, line: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()

    def reply(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            tail = self.log.read_text(errors="replace").splitlines()[-5:]
            raise SystemExit(f"a Mooncake client exited; see {self.log}:\n" + "\n".join(tail))
        return line.strip()

    def expect(self, word: str) -> None:
        if (got := self.reply()) != word:
            raise SystemExit(f"a Mooncake client answered {got!r}, not {word!r}; see {self.log}")

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.send("quit")
                self.process.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()


class MooncakeSide:
    """Mooncake's master, a writer and READERS reader clients in a network namespace.

    Objects are put by the writer and got by the readers, which lend the store no
    memory: every get crosses TCP from the writer's segment, as kvfs's node B loads
    chunks from node A's arena."""

    def __init__(self, venv: Path, base: Path, readers: int, segment: int, largest: int, batch: int) -> None:
        self.venv, self.base = venv, base
        self.namespace = f"kvfs-bench-{os.getpid()}"
        self.master: subprocess.Popen | None = None
        self.peers: list[Peer] = []
        self.env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        self.readers, self.segment, self.largest, self.batch = readers, segment, largest, batch

    def __enter__(self) -> MooncakeSide:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def inside(self, *command: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *command]

    def start(self) -> None:
        subprocess.run(["ip", "netns", "add", self.namespace], check=True)
        subprocess.run(self.inside("ip", "link", "set", "lo", "up"), check=True)
        log = self.base / "mooncake-master.log"
        host, port = MASTER_RPC.split(":")
        self.master = subprocess.Popen(
            self.inside(str(self.venv / "bin" / "mooncake_master"), f"--rpc_address={host}", f"--rpc_port={port}",
                        "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
                        "--http_metadata_server_port=8080", "--metrics_host=127.0.0.1", "--metrics_port=9003",
                        "--enable_metric_reporting=false"),
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + 30
        while not re.search(r"Master admin server started", log.read_text(errors="replace")):
            if self.master.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"mooncake_master did not start; see {log}")
            time.sleep(0.05)
        check_exec(self.master, str(self.venv / "bin" / "mooncake_master"))
        self.peers.append(self.client("writer", self.segment, self.largest))
        for r in range(self.readers):
            self.peers.append(self.client(f"reader{r}", 0, self.largest * self.batch))
        # Every reader's connection to the writer is made before anything is timed.
        self.put("warm-", 1, 1 << 20)
        for reader in self.peers[1:]:
            reader.send("get warm- 0 1 1 1048576 1")
            reader.reply()
        self.remove("warm-", 1)

    def client(self, name: str, segment: int, buffer: int) -> Peer:
        return Peer(self.inside(str(self.venv / "bin" / "python"), str(Path(__file__).resolve()),
                                "--master", MASTER_RPC, "--metadata", METADATA, "--segment", str(segment),
                                "--buffer", str(buffer)),
                    self.base / f"mooncake-{name}.log", self.env)

    def put(self, prefix: str, count: int, size: int) -> None:
        self.peers[0].send(f"put {prefix} {count} {size}")
        self.peers[0].expect("ok")

    def remove(self, prefix: str, count: int) -> None:
        self.peers[0].send(f"remove {prefix} {count}")
        self.peers[0].expect("ok")

    def get(self, prefix: str, count: int, size: int, readers: int, batch: int) -> float:
        """GB/s of objects 0..count-1 (rounded down to a multiple of READERS) got by READERS
        reader processes at once, each every READERS-th object; from the first start to the last end."""
        each = count // readers
        for r, reader in enumerate(self.peers[1 : readers + 1]):
            reader.send(f"get {prefix} {r} {readers} {each} {size} {batch}")
        spans = [tuple(map(float, reader.reply().split())) for reader in self.peers[1 : readers + 1]]
        elapsed = max(end for _, end in spans) - min(start for start, _ in spans)
        return each * readers * size / elapsed / 1e9

    def pids(self, readers: int) -> dict[str, list[int]]:
        """The processes of a get by READERS readers, by role (for their CPU)."""
        assert self.master is not None
        return {"master": [self.master.pid], "writer": [self.peers[0].process.pid],
                "readers": [reader.process.pid for reader in self.peers[1 : readers + 1]]}

    def loopback_bytes(self) -> int:
        """Bytes received on the namespace's loopback so far: a check that gets cross TCP."""
        table = subprocess.run(self.inside("cat", "/proc/net/dev"), capture_output=True, text=True, check=True)
        for line in table.stdout.splitlines():
            name, _, fields = line.partition(":")
            if name.strip() == "lo":
                return int(fields.split()[0])
        raise SystemExit(f"no loopback in namespace {self.namespace}")

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.peers = []
        if self.master is not None and self.master.poll() is None:
            self.master.terminate()
            try:
                self.master.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.master.kill()
                self.master.wait()
        subprocess.run(["ip", "netns", "del", self.namespace], stderr=subprocess.DEVNULL)


def fail(message: str) -> None:
    print(f"mooncake_peer: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--master", required=True, help="the master's RPC address, host:port")
    parser.add_argument("--metadata", required=True, help="the metadata server's URL")
    parser.add_argument("--hostname", default="127.0.0.1", help="this client's address")
    parser.add_argument("--segment", type=int, default=0, help="bytes this client lends the store")
    parser.add_argument("--buffer", type=int, default=64 << 20, help="bytes of registered buffers")
    args = parser.parse_args()

    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-not-found]

    store = MooncakeDistributedStore()
    # The local buffer stages put() and get() of unregistered memory; put_from and
    # get_into use the registered buffer below, but a small one makes setup warn.
    code = store.setup(args.hostname, args.metadata, args.segment, 16 << 20, "tcp", "", args.master)
    if code != 0:
        fail(f"setup against {args.master} failed: {code}")
    # Registered once, as vLLM's connector registers its KV cache: the writer's source,
    # the reader's targets. Random bytes, and faulted in before any timing.
    region = mmap.mmap(-1, args.buffer)
    region.write(os.urandom(1 << 20) * (args.buffer >> 20))
    pointer = ctypes.c_char.from_buffer(region)
    address = ctypes.addressof(pointer)
    if store.register_buffer(address, args.buffer) != 0:
        fail(f"register_buffer of {args.buffer} bytes failed")
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        command = words[0]
        if command == "quit":
            break
        if command == "put":
            prefix, count, size = words[1], int(words[2]), int(words[3])
            if size > args.buffer:
                fail(f"{size} bytes exceed the {args.buffer}-byte buffer")
            for i in range(count):
                code = store.put_from(f"{prefix}{i}", address, size)
                if code != 0:
                    fail(f"put {prefix}{i} ({size} bytes) failed: {code}")
            print("ok", flush=True)
        elif command == "remove":
            prefix, count = words[1], int(words[2])
            for i in range(count):
                store.remove(f"{prefix}{i}", True)  # now, not when the get's lease expires
            print("ok", flush=True)
        elif command == "get":
            prefix, first, step, count, size, batch = words[1], *map(int, words[2:7])
            if size * batch > args.buffer:
                fail(f"{batch} x {size} bytes exceed the {args.buffer}-byte buffer")
            keys = [f"{prefix}{first + i * step}" for i in range(count)]
            start = time.monotonic()
            if batch == 1:
                for key in keys:
                    got = store.get_into(key, address, size)
                    if got != size:
                        fail(f"get_into {key}: {got}")
            else:
                pointers = [address + j * size for j in range(batch)]
                for at in range(0, count, batch):
                    group = keys[at : at + batch]
                    got = store.batch_get_into(group, pointers[: len(group)], [size] * len(group))
                    if any(n != size for n in got):
                        fail(f"batch_get_into {group[0]}..: {got}")
            end = time.monotonic()
            print(f"{start} {end}", flush=True)
        else:
            fail(f"unknown command {command!r}")
    store.close()
    del pointer
    region.close()


if __name__ == "__main__":
    main()
