"""The metrics HTTP endpoint: prometheus-client's server, fed from the trio event loop.

Counters are plain attributes updated by the event loop; a scrape arrives on
the server's thread and asks the loop for a snapshot (`trio.from_thread`), so
it never reads a dictionary while the loop changes it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable

import trio
from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import Metric

from kvfs.config import split_address
from kvfs.metrics.families import Families

log = logging.getLogger("kvfs.metrics")

Describe = Callable[[Families], None]


class _LoopCollector:
    def __init__(self, describe: Describe, token: trio.lowlevel.TrioToken) -> None:
        self._describe_families = describe  # not `describe`: prometheus-client calls that one at registration
        self.token = token

    def _snapshot(self) -> list[Metric]:
        families = Families()
        self._describe_families(families)
        return families.metrics

    def collect(self) -> list[Metric]:
        try:
            return trio.from_thread.run_sync(self._snapshot, trio_token=self.token)
        except trio.RunFinishedError:  # stopping: an empty scrape rather than an error page
            return []


async def serve_metrics(listen: str, describe: Describe,
                        task_status: trio.TaskStatus[int | None] = trio.TASK_STATUS_IGNORED) -> None:
    """Serves GET /metrics on HOST:PORT until cancelled; reports the bound port, or None
    when it cannot bind (logged: metrics are not worth failing the mount for)."""
    host, port = split_address(listen)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_LoopCollector(describe, trio.lowlevel.current_trio_token()))  # type: ignore[arg-type]
    ProcessCollector(registry=registry)  # CPU seconds, resident memory, open fds of this process
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        log.error("metrics: cannot listen on %s: %s; serving without metrics", listen, error.strerror or error)
        task_status.started(None)
        return
    bound = server.server_port
    log.info("metrics on http://%s:%d/metrics", host or "0.0.0.0", bound)
    task_status.started(bound)
    try:
        await trio.sleep_forever()
    finally:
        # shutdown() waits up to the server's 0.5 s poll: not on the event loop, which is stopping.
        threading.Thread(target=_stop_server, args=(server,), name="metrics-stop", daemon=True).start()


def _stop_server(server: Any) -> None:
    server.shutdown()
    server.server_close()
