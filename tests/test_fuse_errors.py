"""The errno mapping of request handlers: only FUSEError may leave a handler."""

import errno

import pyfuse3
import pytest
import trio

from kvfs.errors import MetadataError, NoSpace, errno_of
from kvfs.fuse.errors import fuse_handler
from kvfs.histogram import OperationStats


class Handlers:
    def __init__(self) -> None:
        self.operation_stats = OperationStats()

    @fuse_handler
    async def metadata_failure(self, ino: int) -> None:
        raise MetadataError(errno.ENOENT, f"inode {ino} does not exist")

    @fuse_handler
    async def full(self, ino: int) -> None:
        raise NoSpace("DRAM tier full")

    @fuse_handler
    async def os_failure(self, ino: int) -> None:
        raise OSError(errno.EACCES, "denied")

    @fuse_handler
    async def bug(self, ino: int) -> None:
        raise ValueError("a programming error")

    @fuse_handler
    async def write(self, fh: int, offset: int, data: bytes) -> int:
        raise OSError(errno.EIO, "the disk failed")

    @fuse_handler
    async def lookup(self, parent: int, name: bytes) -> int:
        raise ValueError("a programming error")

    @fuse_handler
    async def fine(self, ino: int) -> int:
        return ino * 2


@pytest.mark.parametrize("name, code", [("metadata_failure", errno.ENOENT), ("full", errno.ENOSPC),
                                        ("os_failure", errno.EACCES), ("bug", errno.EIO)])
def test_failures_become_fuse_errors(name: str, code: int, caplog: pytest.LogCaptureFixture) -> None:
    handlers = Handlers()
    with pytest.raises(pyfuse3.FUSEError) as raised:
        trio.run(getattr(handlers, name), 7)
    assert raised.value.errno == code
    assert handlers.operation_stats.counts == {(name, errno.errorcode[code]): 1}
    assert handlers.operation_stats.latency[name].count == 1
    if name == "bug":
        assert "bug(7) failed with an unexpected error" in caplog.text and "ValueError" in caplog.text


def test_results_pass_through_and_are_counted_as_ok() -> None:
    handlers = Handlers()
    assert trio.run(handlers.fine, 21) == 42
    assert trio.run(handlers.fine, 1) == 2
    assert handlers.operation_stats.counts == {("fine", "ok"): 2}


def test_errno_of_unknown_errors_is_eio() -> None:
    assert errno_of(RuntimeError("x")) == errno.EIO
    assert errno_of(OSError("no errno")) == errno.EIO


def test_a_failing_write_never_logs_the_files_bytes(caplog: pytest.LogCaptureFixture) -> None:
    handlers = Handlers()
    with pytest.raises(pyfuse3.FUSEError):
        trio.run(handlers.write, 3, 4096, b"SECRET-KV-BYTES")
    assert "write(3, 4096, <15 bytes>) failed: [Errno 5] the disk failed" in caplog.text
    assert "SECRET" not in caplog.text


def test_a_name_in_a_log_line_is_escaped(caplog: pytest.LogCaptureFixture) -> None:
    handlers = Handlers()
    with pytest.raises(pyfuse3.FUSEError):
        trio.run(handlers.lookup, 1, b"evil\nkvfs.master: forged line")
    assert "lookup(1, b'evil\\nkvfs.master: forged line') failed" in caplog.text
