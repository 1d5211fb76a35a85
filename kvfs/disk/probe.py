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
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import kvfs
from kvfs.disk.engine import AlignedIo, ThreadEngine, UringEngine
from kvfs.errors import ConfigError

log = logging.getLogger(__name__)

# A real machine answers in ~0.2 s; an emulated one (qemu's TCG) in ~20 s. Only a hang waits this long.
PROBE_TIMEOUT_S = 60.0
REASON_PREFIX = "kvfs-probe: "
# A write the kernel refused for want of space ran through the ring: io_uring works.
FULL = (errno.ENOSPC, errno.EDQUOT)


def probe_io_uring(directory: Path | None = None, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when io_uring works in a child process, on a scratch file in `directory` (the SSD
    tier's, so that its file system is proven too; a temporary directory if None); otherwise
    why it does not."""
    try:
        scratch = tempfile.mkdtemp(prefix=".kvfs-probe-", dir=directory)
    except OSError as error:
        if error.errno not in FULL or directory is None:
            return f"cannot write a scratch file in {directory or tempfile.gettempdir()}: {error.strerror}"
        # A full file system (a restart after it filled) says nothing about io_uring: prove
        # the ring elsewhere rather than run the whole life of the daemon on threads.
        return probe_io_uring(None, timeout)
    try:
        return _run_child(Path(scratch) / "probe", timeout)
    finally:  # the parent cleans up: a child killed by a signal cannot
        shutil.rmtree(scratch, ignore_errors=True)


def _run_child(scratch_file: Path, timeout: float) -> str | None:
    # From the directory holding this kvfs, so that the child imports the same one.
    package_parent = Path(kvfs.__file__).resolve().parent.parent
    try:
        child = subprocess.Popen([sys.executable, "-m", "kvfs.disk.probe", str(scratch_file)], cwd=package_parent,
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except OSError as error:
        return f"cannot start the io_uring self-test ({error.strerror})"
    try:
        _, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        try:
            child.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # stuck in the kernel (a failing disk): leave it
            return f"the io_uring self-test hung for {timeout:.0f} s and cannot be killed"
        return f"the io_uring self-test did not finish in {timeout:.0f} s"
    if child.returncode == 0:
        return None
    if child.returncode < 0:
        if -child.returncode == signal.SIGILL:
            return ("the liburing extension died with SIGILL, an instruction this CPU lacks "
                    "(build liburing from source: docs/ssd-tier.md)")
        try:
            name = signal.Signals(-child.returncode).name
        except ValueError:
            name = f"signal {-child.returncode}"
        return f"the io_uring self-test died with {name}"
    reasons = [line[len(REASON_PREFIX):] for line in stderr.decode(errors="replace").splitlines()
               if line.startswith(REASON_PREFIX)]
    return reasons[-1] if reasons else f"the io_uring self-test exited with status {child.returncode}"


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
        return f"io_uring failed: {os.strerror(error.errno)}"
    return str(error)


def _self_test(path: str) -> None:
    """The child's side: one ring, a write, an fsync and a read of a scratch file. Its one
    line of verdict on failure starts with REASON_PREFIX."""
    import trio

    async def exercise(engine: UringEngine, fd: int) -> None:
        payload = os.urandom(64 << 10)
        failure: BaseException | None = None
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            try:
                with trio.fail_after(PROBE_TIMEOUT_S / 2):
                    if await _write_or_full(engine, fd, payload):
                        await engine.fsync(fd)
                        back = bytearray(len(payload))
                        got = await engine.read_into(fd, 0, memoryview(back))
                        if got != len(payload) or back != payload:
                            failure = OSError("io_uring read back different bytes than it wrote")
            except (OSError, trio.TooSlowError) as error:  # out of the nursery as itself, not a group
                failure = error
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    try:
        fd = _open_scratch(path)
    except OSError as error:
        _fail(f"cannot write a scratch file in {os.path.dirname(path)}: {error.strerror}")
    try:
        engine = UringEngine(entries=8)
        try:
            trio.run(exercise, engine, fd)
        finally:
            engine.close()
    except trio.TooSlowError:
        _fail("the io_uring self-test timed out")
    except (ImportError, OSError) as error:
        _fail(_describe(error))
    finally:
        os.close(fd)


async def _write_or_full(engine: UringEngine, fd: int, payload: bytes) -> bool:
    """Writes the payload; False if the file system is full (the kernel answered through the
    ring, which is all the test asks: a restart on a full disk keeps io_uring)."""
    try:
        await engine.write_from(fd, 0, payload)
    except OSError as error:
        if error.errno in FULL:
            return False
        raise
    return True


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


def _fail(reason: str) -> NoReturn:
    print(REASON_PREFIX + reason, file=sys.stderr)
    raise SystemExit(1)


if __name__ == "__main__":
    _self_test(sys.argv[1])
