"""Inside the soft-RoCE VM: a master and two nodes with the RDMA transport, checked for real.

Run by tests/test_rdma.py through `scripts/rdma_vm.py run tests/rdma/guest.sh
/share/tests/rdma/vm_checks.py`. Each check prints PASS or FAIL with the reason;
the last line is `RDMA-VM-SUMMARY passed=N failed=M checks=...` for the host.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import trio

HOST = os.environ.get("KVFS_RDMA_HOST", "10.77.0.1")
MiB = 1 << 20
ROOT = Path("/tmp/kvfs-vm")
TLS = ROOT / "tls"  # the checks' CA and a bundle per identity
ENV = {**os.environ, "KVFS_TLS_DIR": str(TLS / "admin"), "KVFS_METRICS_LISTEN": "127.0.0.1:0",
       "KVFS_CONFIG": os.devnull}


def issue_bundles() -> None:
    """The CA and the bundles of the master, the nodes (at HOST) and the admin."""
    from kvfs.security import ca

    if not (TLS / "ca" / "ca.key").exists():
        ca.init_ca(TLS / "ca")
    for name, role in (("master", "master"), ("owner", "node"), ("reader", "node"), ("disk-owner", "node"),
                       ("admin", "admin")):
        ca.issue(TLS / "ca", name, role, TLS / name, [HOST] if role == "node" else [], overwrite=True)


class Daemon:
    def __init__(self, name: str, args: list[str]) -> None:
        self.name = name
        self.log = ROOT / f"{name}.log"
        with open(self.log, "ab") as output:
            self.process = subprocess.Popen([sys.executable, "-m", "kvfs", *args], stdout=output,
                                            stderr=subprocess.STDOUT, env=ENV)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while True:
            found = re.search(pattern, self.text())
            if found:
                return found
            code = self.process.poll()
            if code is not None or time.monotonic() > deadline:
                why = f"it exited with {code}" if code is not None else f"not within {timeout:.0f} s"
                raise AssertionError(f"{self.name}: no {pattern!r} ({why}):\n{self.text()[-3000:]}")
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        url = re.findall(r"metrics on (http://\S+)", self.text())[-1]
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        return samples

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()


def node(name: str, master: str, *extra: str) -> tuple[Daemon, Path]:
    mountpoint = ROOT / name
    daemon = Daemon(name, ["node", "--master", master, "--mount", str(mountpoint), "--name", name,
                           "--tls-dir", str(TLS / name), "--foreground",
                           "--listen", f"{HOST}:0", "--dram", "96M", "--log-level", "debug", *extra])
    daemon.wait_for(r"is ready")
    return daemon, mountpoint


def drop_caches() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3")


RESULTS: list[tuple[str, bool, str]] = []


def check(name: str):
    def run(function):
        started = time.monotonic()
        try:
            function()
            RESULTS.append((name, True, ""))
            print(f"PASS {name} ({time.monotonic() - started:.1f} s)", flush=True)
        except Exception as error:
            RESULTS.append((name, False, str(error)))
            print(f"FAIL {name} ({time.monotonic() - started:.1f} s): {error}", flush=True)
            traceback.print_exc()
        return function
    return run


def main() -> None:
    ROOT.mkdir(parents=True, exist_ok=True)
    issue_bundles()
    master = Daemon("master", ["master", "--listen", f"{HOST}:0", "--data", str(ROOT / "master-data"),
                               "--tls-dir", str(TLS / "master")])
    master_address = master.wait_for(r"master listening on (\S+)").group(1)
    owner, owner_path = node("owner", master_address, "--transport", "rdma")
    reader, reader_path = node("reader", master_address, "--transport", "auto")
    daemons = [master, owner, reader]
    contents = {size: os.urandom(size) for size in (1, 4096, 2 * MiB, 4 * MiB + 1, 10 * MiB + 12345)}
    (owner_path / "blocks").mkdir()
    for size, data in contents.items():
        (owner_path / "blocks" / f"{size}.bin").write_bytes(data)

    @check("verbs: READs, a wrong rkey, windows that are revoked, the region's own rkey refused")
    def _() -> None:
        sys.path.insert(0, str(Path(__file__).parent))
        from smoke_verbs import main as verbs_checks

        trio.run(verbs_checks)

    @check("auto chooses RDMA inside the VM, and kvfs status shows it")
    def _() -> None:
        assert "transport auto: RDMA on rxe0" in reader.text(), reader.text()[-2000:]
        assert "transport rdma: RDMA on rxe0" in owner.text()
        status = subprocess.run([sys.executable, "-m", "kvfs", "status", "--master", master_address, "--json"],
                                capture_output=True, text=True, env=ENV, timeout=60)
        nodes = json.loads(status.stdout)["nodes"]
        assert {n["name"]: n["activity"]["transport"] for n in nodes} == {"owner": "rdma", "reader": "rdma"}, nodes

    @check("cross-node reads are byte-exact and move over RDMA")
    def _() -> None:
        before = reader.metrics()
        for size, data in contents.items():
            assert (reader_path / "blocks" / f"{size}.bin").read_bytes() == data, f"{size}.bin differs"
        after = reader.metrics()
        moved = after['kvfs_transport_bytes_total{transport="rdma"}'] - before.get(
            'kvfs_transport_bytes_total{transport="rdma"}', 0)
        assert moved == sum(contents), f"{moved} bytes over RDMA, expected {sum(contents)}"
        assert after.get('kvfs_transport_bytes_total{transport="tcp"}', 0) == 0
        granted = owner.metrics()["kvfs_rdma_windows_granted_total"]
        assert granted >= 7, granted  # one window per chunk: 1 + 1 + 1 + 2 + 3

    @check("concurrent READs from several readers")
    def _() -> None:
        names = []
        for index in range(12):
            data = os.urandom(3 * MiB + index)
            (owner_path / "blocks" / f"c{index}.bin").write_bytes(data)
            names.append((f"c{index}.bin", data))
        drop_caches()
        errors: list[str] = []

        def load(part: list) -> None:
            for name, data in part:
                if (reader_path / "blocks" / name).read_bytes() != data:
                    errors.append(name)

        threads = [threading.Thread(target=load, args=(names[i::4],)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert reader.metrics().get('kvfs_transport_bytes_total{transport="tcp"}', 0) == 0

    @check("a revoked rkey is refused and the fetch falls back to TCP")
    def _() -> None:
        from kvfs.net.rdma import RdmaTransport, open_rdma
        from kvfs.net.transport import TcpTransport
        from kvfs.store.buffers import ReadBufferPool

        info = json.loads(os.getxattr(reader_path / "blocks" / f"{10 * MiB + 12345}.bin", "user.kvfs.info"))
        checksums = [int(chunk["checksum"].split(":")[1], 16) for chunk in info["chunks"]]
        lengths = [chunk["length"] for chunk in info["chunks"]]
        device = open_rdma("rdma")
        buffers = ReadBufferPool(4, 4 * MiB)
        from kvfs.security.credentials import Tls

        tls = Tls.load(TLS / "reader")
        transport = RdmaTransport(device, tls, TcpTransport(tls), buffers)
        revoked = []

        async def revoke_between_grant_and_read(address: str) -> None:
            await transport.revoke_for_test(address)
            revoked.append(address)

        async def fetch() -> list[int]:
            targets = [buffers.take() for _ in lengths]
            arrived: list[int] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(device.run_completions)
                transport.after_locate = revoke_between_grant_and_read
                await transport.fetch(info["node_address"], info["version"], 0, targets, lengths, checksums,
                                      arrived.append)
                transport.after_locate = None
                got = b"".join(bytes(t[:n]) for t, n in zip(targets, lengths))
                assert got == contents[10 * MiB + 12345], "the fallback delivered other bytes"
                # And the next fetch is over RDMA again, on a new queue pair.
                await transport.fetch(info["node_address"], info["version"], 0, targets, lengths, checksums,
                                      arrived.append)
                await transport.aclose()
                nursery.cancel_scope.cancel()
            return arrived

        arrived = trio.run(fetch)
        device.close()
        assert revoked, "the test hook did not run"
        assert sorted(set(arrived)) == [0, 1, 2], arrived
        assert transport.errors.get("rem_access_err", 0) >= 1, transport.errors
        assert transport.fallbacks.get("rem_access_err", 0) == 1, transport.fallbacks
        assert transport.tcp.fetched_bytes == sum(lengths), transport.tcp.fetched_bytes
        assert transport.rdma_bytes == sum(lengths), transport.rdma_bytes

    @check("a version only on the owner's SSD comes over TCP")
    def _() -> None:
        # The default engine choice, on a CPU without AVX-512: io_uring must be proven and chosen.
        flags = Path("/proc/cpuinfo").read_text().split()
        assert "avx2" in flags and "avx512f" not in flags, "the VM's CPU must have AVX2 and no AVX-512"
        disk_owner, disk_path = node("disk-owner", master_address, "--transport", "rdma", "--disk",
                                     str(ROOT / "disk"), "--disk-size", "128M", "--io-engine", "auto",
                                     "--no-direct-io")
        daemons.append(disk_owner)
        assert "(io_uring I/O," in disk_owner.text() and "io_uring is unavailable" not in disk_owner.text()
        data = os.urandom(5 * MiB)
        (disk_path / "blocks" / "on-ssd.bin").write_bytes(data)
        os.setxattr(disk_path, "user.kvfs.control", b"flush")
        os.setxattr(disk_path, "user.kvfs.control", b"drop-dram")
        before = reader.metrics()
        assert (reader_path / "blocks" / "on-ssd.bin").read_bytes() == data
        after = reader.metrics()
        key, tcp = 'kvfs_rdma_fallbacks_total{reason="not_in_dram"}', 'kvfs_transport_bytes_total{transport="tcp"}'
        assert after.get(key, 0) - before.get(key, 0) >= 1, (before.get(key), after.get(key))
        assert after[tcp] - before.get(tcp, 0) >= 4 * MiB, (before.get(tcp), after[tcp])

    @check("a peer killed mid-transfer fails the read, never hangs it")
    def _() -> None:
        big = os.urandom(40 * MiB)
        (owner_path / "blocks" / "big.bin").write_bytes(big)
        drop_caches()
        outcome: list[object] = []

        def load() -> None:
            started = time.monotonic()
            try:
                got = (reader_path / "blocks" / "big.bin").read_bytes()
                outcome.append(("read", got == big, time.monotonic() - started))
            except OSError as error:
                outcome.append(("error", error.errno, time.monotonic() - started))

        thread = threading.Thread(target=load)
        thread.start()
        time.sleep(0.3)
        owner.process.kill()
        owner.process.wait()
        thread.join(timeout=120)
        assert not thread.is_alive(), "the reader hung after its peer died"
        kind, value, seconds = outcome[0]  # type: ignore[misc]
        # Either the transfer finished before the kill (and is exact) or the read failed.
        assert (kind == "read" and value is True) or kind == "error", outcome
        print(f"  outcome: {kind} {value} after {seconds:.1f} s", flush=True)
        subprocess.run(["fusermount3", "-u", "-z", str(owner_path)], capture_output=True)

    for daemon in reversed(daemons):
        daemon.stop()
    if Path("/out").is_dir():  # the daemons' logs, for the host to read
        for log in ROOT.glob("*.log"):
            (Path("/out") / f"daemon-{log.name}").write_text(log.read_text(errors="replace"))
    logs = "".join(d.text() for d in (reader,))
    unexpected = [line for line in logs.splitlines() if "Traceback" in line]
    if unexpected:
        RESULTS.append(("no tracebacks in the reader's log", False, unexpected[0]))
    passed = sum(1 for _, ok, _ in RESULTS if ok)
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"RDMA-VM-SUMMARY passed={passed} failed={len(failed)} checks={len(RESULTS)} "
          f"failures={json.dumps(failed)}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
