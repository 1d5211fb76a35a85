"""Failover time of `kvfs master --etcd` with many files: a hot standby (kept up with the
leader's commits, kvfs.net.follow) against a cold one (started after the leader died, so
it loads the whole state from etcd), side by side in one run, for each size.

For each size N a cluster of its own in one etcd on loopback (3 members, or --etcd-members) (tests/etcd.py) is
seeded with N sealed files (N/1000 directories of 1000): an in-process metadata service
makes them and the bench commits their records every 50,000 files with EtcdState's
txn split, in txns of 2048 records (etcd started with --max-txn-ops 4096; a leader's
own are 128) with the counters first, as a leader writes them, then 8 txns in flight,
and the counters once more at the end, as the leader's next commit would; under a
leader key made for it and removed after. Then a round:
  1. a leader starts and loads the N files (its log's load time is the restart time);
     a standby starts and loads them too;
  2. a node creates FOLLOW files through the leader (16 callers) while the standby
     follows; the standby's CPU seconds and RSS then are sampled from /proc;
  3. hot: kill -9 of the leader; the time until the standby answers a Lookup of the last
     directory made and Stats counts every file the leader counted before the kill;
  4. cold: kill -9 of that new leader, a fresh master started right after; the same time.
Rounds alternate which of hot and cold runs first (the cold one then goes against the
seeded leader, and the hot one against the cold master once it leads); the table shows
medians and the ratio cold/hot of the same run. Times from the kill include the lease
TTL (the wait until the dead leader's key expires); "serving after election" is the part
after the new leader's election, from its log.

Usage: python scripts/bench_failover.py [--sizes 100000,1000000] [--rounds 2] [--follow 5000]
                                        [--etcd-members 3]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import trio  # noqa: E402

from bench_master_etcd import create_files  # noqa: E402
from conftest import load_tls  # noqa: E402
from etcd import ElectedMaster, EtcdCluster  # noqa: E402
from kvfs.clock import SystemClock  # noqa: E402
from kvfs.cluster.master import MasterSettings, MetadataService  # noqa: E402
from kvfs.cluster.namespace import ROOT_INO  # noqa: E402
from kvfs.cluster.records import Change, Kind  # noqa: E402
from kvfs.net.etcd import EtcdClient, create_revision_is, delete, leader_key, put  # noqa: E402
from kvfs.net.etcdstate import EtcdState, split  # noqa: E402
from kvfs.net.rpc import RemoteMaster  # noqa: E402
from kvfs.policy import LruPolicy  # noqa: E402
from kvfs.wire import messages as m  # noqa: E402

TTL = 3  # the masters' lease TTL (the default)
PER_DIR = 1000
SEED_COMMIT = 50_000  # files a seeding commit
SEED_TXN_OPS = 2048  # records a seeding txn (etcd is started to take them: --max-txn-ops)
ETCD_FLAGS = ("--max-txn-ops", "4096", "--max-request-bytes", str(16 << 20), "--quota-backend-bytes", str(8 << 30))


async def seed(endpoints: list[str], cluster: str, files: int) -> float:
    """Writes FILES sealed files as cluster CLUSTER's state; seconds it took."""
    client = EtcdClient(endpoints, timeout_s=30.0)
    key = leader_key(cluster)
    _, epoch, _ = await client.txn([create_revision_is(key, 0)], [put(key, b"{}")])
    service = MetadataService(SystemClock(), LruPolicy(), MasterSettings(cluster=True))
    node = service.handle(m.Register("seed", "127.0.0.1:7000"), 0).node
    service.handle(m.Report([]), node)
    service.handle(m.FinishRegistration(), node)
    state = EtcdState(client, cluster)
    fence = [create_revision_is(key, epoch)]

    async def write(part: list[Change]) -> None:
        ok, _, _ = await client.txn(fence, [put(state.key(c.kind, c.number), c.value or b"") for c in part])
        assert ok

    async def commit() -> list[Change]:
        """One commit of what changed since the last, as a leader's: the counters first."""
        batch = state.take(service)
        assert batch is not None
        parts = split(batch.changes, max_ops=SEED_TXN_OPS, max_bytes=SEED_TXN_OPS * 400)
        await write(parts.pop(0))

        async def writer() -> None:
            while parts:
                await write(parts.pop())

        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(writer)
        return [c for c in batch.changes if c.kind is Kind.COUNTERS]

    started = time.perf_counter()
    directory = 0
    for i in range(files):
        if i % PER_DIR == 0:
            directory = service.handle(m.MkDir(ROOT_INO, b"s%05d" % (i // PER_DIR), 0o755, 0, 0), node).ino
        opened = service.handle(m.Create(directory, b"f%04d" % (i % PER_DIR), 0o644, 0, 0, node, True), node)
        service.handle(m.Seal(opened.version, 4096, time.time_ns(), []), node)
        service.handle(m.Release(opened.version, True), node)
        if i % SEED_COMMIT == SEED_COMMIT - 1 or i == files - 1:  # (a bounded batch in memory at a time)
            counters = await commit()
    await write(counters)  # again, as the leader's next commit would: the last seeded commit is complete
    await client.txn([], [delete(key)])
    await client.aclose()
    return time.perf_counter() - started


async def connect(address: str, nursery: trio.Nursery, timeout_s: float = 5.0) -> RemoteMaster:
    host, port = address.rsplit(":", 1)
    return await RemoteMaster.connect(host, int(port), load_tls("bench", "node"), nursery, request_timeout_s=timeout_s)


async def file_count(address: str) -> int:
    async with trio.open_nursery() as nursery:
        remote = await connect(address, nursery, 30.0)
        try:
            return (await remote.call(m.Stats())).files
        finally:
            await remote.aclose()


async def serves(address: str, marker: bytes, files: int) -> bool:
    """Whether the master answers a Lookup of MARKER and counts FILES files."""
    try:
        async with trio.open_nursery() as nursery:
            remote = await connect(address, nursery, 2.0)
            try:
                found = await remote.call(m.Lookup(ROOT_INO, marker))
                stats = await remote.call(m.Stats())
            finally:
                await remote.aclose()
        return found.attr is not None and stats.files == files
    except BaseException as error:  # refused, closed, not listening (an ExceptionGroup from the nursery)
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        return False


def wait_serving(master: ElectedMaster, marker: bytes, files: int, since: float, limit_s: float = 900) -> float:
    while not trio.run(serves, master.address, marker, files):
        if time.monotonic() - since > limit_s:
            raise RuntimeError(f"no answer within {limit_s} s:\n{master.log_text()[-3000:]}")
        time.sleep(0.02)
    return time.monotonic() - since


def wait_log(master: ElectedMaster, pattern: str, limit_s: float = 900) -> re.Match[str]:
    deadline = time.monotonic() + limit_s
    while True:
        found = re.search(pattern, master.log_text())
        if found:
            return found
        if time.monotonic() > deadline or (master.process is not None and master.process.poll() is not None):
            raise RuntimeError(f"{pattern!r} not in the log:\n{master.log_text()[-3000:]}")
        time.sleep(0.1)


def proc(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS bytes) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    rss_pages = int(fields[21])
    return (int(fields[11]) + int(fields[12])) / ticks, rss_pages * os.sysconf("SC_PAGE_SIZE")


def after_election(master: ElectedMaster) -> float:
    """Seconds from the election to serving, from the new leader's log (catch-up or load)."""
    found = re.search(r"caught up \d+ records at the election in ([\d.]+) s|loaded \d+ files, \d+ nodes from "
                      r"etcd in ([\d.]+) s", master.log_text())
    assert found, master.log_text()[-2000:]
    return float(found.group(1) or found.group(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="100000,1000000")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--follow", type=int, default=5000, help="files created while the standby follows")
    parser.add_argument("--etcd-members", type=int, default=3, help="1 saves memory at 1M files")
    args = parser.parse_args()
    # Should the machine run out of memory, this bench and its children (etcd, masters: it is
    # inherited) are the ones the kernel kills, not another program.
    Path("/proc/self/oom_score_adj").write_text("1000")
    root = Path(tempfile.mkdtemp(prefix="kvfs-bench-failover-"))
    etcd = EtcdCluster(root, members=args.etcd_members, flags=ETCD_FLAGS)
    print(f"etcd: {args.etcd_members} members healthy in {etcd.start_s:.1f} s; lease TTL {TTL} s")
    rows = []
    serial = 0
    try:
        for size in (int(s) for s in args.sizes.split(",")):
            cluster = f"f{size}"
            seconds = trio.run(seed, etcd.urls, cluster, size)
            print(f"\n{size} files: seeded in {seconds:.1f} s ({size * 2 / seconds:.0f} records/s)", flush=True)
            times: dict[str, list[float]] = {"hot": [], "cold": []}
            elected: dict[str, list[float]] = {"hot": [], "cold": []}

            def new_master() -> ElectedMaster:
                nonlocal serial
                serial += 1
                return ElectedMaster(root / f"m{serial}", etcd, cluster=cluster, lease_ttl=TTL).start()

            current = new_master()
            spare: ElectedMaster | None = None
            # (a first master's load is its standby load, which it finishes once it is elected)
            found = wait_log(current, r"loaded (\d+) files(?:, \d+ nodes)? from etcd in ([\d.]+) s")
            print(f"  restart (a leader's load of the state): {found.group(2)} s", flush=True)
            try:
                for round_ in range(args.rounds):
                    order = ["hot", "cold"] if round_ % 2 == 0 else ["cold", "hot"]
                    for kind in order:
                        marker = b"r%d-%s" % (round_, kind.encode())
                        standby = new_master() if kind == "hot" else None
                        spare = standby  # closed on the way out, should this round fail
                        if standby is not None:
                            load = wait_log(standby, r"standby: loaded \d+ files from etcd in ([\d.]+) s")
                            cpu0, _ = proc(standby.process.pid)  # type: ignore[union-attr]
                            leader_cpu0, _ = proc(current.process.pid)  # type: ignore[union-attr]
                        created = trio.run(create_files, current.address, marker.decode(), args.follow, 16, 60.0, True)
                        total = trio.run(file_count, current.address)  # the namespace the new leader must show
                        if standby is not None:
                            time.sleep(0.5)  # the last commits reach the standby
                            cpu1, rss = proc(standby.process.pid)  # type: ignore[union-attr]
                            leader_cpu1, leader_rss = proc(current.process.pid)  # type: ignore[union-attr]
                            print(f"  standby: loaded in {load.group(1)} s; following {args.follow} creates "
                                  f"({created:.1f} s): {cpu1 - cpu0:.2f} CPU s ({(cpu1 - cpu0) / created:.0%} of a "
                                  f"core; the leader {leader_cpu1 - leader_cpu0:.2f} CPU s), RSS {rss >> 20} MiB "
                                  f"(the leader {leader_rss >> 20} MiB)", flush=True)
                        current.kill()
                        killed = time.monotonic()
                        if standby is None:
                            standby = new_master()
                        took = wait_serving(standby, marker + b"-done", total, killed)
                        times[kind].append(took)
                        elected[kind].append(after_election(standby))
                        print(f"  round {round_} {kind}: serving {took:.2f} s after kill -9, "
                              f"{elected[kind][-1]:.3f} s after its election", flush=True)
                        current.close()
                        current = standby
            finally:
                current.close()
                if spare is not None:
                    spare.close()
            hot, cold = statistics.median(times["hot"]), statistics.median(times["cold"])
            rows.append((size, hot, cold, statistics.median(elected["hot"]), statistics.median(elected["cold"])))
        print(f"\nmedians over {args.rounds} rounds (lease TTL {TTL} s):")
        print(f"{'files':>9} {'hot s':>7} {'cold s':>7} {'cold/hot':>9} {'hot after election s':>21} "
              f"{'cold after election s':>22}")
        for size, hot, cold, hot_e, cold_e in rows:
            print(f"{size:>9} {hot:>7.2f} {cold:>7.2f} {cold / hot:>9.1f} {hot_e:>21.3f} {cold_e:>22.2f}")
    finally:
        etcd.close()


if __name__ == "__main__":
    main()
