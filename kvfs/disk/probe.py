"""Choosing the SSD I/O engine: io_uring only once it is proven in a child process.

A native extension built for instructions this CPU lacks dies with SIGILL, which
no handler can catch, and io_uring may be disabled by the kernel
(`kernel.io_uring_disabled`) or refused by a seccomp filter. So before the
daemon relies on io_uring, a child process runs the very engine it would use on
a scratch file (write, fsync, read back, compare); only if the child exits
cleanly does the daemon open a ring itself.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import kvfs
from kvfs.disk.engine import AlignedIo, ThreadEngine, UringEngine
from kvfs.errors import ConfigError

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 10.0


def probe_io_uring(timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when io_uring works in a child process; otherwise why it does not."""
    # The child imports this kvfs even if the daemon's working directory changed since it started.
    package_parent = str(Path(kvfs.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": (path + os.pathsep if path else "") + package_parent}
    try:
        child = subprocess.run([sys.executable, "-m", "kvfs.disk.probe"], env=env, timeout=timeout,
                               stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except subprocess.TimeoutExpired:
        return f"the io_uring self-test did not finish in {timeout:.0f} s"
    except OSError as error:
        return f"cannot start the io_uring self-test ({error.strerror})"
    if child.returncode == 0:
        return None
    if child.returncode < 0:
        number = -child.returncode
        name = signal.Signals(number).name if number in signal.Signals._value2member_map_ else f"signal {number}"
        if number == signal.SIGILL:
            return ("the liburing extension died with SIGILL, an instruction this CPU lacks "
                    "(build liburing from source: docs/ssd-tier.md)")
        return f"the io_uring self-test died with {name}"
    lines = child.stderr.decode(errors="replace").strip().splitlines()
    return lines[-1] if lines else f"the io_uring self-test exited with {child.returncode}"


def open_engine(io_engine: str = "auto") -> AlignedIo:
    """The engine `io_engine` names. `auto` falls back to threads with one WARNING that says
    why; `io_uring` refuses to start without it (ConfigError)."""
    if io_engine == "threads":
        return ThreadEngine()
    reason = probe_io_uring()
    if reason is None:
        try:
            return UringEngine()
        except (ImportError, OSError) as error:
            reason = _describe(error)
    if io_engine == "io_uring":
        raise ConfigError(f"io_engine io_uring: unavailable here: {reason}")
    log.warning("io_uring is unavailable, using a thread pool for SSD I/O: %s", reason)
    return ThreadEngine()


def _describe(error: BaseException) -> str:
    if isinstance(error, ImportError):
        return f"liburing is not importable: {error}"
    if isinstance(error, OSError) and error.errno:
        return f"io_uring setup failed: {os.strerror(error.errno)}"
    return str(error)


def _self_test() -> None:
    """The child's side: one ring, a write, an fsync and a read of a scratch file."""
    import trio

    async def exercise(engine: UringEngine, path: str) -> None:
        payload = os.urandom(64 << 10)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                with trio.fail_after(PROBE_TIMEOUT_S / 2):
                    await engine.write_from(fd, 0, payload)
                    await engine.fsync(fd)
                    back = bytearray(len(payload))
                    got = await engine.read_into(fd, 0, memoryview(back))
                if got != len(payload) or back != payload:
                    raise OSError(0, "io_uring read back different bytes than it wrote")
                nursery.cancel_scope.cancel()
        finally:
            os.close(fd)

    with tempfile.TemporaryDirectory(prefix="kvfs-probe-") as scratch:
        try:
            engine = UringEngine(entries=8)
            try:
                trio.run(exercise, engine, os.path.join(scratch, "probe"))
            finally:
                engine.close()
        except (ImportError, OSError, trio.TooSlowError) as error:
            reason = "the io_uring self-test timed out" if isinstance(error, trio.TooSlowError) else _describe(error)
            print(reason, file=sys.stderr)
            raise SystemExit(1)


if __name__ == "__main__":
    _self_test()
