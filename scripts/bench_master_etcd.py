"""The cost of a file create on a master with its state in etcd (elected, group commit)
against one with its state in lmdb (--data), side by side in one run.

Starts a 3-member etcd on loopback (tests/etcd.py), one `kvfs master --etcd` and one
`kvfs master --data`, each a real process. A round creates N files through a
RemoteMaster on each master in turn (Create, then Seal: the two requests of a written
file), with 1 caller and with 16 callers at once on one connection (a node's loaders);
rounds alternate between the two masters, and the table shows medians and the ratio
etcd/lmdb measured in the same run. It also times loading the state from etcd: LOAD_FILES
sealed files are committed to etcd from an in-process service (txns of 128 records, as
a leader writes them), then a fresh elected master's load of them is read from its log.
And failover: a standby runs beside the elected master; after the rounds the leader is
killed (-9) and the time until the standby answers a lookup is printed.

Usage: python scripts/bench_master_etcd.py [--files 2000] [--rounds 3] [--load-files 100000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import trio  # noqa: E402

from conftest import MasterDaemon, load_tls  # noqa: E402
from etcd import ElectedMaster, EtcdCluster, leader  # noqa: E402
from kvfs.cluster.namespace import ROOT_INO  # noqa: E402
from kvfs.clock import SystemClock  # noqa: E402
from kvfs.cluster.master import MasterSettings, MetadataService  # noqa: E402
from kvfs.net.etcd import EtcdClient, create_revision_is, leader_key, put  # noqa: E402
from kvfs.net.etcdstate import EtcdState  # noqa: E402
from kvfs.net.rpc import RemoteMaster  # noqa: E402
from kvfs.policy import LruPolicy  # noqa: E402
from kvfs.wire import messages as m  # noqa: E402


async def create_files(address: str, prefix: str, files: int, callers: int, timeout_s: float = 30.0,
                       done_marker: bool = False) -> float:
    """Seconds to create FILES files (Create + Seal) in directory PREFIX with CALLERS concurrent
    callers; with DONE_MARKER a directory PREFIX-done is made after the last one (a reader can
    tell the files are all in)."""
    host, port = address.rsplit(":", 1)
    async with trio.open_nursery() as nursery:
        remote = await RemoteMaster.connect(host, int(port), load_tls("bench", "node"), nursery,
                                            request_timeout_s=timeout_s)
        node = (await remote.call(m.Register("bench", "127.0.0.1:0"))).node
        await remote.call(m.Report([]))
        await remote.call(m.FinishRegistration())
        directory = (await remote.call(m.MkDir(ROOT_INO, prefix.encode(), 0o755, 0, 0))).ino
        names = iter(range(files))

        async def caller() -> None:
            for i in names:
                opened = await remote.call(m.Create(directory, b"f%07d" % i, 0o644, 0, 0, node, True))
                await remote.call(m.Seal(opened.version, 4096, time.time_ns(), []))

        started = time.perf_counter()
        async with trio.open_nursery() as callers_nursery:
            for _ in range(callers):
                callers_nursery.start_soon(caller)
        elapsed = time.perf_counter() - started
        if done_marker:
            await remote.call(m.MkDir(ROOT_INO, prefix.encode() + b"-done", 0o755, 0, 0))
        await remote.aclose()
    return elapsed


async def answers(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        async with trio.open_nursery() as nursery:
            remote = await RemoteMaster.connect(host, int(port), load_tls("bench", "node"), nursery,
                                                request_timeout_s=2)
            try:
                await remote.call(m.Lookup(ROOT_INO, b"r0c1"))
            finally:
                await remote.aclose()
        return True
    except BaseException as error:  # refused, closed, not listening (an ExceptionGroup from the nursery)
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        return False


async def commit_files(endpoints: list[str], cluster: str, files: int) -> float:
    """Commits FILES sealed files of an in-process service to etcd as cluster CLUSTER's
    state (fenced on a leader key made for it, then removed); seconds it took."""
    client = EtcdClient(endpoints, timeout_s=10.0)
    key = leader_key(cluster)
    _, epoch, _ = await client.txn([create_revision_is(key, 0)], [put(key, b"{}")])
    service = MetadataService(SystemClock(), LruPolicy(), MasterSettings(cluster=True))
    state = EtcdState(client, cluster)
    node = service.handle(m.Register("bench", "127.0.0.1:7000"), 0).node
    service.handle(m.Report([]), node)
    service.handle(m.FinishRegistration(), node)
    started = time.perf_counter()
    directory = service.handle(m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), node).ino
    for i in range(files):
        opened = service.handle(m.Create(directory, b"f%07d" % i, 0o644, 0, 0, node, True), node)
        service.handle(m.Seal(opened.version, 4096, time.time_ns(), []), node)
        service.handle(m.Release(opened.version, True), node)
        if i % 5000 == 4999 or i == files - 1:
            batch = state.take(service)
            assert batch is not None
            await state.commit(batch, epoch)
    elapsed = time.perf_counter() - started
    await client.txn([], [{"request_delete_range": {"key": key}}])
    await client.aclose()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--load-files", type=int, default=100_000)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvfs-bench-etcd-"))
    etcd = EtcdCluster(root)
    print(f"etcd: 3 members healthy in {etcd.start_s:.1f} s")
    elected = ElectedMaster(root / "elected", etcd)
    standby = ElectedMaster(root / "standby", etcd)
    single = MasterDaemon(root / "single")
    (root / "single").mkdir()
    try:
        elected.start()
        while leader(etcd) is None:
            time.sleep(0.05)
        single.start()
        standby.start()
        times: dict[tuple[str, int], list[float]] = {}
        created = 0
        for round_ in range(args.rounds):
            for callers in (1, 16):
                order = [("etcd", elected.address), ("lmdb", single.address)]
                if round_ % 2:
                    order.reverse()
                for mode, address in order:
                    seconds = trio.run(create_files, address, f"r{round_}c{callers}", args.files, callers)
                    times.setdefault((mode, callers), []).append(seconds)
                    if mode == "etcd":
                        created += args.files
        print(f"{args.files} files (Create + Seal) per round, {args.rounds} rounds, medians:")
        print(f"{'callers':>8} {'etcd us/file':>13} {'lmdb us/file':>13} {'etcd files/s':>13} "
              f"{'lmdb files/s':>13} {'etcd/lmdb time':>15}")
        for callers in (1, 16):
            e = statistics.median(times[("etcd", callers)]) / args.files
            s = statistics.median(times[("lmdb", callers)]) / args.files
            print(f"{callers:>8} {e * 1e6:>13.0f} {s * 1e6:>13.0f} {1 / e:>13.0f} {1 / s:>13.0f} {e / s:>15.2f}")
        elected.kill()
        killed = time.monotonic()
        while not trio.run(answers, standby.address):
            time.sleep(0.02)
        print(f"failover: the standby answered {time.monotonic() - killed:.2f} s after kill -9 of the leader "
              f"(lease TTL 3 s)")
        standby.close()
        if args.load_files:
            seconds = trio.run(commit_files, etcd.urls, "loadtest", args.load_files)
            print(f"committed {args.load_files} files to etcd in {seconds:.1f} s (in-process service, "
                  f"batches of 5000 files)")
            loader = ElectedMaster(root / "loader", etcd, cluster="loadtest").start()
            try:
                deadline = time.monotonic() + 300
                while "loaded" not in loader.log_text() and time.monotonic() < deadline:
                    time.sleep(0.1)
                line = next(line for line in loader.log_text().splitlines() if "loaded" in line)
                print(f"load by a new leader: {line.split('kvfs.master: ')[1]}")
            finally:
                loader.close()
    finally:
        elected.close()
        standby.close()
        single.stop()
        etcd.close()


if __name__ == "__main__":
    main()
