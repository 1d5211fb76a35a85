"""Storage failures of the SSD tier: what caused one, how many there were, and logging a
run of them once (a line when it starts, a line when it ends) rather than once per batch.

The offloader meets the same failure again and again while its cause lasts (an index
file system that is full, a disk that returns EIO): a log line or a traceback per batch
would bury everything else. Failures are counted by operation and cause for metrics.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections import Counter
from typing import Callable

import lmdb

from kvfs.errors import KvfsError, errno_of

# What a storage operation may raise when the disk or its index fails (lmdb's own errors
# are not OSErrors).
STORAGE_ERRORS: tuple[type[Exception], ...] = (OSError, KvfsError, lmdb.Error)

# errnos that lmdb reports only in its message (it raises its own classes, without errno)
_ERRNOS_IN_MESSAGES = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.ENOMEM)


def cause_of(error: BaseException) -> str:
    """A short name of a failure's cause, for metrics labels: an errno name ("ENOSPC",
    "EIO") or, for lmdb errors without one, lmdb's name ("MapFullError")."""
    if isinstance(error, lmdb.Error):
        message = str(error)
        for code in _ERRNOS_IN_MESSAGES:
            if os.strerror(code) in message:
                return errno.errorcode[code]
        return type(error).__name__
    return errno.errorcode.get(errno_of(error), "EIO")


class FaultBurst:
    """Logs a run of failures of one activity ("offload to DIR") once: the first failure
    at `level` with its cause, a new line only if the cause changes, and one line with the
    count and the duration when the activity succeeds again."""

    def __init__(self, activity: str, logger: logging.Logger, level: int = logging.ERROR,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.activity = activity
        self.log = logger
        self.level = level
        self.clock = clock
        self.failures = 0  # in the current run
        self.cause = ""
        self.message = ""  # the last failure's text
        self._started = 0.0

    @property
    def active(self) -> bool:
        return self.failures > 0

    def failed(self, error: BaseException, detail: str = "") -> None:
        cause = cause_of(error)
        self.message = f"{error}"
        if not self.failures or cause != self.cause:
            if not self.failures:
                self._started = self.clock()
            self.log.log(self.level, "%s failed%s: %s (%s); retrying, further failures are counted, not logged",
                         self.activity, f" ({detail})" if detail else "", error, cause)
        self.failures += 1
        self.cause = cause

    def succeeded(self) -> None:
        if not self.failures:
            return
        self.log.warning("%s works again after %d failures over %.1f s (%s)", self.activity, self.failures,
                         self.clock() - self._started, self.cause)
        self.failures = 0
        self.cause = self.message = ""


class StorageFaults:
    """Every storage failure of a node's store, by operation ("offload", "index", "read")
    and cause; each operation's runs are logged once by its own `FaultBurst`."""

    def __init__(self, directory: str, logger: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self._bursts = {operation: FaultBurst(f"{activity} {directory}", logger, clock=clock)
                        for operation, activity in (("offload", "copying files to"),
                                                    ("index", "updating the index in"),
                                                    ("read", "reading from"))}

    def failed(self, operation: str, error: BaseException, detail: str = "") -> None:
        self.counts[(operation, cause_of(error))] += 1
        self._bursts[operation].failed(error, detail)

    def succeeded(self, operation: str) -> None:
        self._bursts[operation].succeeded()

    def failing(self, operation: str) -> bool:
        return self._bursts[operation].active

    def last_error(self, operation: str | None = None) -> str:
        """The last failure of an operation still failing (of any, by default), or ""."""
        operations = [operation] if operation else list(self._bursts)
        return next((self._bursts[o].message for o in operations if self._bursts[o].message), "")

    @property
    def total(self) -> int:
        return sum(self.counts.values())
