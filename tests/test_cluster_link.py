"""A node's link to a real `kvfs master` process that stops answering (SIGSTOP): every request
is bounded by the link's wait, the silent connection is replaced, and the link comes back."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import trio
from conftest import MasterDaemon, load_tls

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
