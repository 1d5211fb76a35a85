"""An answer the master sends after its request's deadline passed: dropped, and the
connection goes on serving (the other requests in flight, the ones after).

The master runs in a thread of its own, so that holding its event loop (the handler
blocked on an event the test sets) delays its answers and nothing else."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from conftest import load_tls
from kvfs.clock import ManualClock
from kvfs.cluster.master import MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.net.rpc import MasterUnavailable, MetadataServer, RemoteMaster
from kvfs.policy import LruPolicy
from kvfs.wire import messages as m

MASTER = load_tls("master", "master")
NODE = load_tls("node1")
HELD = b"held.bin"  # the name whose lookup the master's handler holds


class HeldMaster:
    """A real master (service and server) on loopback in its own thread and trio loop;
    its handler blocks on `release` when asked to look HELD up."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.service = MetadataService(ManualClock(), LruPolicy())
        self.port: int | None = None
        self._started = threading.Event()
        self._stop: trio.CancelScope | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    def handle(self, request: m.Request, node: int) -> object:
        if isinstance(request, m.Lookup) and request.name == HELD:
            assert self.release.wait(timeout=30), "the test never released the held lookup"
        return self.service.handle(request, node)

    async def _main(self) -> None:
        server = MetadataServer(self.handle, MASTER, self.service)
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            self._stop = nursery.cancel_scope
            self.port = await nursery.start(server.serve, "127.0.0.1", 0)
            self._started.set()

    def __enter__(self) -> "HeldMaster":
        self._thread.start()
        assert self._started.wait(timeout=10), "the master did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        assert self._token is not None and self._stop is not None
        trio.from_thread.run_sync(self._stop.cancel, trio_token=self._token)
        self._thread.join(timeout=10)


def test_an_answer_after_its_deadline_is_dropped_and_the_connection_goes_on() -> None:
    with HeldMaster() as held:

        async def main() -> None:
            async with trio.open_nursery() as nursery:
                master = await RemoteMaster.connect("127.0.0.1", held.port, NODE, nursery, request_timeout_s=30)
                node = (await master.call(m.Register("node1", "127.0.0.1:1"))).node
                await master.call(m.Report([]))
                await master.call(m.FinishRegistration())
                await master.call(m.Create(ROOT_INO, b"k.bin", 0o644, 0, 0, node, True))

                with pytest.raises(MasterUnavailable, match="within 0.2 s"):
                    await master.call(m.Lookup(ROOT_INO, HELD), timeout_s=0.2)
                # Sent behind the held one: waiting in the master's socket until it is released.
                behind = trio.Event()
                found: list[m.Entry] = []

                async def lookup_behind() -> None:
                    found.append(await master.call(m.Lookup(ROOT_INO, b"k.bin")))
                    behind.set()

                nursery.start_soon(lookup_behind)
                await trio.testing.wait_all_tasks_blocked()
                held.release.set()  # the late answer (ENOENT for HELD), then the one behind it
                with trio.fail_after(10):
                    await behind.wait()
                assert found[0].attr.ino > ROOT_INO
                assert master.broken is None, f"the connection was given up: {master.broken}"
                again = await master.call(m.Lookup(ROOT_INO, b"k.bin"))  # the same connection still answers
                assert again.attr.ino == found[0].attr.ino
                assert master.late_answers == 1
                await master.aclose()
                nursery.cancel_scope.cancel()

        trio.run(main)

