"""The one place where failures become errno replies to the kernel.

Only `pyfuse3.FUSEError` may leave a request handler: anything else kills the
daemon and leaves a dead mount behind. Expected outcomes (a missing name, an
existing one) are logged at debug level; real failures at warning or error.
"""

from __future__ import annotations

import errno
import functools
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

import pyfuse3

from kvfs.errors import KvfsError, errno_of

log = logging.getLogger("kvfs.fuse")

# Outcomes that ordinary callers provoke all the time (lookups of absent keys,
# mkdir of an existing directory): not worth more than a debug line.
ROUTINE_ERRNOS = frozenset({errno.ENOENT, errno.EEXIST, errno.ENOTEMPTY, errno.ENODATA, errno.ENOTDIR,
                            errno.EISDIR, errno.ENAMETOOLONG, errno.ESTALE, errno.EPERM, errno.ENOTSUP, errno.ERANGE})

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Any]])

# Arguments that are a file's bytes or an attribute's value, by handler and position: a log
# line shows their length only (names and numbers are shown; contents never are).
CONTENT_ARGUMENTS = {"write": 2, "setxattr": 2}


def fuse_handler(method: Handler) -> Handler:
    """Wraps a request handler so that every failure becomes a FUSEError with a log line,
    and every request is counted, by outcome, in the handler object's `operation_stats`."""
    name = method.__name__

    @functools.wraps(method)
    async def wrapper(self: Any, *args: Any) -> Any:
        started = time.perf_counter()
        code = errno.EINTR  # what is recorded when the request is cancelled (interrupted)
        try:
            result = await method(self, *args)
            code = 0
            return result
        except pyfuse3.FUSEError as error:
            code = error.errno
            raise
        except (KvfsError, OSError) as error:
            code = errno_of(error)
            level = logging.DEBUG if code in ROUTINE_ERRNOS else logging.WARNING
            log.log(level, "%s%s failed: %s", name, _describe(name, args), error)
            raise pyfuse3.FUSEError(code) from None
        except Exception:
            code = errno.EIO
            log.exception("%s%s failed with an unexpected error; replying EIO", name, _describe(name, args))
            raise pyfuse3.FUSEError(errno.EIO) from None
        finally:
            self.operation_stats.record(name, code, time.perf_counter() - started)

    return wrapper  # type: ignore[return-value]


def _describe(name: str, args: tuple[Any, ...]) -> str:
    content = CONTENT_ARGUMENTS.get(name)
    shown = []
    for position, arg in enumerate(args):
        if isinstance(arg, bool) or not isinstance(arg, (int, bytes, memoryview)):
            continue
        if isinstance(arg, int):
            shown.append(str(arg))
        elif position == content or len(arg) > 300:
            shown.append(f"<{len(arg)} bytes>")
        else:
            shown.append(repr(bytes(arg)))  # a name: escaped, so it cannot forge a log line
    return "(" + ", ".join(shown[:4]) + ")"
