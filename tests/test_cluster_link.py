"""A node's link to a real `kvfs master` process that stops answering (SIGSTOP): every request
is bounded by the link's wait, the silent connection is replaced, and the link comes back.
With etcd:// (a real 3-member etcd on loopback): the master etcd names is used only if its
Welcome's epoch is not below the epoch etcd gave, and etcd naming nobody or answering not at
all fails requests within the same wait as an unreachable master."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import trio
from conftest import MasterDaemon, load_tls

from kvfs.config import DEFAULT_CLUSTER, MasterTarget, parse_master
from kvfs.errors import ConfigError
from kvfs.net.etcd import EtcdClient, leader_key, leader_value, put
from kvfs.net.link import MasterLink
from kvfs.net.rpc import MasterUnavailable, RemoteMaster
from kvfs.wire import messages as m

WAIT_S = 1.5  # the link's --master-wait
SLACK_S = 1.0  # scheduling on a loaded machine


async def join(remote: RemoteMaster) -> None:
    await remote.call(m.Register("link-test", "127.0.0.1:1"))
    await remote.call(m.Report([]))
    await remote.call(m.FinishRegistration())


def test_a_silent_master_fails_requests_within_the_wait_and_the_link_comes_back(tmp_path: Path) -> None:
    master = MasterDaemon(tmp_path)
    master.start()
    process = master.process
    assert process is not None
    timings: dict[str, float] = {}
    errors: dict[str, str] = {}

    async def main() -> None:
        link = MasterLink(master.address, load_tls("link-test"), join, wait_s=WAIT_S)
        async with trio.open_nursery() as nursery:
            await nursery.start(link.run)
            await link.call(m.Stats())
            os.kill(process.pid, signal.SIGSTOP)
            try:
                for name in ("silent", "down", "down, told not to wait"):
                    started = trio.current_time()
                    with trio.move_on_after(WAIT_S + 10):  # (a request without a deadline waits forever)
                        try:
                            await link.call(m.Stats(), wait_s=0 if name.endswith("wait") else None)
                            errors[name] = "succeeded"
                        except MasterUnavailable as error:
                            errors[name] = str(error)
                    timings[name] = trio.current_time() - started
                    if name == "silent":
                        assert not link.connected, "the silent connection was not given up"
            finally:
                os.kill(process.pid, signal.SIGCONT)
            with trio.fail_after(15):  # the link reconnects and registers again by itself
                while not link.connected:
                    await trio.sleep(0.05)
            await link.call(m.Stats())
            nursery.cancel_scope.cancel()

    try:
        trio.run(main)
    finally:
        master.stop()
    print("\n" + "\n".join(f"{name}: {errors.get(name, 'no answer')} after {timings[name]:.2f} s" for name in timings))
    assert WAIT_S - 0.1 <= timings["silent"] <= WAIT_S + SLACK_S  # the request's own deadline
    assert "no answer from the master within 1.5 s" in errors["silent"]
    assert timings["down"] <= SLACK_S  # the master has been unheard for the whole wait already
    assert timings["down, told not to wait"] <= SLACK_S
    assert "unreachable" in errors["down"]


def test_master_addresses_parse() -> None:
    assert parse_master("10.0.0.1:7400") == MasterTarget(address="10.0.0.1:7400")
    target = parse_master("etcd://10.0.0.1:2379,10.0.0.2:2379/prod")
    assert target == MasterTarget(etcd=("10.0.0.1:2379", "10.0.0.2:2379"), cluster="prod")
    assert target.endpoints == ["http://10.0.0.1:2379", "http://10.0.0.2:2379"]
    assert parse_master("etcd://h:1").cluster == DEFAULT_CLUSTER
    for bad, why in [("master", "not HOST:PORT"), ("etcd://", "names no etcd member"),
                     ("etcd://h:1,h/x", "'h' is not HOST:PORT"), ("etcd://h:1/a b", "not a cluster name")]:
        with pytest.raises(ConfigError, match=why):
            parse_master(bad)


def link_outcome(address: str, links: list[MasterLink]) -> tuple[str, float]:
    """What one request through a new link to `address` (appended to `links`) does while the
    link cannot come up, and how long it takes."""
    async def main() -> tuple[str, float]:
        link = MasterLink(address, load_tls("link-test"), join, wait_s=WAIT_S)
        links.append(link)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.run)
            started = trio.current_time()
            try:
                with trio.fail_after(WAIT_S + 10):
                    await link.call(m.Stats())
                outcome = "answered"
            except MasterUnavailable as error:
                outcome = str(error)
            nursery.cancel_scope.cancel()
            return outcome, trio.current_time() - started
    return trio.run(main)


def test_etcd_naming_a_master_of_an_older_epoch_or_none_or_unreachable_fails_within_the_wait(
        tmp_path: Path, etcd_cluster, caplog) -> None:  # type: ignore[no-untyped-def]
    """A single master's Welcome says epoch 0: named by etcd (whose epochs start above 0) it is
    a master that was not elected, refused like a deposed leader; no leader named and etcd
    unreachable both fail the request after the wait, as an unreachable master does."""
    master = MasterDaemon(tmp_path)
    master.start()
    address = f"etcd://{','.join(url.removeprefix('http://') for url in etcd_cluster.urls)}/link-test"

    async def name_leader() -> int:
        client = EtcdClient(etcd_cluster.urls)
        try:
            _, revision, _ = await client.txn([], [put(leader_key("link-test"), leader_value(master.address, "m"))])
            return revision
        finally:
            await client.aclose()

    try:
        links: list[MasterLink] = []
        unnamed, unnamed_s = link_outcome(address, links)
        epoch = trio.run(name_leader)
        with caplog.at_level("WARNING", logger="kvfs.net.link"):
            stale, stale_s = link_outcome(address, links)
        for i in range(3):
            etcd_cluster.kill(i)
        gone, gone_s = link_outcome(address, links)
    finally:
        master.stop()
    print(f"\nno leader named: {unnamed} after {unnamed_s:.2f} s\nepoch 0 named at epoch {epoch}: {stale} after "
          f"{stale_s:.2f} s\netcd down: {gone} after {gone_s:.2f} s")
    for outcome, seconds in ((unnamed, unnamed_s), (stale, stale_s), (gone, gone_s)):
        assert "unreachable" in outcome
        assert WAIT_S - 0.1 <= seconds <= WAIT_S + SLACK_S
    assert links[1].refused_stale >= 1 and links[1].epoch == epoch
    assert f"its epoch 0 is below epoch {epoch}" in caplog.text
    assert "registered as node" not in master.log_text()  # the refused master was never registered with
