"""How a directory keeps its names in memory: hex names packed (pure).

KV-cache blocks are named by a hash in lowercase hex, `<64 hex>.bin`, and their temp
files `<64 hex>.bin_<random>.tmp`: 68 bytes and more, half of them spent on hex digits.
A name whose part before its first dot (the whole name without one) is lowercase hex of
even length, 16 digits or more, is kept as its key: a NUL, the digits' byte count, the
digits as bytes, then the rest as it was (`<64 hex>.bin`: 38 bytes, an 80 B object
instead of 112). No name holds a NUL (`check_name`), so a key never equals a plain name,
and every other name is its own key (the same object). Keys live only in memory (a
directory's dict, `Inode.key`); what is saved and sent is always the name.

A vLLM block's own name, exactly 64 digits then ".bin" or nothing, is kept as an int
instead: the digits' 256 bits and one for the suffix, 64 B instead of the packed bytes' 80
(docs/cluster.md, "Memory per file"). An int is never equal to a bytes key, so the two
forms share a dict. An int's hash is its value modulo 2^61 - 1 in every process (no seed,
unlike a bytes' hash): names chosen to collide would slow every lookup in their directory.
So the int is multiplied by an odd number of 257 bits drawn at start, modulo 2^257 (a
bijection, undone by the inverse), and its hash is not the name's to choose.
"""

from __future__ import annotations

import secrets
from binascii import Error, a2b_hex, b2a_hex

MIN_DIGITS = 16  # fewer: the key's two extra bytes take most of what packing saves
_PREFIXES = [b"\0" + bytes((n,)) for n in range(128)]  # a name is at most 255 bytes: < 128 digit bytes

# A block name kept as an int: 64 digits, then one of these (its index is the int's low bit).
BLOCK_DIGITS = 64
_BLOCK_SUFFIXES = (b"", b".bin")
_INT_BITS = 4 * BLOCK_DIGITS + 1  # < 2^270: an int of 9 digits, 64 B
_INT_MASK = (1 << _INT_BITS) - 1
# Odd (invertible modulo 2^_INT_BITS) and as wide as the key: a narrow one leaves the product
# of digits chosen k * (2^61 - 1) apart below 2^257, hashing alike (tests/test_block_names.py).
_SCATTER = secrets.randbits(_INT_BITS) | 1
_GATHER = pow(_SCATTER, -1, 1 << _INT_BITS)

Key = bytes | int

# The last name packed or unpacked and its key (the name itself if it is not packed): a
# create looks its name up, checks it is free and links it (three packs of one name
# object), a seal and the save that follow read it back. (Compared by identity: the pair
# is held here, so neither can be another object.)
_last: tuple[bytes, Key] = (b"", b"")


def pack(name: Key) -> Key:
    """The key a name is kept under; a key given again comes back as it is (an int, or
    bytes that start with a NUL, which no packed part holds)."""
    global _last
    last = _last
    if name is last[0]:
        return last[1]
    if type(name) is int:
        return name
    end = name.find(b".")
    if end < 0:
        end = len(name)
    if end < MIN_DIGITS or end & 1:
        return name
    digits = name[:end]
    # Hex digits are letters and digits, lowercase ones not uppercase (an uppercase name
    # would unpack as another): most other names fail these two cheap checks.
    if not digits.isalnum() or not (digits.islower() or digits.isdigit()):
        _last = (name, name)
        return name
    try:
        if end == BLOCK_DIGITS and (len(name) == end or name[end:] == b".bin"):
            key: Key = (int(digits, 16) << 1 | (len(name) != end)) * _SCATTER & _INT_MASK
        else:
            key = _PREFIXES[end >> 1] + a2b_hex(digits) + name[end:]
    except (Error, ValueError):  # (other letters than a-f)
        key = name
    _last = (name, key)
    return key


def unpack(key: Key) -> bytes:
    """The name kept under a key."""
    global _last
    last = _last
    if key is last[1]:
        return last[0]
    if type(key) is int:
        value = key * _GATHER & _INT_MASK
        name = b2a_hex((value >> 1).to_bytes(BLOCK_DIGITS // 2, "big")) + _BLOCK_SUFFIXES[value & 1]
        _last = (name, key)
        return name
    if key[:1] != b"\0":
        return key
    end = key[1] + 2
    name = b2a_hex(key[2:end]) + key[end:]
    _last = (name, key)
    return name
