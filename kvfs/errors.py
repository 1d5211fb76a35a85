"""Error types of kvfs.

Every layer raises its own subclass of `KvfsError`, which carries the errno that
POSIX callers should see and a message that names the object and the cause. Only
`kvfs.fuse.errors` turns them into `pyfuse3.FUSEError`.
"""

from __future__ import annotations

import errno as _errno
import os


class KvfsError(Exception):
    """A failure with a POSIX meaning: `errno` is what the caller sees."""

    def __init__(self, errno: int, message: str) -> None:
        super().__init__(f"{message}: {os.strerror(errno)}")
        self.errno = errno


class MetadataError(KvfsError):
    """Raised by the metadata layer (namespace and object directory)."""


class StorageError(KvfsError):
    """Raised by a node's storage tiers."""


class NoSpace(StorageError):
    """A tier cannot allocate the bytes asked for (`needed`: the block that did not fit)."""

    def __init__(self, message: str, needed: int = 0) -> None:
        super().__init__(_errno.ENOSPC, message)
        self.needed = needed


class ConfigError(KvfsError):
    """A configuration value is invalid; the message names the field (and says why: no
    "Invalid argument" appended)."""

    def __init__(self, message: str) -> None:
        super().__init__(_errno.EINVAL, message)
        self.args = (message,)


class CommandError(KvfsError):
    """A command failed; the message says all of it (no strerror appended)."""

    def __init__(self, errno: int, message: str) -> None:
        super().__init__(errno, message)
        self.args = (message,)


def errno_of(error: BaseException) -> int:
    """The errno a failure means for a POSIX caller."""
    if isinstance(error, KvfsError):
        return error.errno
    if isinstance(error, OSError) and error.errno:
        return error.errno
    return _errno.EIO


def reason_of(error: BaseException) -> str:
    """Why an operation failed, in words: the strerror of an OSError, looking through trio's
    "all attempts to connect ... failed" to the first attempt's cause."""
    cause = error.__cause__
    if isinstance(error, OSError) and not error.errno and cause is not None:
        if isinstance(cause, BaseExceptionGroup):
            cause = cause.exceptions[0]
        return reason_of(cause)
    if isinstance(error, OSError) and error.errno:
        return os.strerror(error.errno)
    return str(error) or type(error).__name__
