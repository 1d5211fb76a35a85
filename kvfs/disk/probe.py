"""Choosing the SSD I/O engine: io_uring only once it is proven in a child process.

A native extension built for instructions this CPU lacks dies with SIGILL, which
no handler can catch, and io_uring may be disabled by the kernel
(`kernel.io_uring_disabled`) or refused by a seccomp filter. So before the
daemon relies on io_uring, a child process runs the very engine it would use on
a scratch file (write, fsync, read back, compare); only if the child exits
cleanly does the daemon open a ring itself.
"""

from __future__ import annotations

import errno
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

# A real machine answers in ~0.2 s; an emulated one (qemu's TCG) in ~20 s. Only a hang waits this long.
PROBE_TIMEOUT_S = 60.0


def probe_io_uring(directory: Path | None = None, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when io_uring works in a child process, on a scratch file in `directory` (the SSD
    tier's, so that its file system is proven too; a temporary directory if None); otherwise
    why it does not."""
    # The child imports this kvfs even if the daemon's working directory changed since it started.
    package_parent = str(Path(kvfs.__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": (path + os.pathsep if path else "") + package_parent}
    try:
        command = [sys.executable, "-m", "kvfs.disk.probe"] + ([str(directory)] if directory is not None else [])
        child = subprocess.run(command, env=env, timeout=timeout,
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


def open_engine(io_engine: str = "auto", directory: Path | None = None) -> AlignedIo:
    """The engine `io_engine` names, for files in `directory`. `auto` falls back to threads
    with one WARNING that says why; `io_uring` refuses to start without it (ConfigError)."""
    if io_engine == "threads":
        return ThreadEngine()
    reason = probe_io_uring(directory)
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


def _self_test(directory: str | None) -> None:
    """The child's side: one ring, a write, an fsync and a read of a scratch file."""
    import trio

    async def exercise(engine: UringEngine, fd: int) -> None:
        payload = os.urandom(64 << 10)
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

    try:
        scratch = tempfile.TemporaryDirectory(prefix=".kvfs-probe-", dir=directory)
        fd = _open_scratch(os.path.join(scratch.name, "probe"))
    except OSError as error:
        print(f"cannot write a scratch file in {directory or tempfile.gettempdir()}: {error.strerror}",
              file=sys.stderr)
        raise SystemExit(1)
    try:
        engine = UringEngine(entries=8)
        try:
            trio.run(exercise, engine, fd)
        finally:
            engine.close()
    except (ImportError, OSError, trio.TooSlowError) as error:
        reason = "the io_uring self-test timed out" if isinstance(error, trio.TooSlowError) else _describe(error)
        print(reason, file=sys.stderr)
        raise SystemExit(1)
    finally:
        os.close(fd)
        scratch.cleanup()


def _open_scratch(path: str) -> int:
    """O_DIRECT as the SSD tier opens its segments, where the file system allows it (one that
    does not may refuse only after creating the file: no O_EXCL)."""
    flags = os.O_RDWR | os.O_CREAT
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return os.open(path, flags, 0o600)


if __name__ == "__main__":
    _self_test(sys.argv[1] if len(sys.argv) > 1 else None)
