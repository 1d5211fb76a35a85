"""Asynchronous file I/O for trio: io_uring, with a thread-pool fallback.

Callers read into and write from any buffer at any offset; the engine handles
O_DIRECT's 4 KiB alignment itself. Aligned requests on aligned memory go
straight to the kernel; others are bounced through staging buffers, with
read-modify-write for partial pages. Which engine runs is chosen in probe.py.

The io_uring engine needs no thread per request: requests queue SQEs, one
`io_uring_submit` covers every request made in the same scheduler tick, and a
single task waits on an eventfd registered with the ring for completions.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
from dataclasses import dataclass, field
from typing import Callable

import trio

ALIGN = 4096
STAGING_SIZE = 4 << 20
STAGING_COUNT = 8


def _address(buffer: memoryview) -> int | None:
    """The address of a writable buffer (None for read-only memory)."""
    if buffer.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


def _window(start: int, remaining: int, room: int) -> tuple[int, int, int]:
    """The page-aligned span [aligned_start, aligned_end) that covers the next `length`
    bytes from `start` and fits in a staging buffer of `room` bytes."""
    aligned_start = start - start % ALIGN
    length = min(remaining, room - (start - aligned_start))
    return aligned_start, length, -(-(start + length) // ALIGN) * ALIGN


def _is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


class AlignedIo:
    """Alignment handling shared by both engines; subclasses move aligned bytes."""

    kind = "abstract"

    def __init__(self) -> None:
        self._staging_map = mmap.mmap(-1, STAGING_SIZE * STAGING_COUNT)
        staging = memoryview(self._staging_map)
        self._staging_free = [staging[i * STAGING_SIZE : (i + 1) * STAGING_SIZE] for i in range(STAGING_COUNT)]
        self._staging_limit = trio.Semaphore(STAGING_COUNT)

    # Subclasses implement these on aligned (or non-O_DIRECT) requests.
    async def _readv(self, fd: int, offset: int, buffer: memoryview) -> int:
        raise NotImplementedError

    async def _writev(self, fd: int, offset: int, buffer: memoryview) -> int:
        raise NotImplementedError

    async def fsync(self, fd: int) -> None:
        raise NotImplementedError

    @staticmethod
    def _aligned(offset: int, buffer: memoryview) -> bool:
        address = _address(buffer)
        return address is not None and (offset | len(buffer) | address) % ALIGN == 0

    async def read_into(self, fd: int, offset: int, buffer: memoryview) -> int:
        """Reads up to len(buffer) bytes at offset; fewer only at end of file."""
        buffer = memoryview(buffer).cast("B")
        if not _is_direct(fd) or self._aligned(offset, buffer):
            return await self._full(self._readv, fd, offset, buffer)
        done = 0
        async with self._staging() as staging:
            while done < len(buffer):
                start = offset + done
                aligned_start, want, aligned_end = _window(start, len(buffer) - done, len(staging))
                got = await self._full(self._readv, fd, aligned_start, staging[: aligned_end - aligned_start])
                usable = max(0, min(want, got - (start - aligned_start)))
                buffer[done : done + usable] = staging[start - aligned_start : start - aligned_start + usable]
                done += usable
                if usable < want:
                    break
        return done

    async def write_from(self, fd: int, offset: int, data: memoryview | bytes) -> int:
        """Writes all of data at offset."""
        data = memoryview(data).cast("B")
        if not _is_direct(fd) or self._aligned(offset, data):
            return await self._full(self._writev, fd, offset, data)
        size_before = os.fstat(fd).st_size
        done = 0
        async with self._staging() as staging:
            while done < len(data):
                start = offset + done
                aligned_start, length, aligned_end = _window(start, len(data) - done, len(staging))
                window = staging[: aligned_end - aligned_start]
                # Read-modify-write of the partial pages at either end.
                if start != aligned_start or (start + length) % ALIGN:
                    got = await self._full(self._readv, fd, aligned_start, window)
                    window[got:] = bytes(len(window) - got)
                window[start - aligned_start : start - aligned_start + length] = data[done : done + length]
                await self._full(self._writev, fd, aligned_start, window)
                done += length
        end = offset + len(data)
        if end > size_before and end % ALIGN:
            os.ftruncate(fd, end)  # the last page was written whole: trim back to the logical end
        return done

    async def _full(self, operation: Callable, fd: int, offset: int, buffer: memoryview) -> int:
        """Repeats an operation until the buffer is done or it hits end of file."""
        done = 0
        while done < len(buffer):
            count = await operation(fd, offset + done, buffer[done:])
            if count == 0:
                break
            done += count
        return done

    def _staging(self) -> "_StagingLease":
        return _StagingLease(self)


class _StagingLease:
    def __init__(self, engine: AlignedIo) -> None:
        self.engine = engine

    async def __aenter__(self) -> memoryview:
        await self.engine._staging_limit.acquire()
        self.buffer = self.engine._staging_free.pop()
        return self.buffer

    async def __aexit__(self, *exc: object) -> None:
        self.engine._staging_free.append(self.buffer)
        self.engine._staging_limit.release()


@dataclass
class _Pending:
    done: trio.Event = field(default_factory=trio.Event)
    result: int = 0
    keep: object = None  # the buffer must live until the kernel is done with it


FSYNC_DATASYNC = 1  # IORING_FSYNC_DATASYNC
IGNORED_TOKEN = (1 << 64) - 1  # user_data of cancels and no-ops (the binding refuses 0): no request's
TRANSIENT_SUBMIT_ERRORS = frozenset({errno.EAGAIN, errno.EBUSY, errno.EINTR})
REAP_POLL_S = 0.001


class UringEngine(AlignedIo):
    """io_uring driven from trio through liburing: batched submissions, eventfd completions.

    liburing's binding takes buffers as memoryviews, so every request goes to the
    kernel without a copy; fixed (pre-registered) buffers are not used because the
    binding accepts them only as `bytes`.
    """

    kind = "io_uring"

    def __init__(self, entries: int = 256) -> None:
        try:
            import liburing as u
        except ImportError:
            raise
        except Exception as error:  # e.g. its import cache cannot be written (a read-only install):
            raise ImportError(f"{type(error).__name__}: {error}") from error  # reported as not importable

        super().__init__()
        self._u = u
        self._ring = u.io_uring()
        self._cqe = u.io_uring_cqe()
        u.io_uring_queue_init(entries, self._ring, 0)
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._closed = False
        try:
            u.io_uring_register_eventfd(self._ring, self._efd)
        except BaseException:
            self.close()
            raise
        self._pending: dict[int, _Pending] = {}
        self._next_token = 1
        self._unsubmitted = 0

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Delivers completions; runs in the node's nursery for the engine's lifetime."""
        task_status.started()
        while True:
            await trio.lowlevel.wait_readable(self._efd)
            try:
                os.eventfd_read(self._efd)
            except BlockingIOError:
                pass
            self._reap()

    def _reap(self) -> None:
        """Delivers every completion the kernel has posted."""
        u = self._u
        while u.io_uring_peek_cqe(self._ring, self._cqe) == 0:
            entry = self._cqe[0]
            pending = self._pending.pop(entry.user_data, None)
            if pending is not None:
                pending.result = entry.res
                pending.done.set()
            u.io_uring_cqe_seen(self._ring, entry)

    async def _flush(self) -> None:
        """Submits every queued SQE. The kernel's transient refusals (EBUSY: completions not
        yet reaped; EAGAIN; EINTR) are retried, so no request is left queued behind a caller
        that gave up and released its buffer."""
        while self._unsubmitted:
            try:
                self._u.io_uring_submit(self._ring)
            except OSError as error:
                if error.errno not in TRANSIENT_SUBMIT_ERRORS:
                    raise
                self._reap()
                await trio.sleep(REAP_POLL_S)
            else:
                self._unsubmitted = 0

    async def _get_sqe(self) -> object:
        sqe = self._u.io_uring_get_sqe(self._ring)
        while not sqe:  # the submission queue is full: submit it
            await self._flush()
            sqe = self._u.io_uring_get_sqe(self._ring)
            if not sqe:
                await trio.sleep(REAP_POLL_S)
        return sqe

    async def _submit(self, prepare: Callable[[object], object]) -> int:
        sqe = await self._get_sqe()
        try:
            keep = prepare(sqe)
        except BaseException:  # the slot is taken: it must not replay whatever it held before
            self._u.io_uring_prep_nop(sqe)
            sqe.user_data = IGNORED_TOKEN
            self._unsubmitted += 1
            raise
        token = self._next_token
        self._next_token += 1
        pending = self._pending[token] = _Pending(keep=keep)
        sqe.user_data = token
        self._unsubmitted += 1
        try:
            await trio.lowlevel.checkpoint()  # other tasks of this tick add their requests
            await self._flush()
            await pending.done.wait()
        except trio.Cancelled:
            with trio.CancelScope(shield=True):  # the kernel may still touch the buffer
                await self._cancel_and_wait(token, pending)
            raise
        if pending.result < 0:
            raise OSError(-pending.result, os.strerror(-pending.result))
        return pending.result

    async def _cancel_and_wait(self, token: int, pending: _Pending) -> None:
        """Cancels a request in the kernel and waits for its completion. It reaps completions
        itself: when a whole nursery is cancelled, the task running `run` may be gone."""
        if pending.done.is_set():
            return
        sqe = await self._get_sqe()
        self._u.io_uring_prep_cancel64(sqe, token, 0)
        sqe.user_data = IGNORED_TOKEN
        self._unsubmitted += 1
        await self._flush()
        while not pending.done.is_set():
            self._reap()
            with trio.move_on_after(REAP_POLL_S):
                await pending.done.wait()

    async def _readv(self, fd: int, offset: int, buffer: memoryview) -> int:
        def prepare(sqe: object) -> object:
            self._u.io_uring_prep_read(sqe, fd, buffer, len(buffer), offset)
            return buffer

        return await self._submit(prepare)

    async def _writev(self, fd: int, offset: int, buffer: memoryview) -> int:
        def prepare(sqe: object) -> object:
            self._u.io_uring_prep_write(sqe, fd, buffer, len(buffer), offset)
            return buffer

        return await self._submit(prepare)

    async def fsync(self, fd: int) -> None:
        await self._submit(lambda sqe: self._u.io_uring_prep_fsync(sqe, fd, FSYNC_DATASYNC))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._u.io_uring_queue_exit(self._ring)
        os.close(self._efd)


class ThreadEngine(AlignedIo):
    """pread/pwrite in worker threads: only where io_uring is unavailable."""

    kind = "threads"

    def __init__(self) -> None:
        super().__init__()

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    async def _readv(self, fd: int, offset: int, buffer: memoryview) -> int:
        return await trio.to_thread.run_sync(os.preadv, fd, [buffer], offset)

    async def _writev(self, fd: int, offset: int, buffer: memoryview) -> int:
        return await trio.to_thread.run_sync(os.pwritev, fd, [buffer], offset)

    async def fsync(self, fd: int) -> None:
        await trio.to_thread.run_sync(os.fdatasync, fd)

    def close(self) -> None:
        pass
