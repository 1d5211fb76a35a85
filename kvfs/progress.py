"""Start-up progress, told everywhere an operator may be looking: the log, systemd's
STATUS= (`systemctl status`), and the terminal of a background `kvfs mount`."""

from __future__ import annotations

import logging
import time
from typing import Callable

from kvfs import systemd

_listeners: list[Callable[[str, int], None]] = []


def report(message: str, logger: logging.Logger, level: int = logging.INFO) -> None:
    """One step of a start that takes a while (safe from any thread)."""
    logger.log(level, "%s", message)
    systemd.notify(f"STATUS={message}")
    for listener in list(_listeners):
        listener(message, level)


def listen(callback: Callable[[str, int], None]) -> None:
    """Calls `callback(message, level)` for every report from now on."""
    _listeners.append(callback)


def stop_listening() -> None:
    _listeners.clear()


class Every:
    """Paces progress lines: `due()` is true at most once per `seconds`, counted from
    creation and then from the last time it was true."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._last = time.monotonic()

    def due(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.seconds:
            return False
        self._last = now
        return True
