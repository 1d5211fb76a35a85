"""The I/O engines on a real disk with real io_uring: alignment, batches, errors, cancellation."""

from __future__ import annotations

import errno
import functools
import mmap
import os
import random
import threading
from pathlib import Path

import pytest
import trio

from conftest import small_tmpfs
from kvfs.concurrency import run_all
from kvfs.disk.engine import ThreadEngine, UringEngine

ENGINES = [UringEngine, ThreadEngine]


def run_with(engine_class, test):
    async def main():
        engine = engine_class()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                await test(engine)
                nursery.cancel_scope.cancel()
        finally:
            engine.close()

    trio.run(main)


def open_direct(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)


@pytest.mark.parametrize("engine_class", ENGINES)
def test_unaligned_reads_and_writes_match_plain_io(tmp_path: Path, engine_class) -> None:
    path = tmp_path / "data"
    reference = bytearray(os.urandom(3 << 20))
    path.write_bytes(reference)
    rng = random.Random(1)

    async def test(engine):
        fd = open_direct(path)
        try:
            for _ in range(60):
                offset = rng.randrange(0, len(reference) - 1)
                length = rng.randrange(1, min(600_000, len(reference) - offset) + 1)
                if rng.random() < 0.5:
                    data = os.urandom(length)
                    assert await engine.write_from(fd, offset, data) == length
                    reference[offset : offset + length] = data
                else:
                    target = bytearray(length)
                    assert await engine.read_into(fd, offset, memoryview(target)) == length
                    assert target == reference[offset : offset + length]
        finally:
            os.close(fd)

    run_with(engine_class, test)
    assert path.read_bytes() == reference


@pytest.mark.parametrize("engine_class", ENGINES)
def test_aligned_io_into_mapped_memory_and_batches(tmp_path: Path, engine_class) -> None:
    arena = mmap.mmap(-1, 16 << 20)
    view = memoryview(arena)
    view[: 8 << 20] = os.urandom(8 << 20)
    path = tmp_path / "segment"

    async def test(engine):
        fd = open_direct(path)
        os.posix_fallocate(fd, 0, 8 << 20)
        try:
            await run_all(functools.partial(engine.write_from, fd, i << 20, view[i << 20 : (i + 1) << 20])
                          for i in range(8))  # 8 writes in flight at once
            await engine.fsync(fd)
            await run_all(functools.partial(engine.read_into, fd, i << 20, view[(8 + i) << 20 : (9 + i) << 20])
                          for i in range(8))
        finally:
            os.close(fd)

    run_with(engine_class, test)
    assert view[8 << 20 :] == view[: 8 << 20]
    assert path.read_bytes() == bytes(view[: 8 << 20])


@pytest.mark.parametrize("engine_class", ENGINES)
def test_short_files_and_unaligned_tail(tmp_path: Path, engine_class) -> None:
    path = tmp_path / "short"
    path.write_bytes(b"0123456789")

    async def test(engine):
        fd = open_direct(path)
        try:
            target = bytearray(100)
            assert await engine.read_into(fd, 3, memoryview(target)) == 7
            assert target[:7] == b"3456789"
            assert await engine.read_into(fd, 5000, memoryview(bytearray(10))) == 0
            assert await engine.write_from(fd, 10, b"abc") == 3
        finally:
            os.close(fd)

    run_with(engine_class, test)
    assert path.read_bytes() == b"0123456789abc"  # padding of the last page was trimmed


@pytest.mark.parametrize("engine_class", ENGINES)
def test_errors_are_raised_as_oserror(tmp_path: Path, engine_class) -> None:
    with small_tmpfs(tmp_path / "small", "1m") as small:
        async def test(engine):
            with pytest.raises(OSError) as raised:
                await engine.read_into(987654, 0, memoryview(bytearray(10)))
            assert raised.value.errno == errno.EBADF
            fd = os.open(small / "f", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                with pytest.raises(OSError) as raised:
                    await engine.write_from(fd, 0, bytes(2 << 20))
                assert raised.value.errno == errno.ENOSPC
            finally:
                os.close(fd)

        run_with(engine_class, test)


def test_cancellation_waits_for_the_kernel_and_leaves_the_engine_usable(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()  # a read from an empty pipe blocks until cancelled

    async def test(engine):
        buffer = bytearray(16)
        with trio.move_on_after(0.2) as scope:
            await engine.read_into(read_end, 0, memoryview(buffer))
        assert scope.cancelled_caught
        assert not engine._pending  # the cancelled request completed in the kernel
        path = tmp_path / "after"
        path.write_bytes(b"still works")
        fd = os.open(path, os.O_RDONLY)
        try:
            target = bytearray(11)
            assert await engine.read_into(fd, 0, memoryview(target)) == 11 and target == b"still works"
        finally:
            os.close(fd)

    try:
        run_with(UringEngine, test)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_nursery_cancelled_whole_does_not_wait_forever_for_a_request() -> None:
    """A daemon's stop cancels the completion task and a request in flight at once: the
    request's own cancellation must reap its completion."""
    read_end, write_end = os.pipe()
    outcome: list[object] = []

    async def main():
        engine = UringEngine()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                nursery.start_soon(engine.read_into, read_end, 0, memoryview(bytearray(16)))
                await trio.sleep(0.1)  # the read is in the kernel, waiting on the empty pipe
                nursery.cancel_scope.cancel()
            outcome.append(dict(engine._pending))
        finally:
            engine.close()

    # A shielded wait cannot be cancelled from inside trio: bound it from outside.
    runner = threading.Thread(target=trio.run, args=(main,), daemon=True)
    try:
        runner.start()
        runner.join(timeout=20)
        assert not runner.is_alive(), "the cancelled request waited for a completion nobody delivers"
        assert outcome == [{}]
    finally:
        os.close(read_end)
        os.close(write_end)
