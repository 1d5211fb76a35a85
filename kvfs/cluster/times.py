"""Times as a master keeps them: nanoseconds since BASE_NS, not since 1970, and an
inode's three in one object.

A count of ns since 1970 needs 61 bits (an int of 3 digits: 36 B, 48 allocated); an
offset from BASE_NS is smaller. `pack` keeps an inode's atime, mtime and ctime offsets as
one int, one slot instead of three (docs/cluster.md, "Memory per file"):

- each offset in [0, 2^60), from BASE_NS (2023-11-14) to 2060-06-24: a non-negative int
  of three 60-bit fields, atime lowest, ctime highest (180 bits, 6 digits: 48 B);
- each time a signed 64-bit ns count since 1970 (years 1677 to 2262, what a request may
  carry: kvfs.cluster.validate.time_ns): a negative int, the complement of three 64-bit
  fields of ns + 2^63 (192 bits, 7 digits: 52 B, 64 allocated), as `touch -d @0` needs;
- anything else (a saved state's time past those): a tuple of the three offsets.

Every time read back is the same ns count.
"""

from __future__ import annotations

BASE_NS = 1_700_000_000 * 1_000_000_000  # 2023-11-14T22:13:20Z

FIELD_BITS = 60
FIELD_MASK = (1 << FIELD_BITS) - 1
MTIME_SHIFT, CTIME_SHIFT = FIELD_BITS, 2 * FIELD_BITS
_WIDE_BITS = 64
_WIDE_MASK = (1 << _WIDE_BITS) - 1
_WIDE_BIAS = BASE_NS + (1 << 63)  # offset + this: the ns count + 2^63, in [0, 2^64) when signed 64-bit

# Packed times: an int (of either form above) or a tuple (atime, mtime, ctime) of offsets.
Times = int | tuple[int, int, int]


def pack(atime: int, mtime: int, ctime: int) -> Times:
    """Three offsets from BASE_NS as one int of the narrowest form that holds them."""
    # (A negative offset makes the OR negative, so its shift is not 0 either.)
    if not (atime | mtime | ctime) >> FIELD_BITS:
        return atime | mtime << MTIME_SHIFT | ctime << CTIME_SHIFT
    wide_a, wide_m, wide_c = atime + _WIDE_BIAS, mtime + _WIDE_BIAS, ctime + _WIDE_BIAS
    if not (wide_a | wide_m | wide_c) >> _WIDE_BITS:
        return ~(wide_a | wide_m << _WIDE_BITS | wide_c << 2 * _WIDE_BITS)
    return (atime, mtime, mtime if ctime == mtime else ctime)  # (equal ones one int)


def unpack(times: Times) -> tuple[int, int, int]:
    """The three offsets (atime, mtime, ctime) that `pack` was given."""
    if type(times) is int:
        if times >= 0:
            return times & FIELD_MASK, times >> MTIME_SHIFT & FIELD_MASK, times >> CTIME_SHIFT
        wide = ~times
        return ((wide & _WIDE_MASK) - _WIDE_BIAS, (wide >> _WIDE_BITS & _WIDE_MASK) - _WIDE_BIAS,
                (wide >> 2 * _WIDE_BITS) - _WIDE_BIAS)
    return times


def atime_of(times: Times) -> int:
    if type(times) is int and times >= 0:
        return times & FIELD_MASK
    return unpack(times)[0]


def mtime_of(times: Times) -> int:
    if type(times) is int and times >= 0:
        return times >> MTIME_SHIFT & FIELD_MASK
    return unpack(times)[1]


def ctime_of(times: Times) -> int:
    if type(times) is int and times >= 0:
        return times >> CTIME_SHIFT
    return unpack(times)[2]
