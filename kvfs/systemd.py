"""The systemd service protocol, without libsystemd: readiness, stopping, watchdog.

Under `Type=notify` systemd passes a datagram socket in `NOTIFY_SOCKET`; a
daemon reports `READY=1` when it serves (here: when the mount answers),
`STOPPING=1` when it begins to stop, and `WATCHDOG=1` at least every
`WATCHDOG_USEC` when the unit sets `WatchdogSec=`. Outside systemd every call
is a no-op.
"""

from __future__ import annotations

import logging
import os
import socket

import trio

log = logging.getLogger("kvfs.systemd")


def notify(message: str) -> bool:
    """Sends one state change to systemd; False when not run by systemd (or it failed)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
        return True
    except OSError as error:
        log.warning("cannot notify systemd at %s: %s", os.environ.get("NOTIFY_SOCKET"), error)
        return False


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half of what the unit allows), None without a watchdog."""
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2e6


async def keep_watchdog_fed() -> None:
    """Pings the watchdog from the event loop: a loop that hangs stops the pings, and systemd
    restarts the service."""
    interval = watchdog_interval()
    if interval is None:
        return
    while True:
        notify("WATCHDOG=1")
        await trio.sleep(interval)
