"""Every request is checked here before the metadata service applies any of it (pure).

Decoding a frame already enforces the bounds declared on the message structs
(kvfs.wire.messages: ids are unsigned 64-bit, uid and gid 32-bit, modes hold file
type and permission bits only, lists and strings are bounded). `check_request`
enforces them again, for structs built in-process (the embedded master decodes
nothing, and Python ints have no width), then adds what a type cannot say: a name
is 1-255 bytes without '/' or NUL and, where it is stored, not '.' or '..'; times
fit a signed 64-bit count of nanoseconds; a restored file is a regular file. A
failure raises MetadataError with the errno a caller should see, naming the field.
"""

from __future__ import annotations

import errno
import re
import stat
import typing
from typing import Any, Callable

import msgspec

from kvfs.chunks import CHUNK_SIZE
from kvfs.cluster.namespace import check_name, check_target
from kvfs.errors import MetadataError
from kvfs.wire import messages as m

TIME_MIN, TIME_MAX = -(2**63), 2**63 - 1  # ns since the epoch: years 1677 to 2262
MAX_FILE_SIZE = m.MAX_CHUNKS * CHUNK_SIZE  # 2 TiB: a file must fit one node's DRAM tier
MAX_TIER_BYTES = 1 << 50  # a node's tier as its heartbeat reports it (sums over nodes stay in 64 bits)
USER_XATTR_PREFIX = b"user."

_ANY_REQUEST = typing.Union[tuple(m.Request.__subclasses__())]  # type: ignore[misc]
_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(_ANY_REQUEST).decode
_FIELD = re.compile(r"at `\$\.?([^`]*)`")
_NAME_FIELDS = {"name", "name_old", "name_new", "target", "path"}


def check_request(request: object, decoded: bool = False) -> None:
    """Raises MetadataError if the request is not one a correct peer could send. DECODED: it
    was decoded from a frame (kvfs.net.rpc), whose decoder checked the structs' bounds
    already; one built in-process has them checked here."""
    if not isinstance(request, m.Request):
        raise MetadataError(errno.EINVAL, f"{type(request).__name__} is not a request")
    if not decoded:
        _check_as_decoded(request)
    check = _CHECKS.get(type(request))
    if check is not None:
        check(request)


def _check_as_decoded(request: m.Request) -> None:
    """What decoding the request from a frame would refuse (the struct's declared bounds)."""
    kind = type(request).__name__
    try:
        _decode(_encode(request))
    except OverflowError:
        raise MetadataError(errno.EINVAL, f"{kind}: {_wide_int(request, '$')} does not fit 64 bits") from None
    except msgspec.ValidationError as error:
        raise MetadataError(_errno_of(request, str(error)), f"{kind}: {error}") from None
    except (TypeError, msgspec.EncodeError) as error:
        raise MetadataError(errno.EINVAL, f"{kind}: {error}") from None


def _errno_of(request: m.Request, error: str) -> int:
    """EINVAL for a bad value; for something too long, what a file system answers."""
    if "of length <=" not in error:
        return errno.EINVAL
    found = _FIELD.search(error)
    field = re.sub(r"\[\d+\]", "", found.group(1)).rsplit(".", 1)[-1] if found else ""
    if isinstance(request, (m.GetXattr, m.SetXattr, m.RemoveXattr)):
        return errno.ERANGE if field == "name" else errno.E2BIG
    if field in _NAME_FIELDS and "`bytes`" in error:
        return errno.ENAMETOOLONG
    return errno.E2BIG


def _wide_int(value: Any, path: str) -> str:
    """Where in a request an int lies outside what msgpack carries (-2^63 .. 2^64 - 1)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return path if not -(2**63) <= value < 2**64 else ""
    items: list[tuple[str, Any]] = []
    if isinstance(value, msgspec.Struct):
        items = [(f"{path}.{name}", getattr(value, name)) for name in value.__struct_fields__]
    elif isinstance(value, (list, tuple)):
        items = [(f"{path}[{i}]", item) for i, item in enumerate(value)]
    elif isinstance(value, dict):
        items = [(f"{path} key", key) for key in value] + [(f"{path}[{k!r}]", v) for k, v in value.items()]
    for where, item in items:
        found = _wide_int(item, where)
        if found:
            return found
    return ""


# Checks of what a type cannot say ------------------------------------------------------


def new_name(name: bytes) -> None:
    """A name an entry is created or renamed under."""
    check_name(name)
    if name in (b".", b".."):
        raise MetadataError(errno.EINVAL, f"{name!r} cannot name an entry")


def time_ns(value: int | None, field: str) -> None:
    if value is not None and not TIME_MIN <= value <= TIME_MAX:
        raise MetadataError(errno.EINVAL, f"{field} of {value} ns is out of range (a signed 64-bit count)")


def file_size(value: int, field: str) -> None:
    if value > MAX_FILE_SIZE:
        raise MetadataError(errno.EFBIG, f"{field} of {value} bytes exceeds {MAX_FILE_SIZE}")


def xattr(name: bytes, value: bytes) -> None:
    """A user attribute as setxattr(2) accepts it."""
    if len(name) > m.XATTR_NAME_MAX:
        raise MetadataError(errno.ERANGE, f"xattr name of {len(name)} bytes")
    if not name.startswith(USER_XATTR_PREFIX) or len(name) == len(USER_XATTR_PREFIX) or b"\0" in name:
        raise MetadataError(errno.ENOTSUP, f"xattr {name[:64]!r}: only user.* attributes are supported")
    if len(value) > m.XATTR_SIZE_MAX:
        raise MetadataError(errno.E2BIG, f"xattr value of {len(value)} bytes")


def file_record(record: m.FileRecord) -> None:
    """A file as a node's SSD index describes it, to put back in the namespace."""
    if not record.path:
        raise MetadataError(errno.EINVAL, "a restored file has an empty path")
    for name in record.path:
        new_name(name)
    if not stat.S_ISREG(record.mode):
        raise MetadataError(errno.EINVAL, f"a restored file has mode {record.mode:o}, not a regular file's")
    file_size(record.size, "restored size")
    time_ns(record.mtime_ns, "restored mtime")
    for name, value in record.xattrs.items():
        xattr(name, value)


def printable(text: str, field: str, empty: bool = False) -> None:
    """A string that goes into logs and status tables as it is."""
    if (not text and not empty) or not text.isprintable():
        raise MetadataError(errno.EINVAL, f"{field} {text[:64]!r} is empty or not printable")


def _lookup(req: m.Lookup | m.Unlink | m.RmDir) -> None:
    check_name(req.name)  # '.' and '..' resolve as on any file system
    if isinstance(req, m.Lookup) and (b"/" in req.temp_suffix or b"\0" in req.temp_suffix):
        raise MetadataError(errno.EINVAL, f"temp suffix {req.temp_suffix[:64]!r} holds '/' or NUL")


def _created(req: m.MkDir | m.Create) -> None:
    new_name(req.name)


def _symlink(req: m.Symlink) -> None:
    new_name(req.name)
    check_target(req.target)


def _rename(req: m.Rename) -> None:
    new_name(req.name_old)
    new_name(req.name_new)


def _setattr(req: m.SetAttr) -> None:
    time_ns(req.atime_ns, "atime")
    time_ns(req.mtime_ns, "mtime")


def _seal(req: m.Seal) -> None:
    file_size(req.size, "sealed size")
    time_ns(req.mtime_ns, "mtime")
    time_ns(req.ctime_ns, "ctime")


def _xattr_name(req: m.GetXattr | m.RemoveXattr) -> None:
    if len(req.name) > m.XATTR_NAME_MAX:
        raise MetadataError(errno.ERANGE, f"xattr name of {len(req.name)} bytes")


def _setxattr(req: m.SetXattr) -> None:
    xattr(req.name, req.value)


def _restore(req: m.Restore) -> None:
    file_record(req.record)


def _report(req: m.Report) -> None:
    for held in req.held:
        file_size(held.size, f"version {held.version}'s size")
        time_ns(held.mtime_ns, f"version {held.version}'s mtime")
        if held.record is not None:
            file_record(held.record)


def _register(req: m.Register) -> None:
    printable(req.name, "node name")
    printable(req.address, "peer address", empty=True)


def _heartbeat(req: m.Heartbeat) -> None:
    for field in ("dram_capacity", "dram_used", "ssd_capacity", "ssd_used"):
        if getattr(req, field) > MAX_TIER_BYTES:
            raise MetadataError(errno.EINVAL, f"{field} of {getattr(req, field)} bytes exceeds {MAX_TIER_BYTES}")


_CHECKS: dict[type, Callable[[Any], None]] = {
    m.Lookup: _lookup, m.Unlink: _lookup, m.RmDir: _lookup, m.MkDir: _created, m.Create: _created,
    m.Symlink: _symlink, m.Rename: _rename, m.SetAttr: _setattr, m.Seal: _seal, m.GetXattr: _xattr_name,
    m.RemoveXattr: _xattr_name, m.SetXattr: _setxattr, m.Restore: _restore, m.Report: _report,
    m.Register: _register, m.Heartbeat: _heartbeat,
}
