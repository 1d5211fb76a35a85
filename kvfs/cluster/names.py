"""How a directory keeps its names in memory: hex names packed (pure).

KV-cache blocks are named by a hash in lowercase hex, `<64 hex>.bin`, and their temp
files `<64 hex>.bin_<random>.tmp`: 68 bytes and more, half of them spent on hex digits.
A name whose part before its first dot (the whole name without one) is lowercase hex of
even length, 16 digits or more, is kept as its key: a NUL, the digits' byte count, the
digits as bytes, then the rest as it was (`<64 hex>.bin`: 38 bytes, an 80 B object
instead of 112). No name holds a NUL (`check_name`), so a key never equals a plain name,
and every other name is its own key (the same object). Keys live only in memory (a
directory's dict, `Inode.key`); what is saved and sent is always the name.
"""

from __future__ import annotations

from binascii import Error, a2b_hex, b2a_hex

MIN_DIGITS = 16  # fewer: the key's two extra bytes take most of what packing saves
_PREFIXES = [b"\0" + bytes((n,)) for n in range(128)]  # a name is at most 255 bytes: < 128 digit bytes

# The last name packed or unpacked and its key (the name itself if it is not packed): a
# create looks its name up, checks it is free and links it (three packs of one name
# object), a seal and the save that follow read it back. (Compared by identity: the pair
# is held here, so neither can be another object.)
_last: tuple[bytes, bytes] = (b"", b"")


def pack(name: bytes) -> bytes:
    """The key a name is kept under; a key given again comes back as it is (it starts
    with a NUL, which no packed part holds)."""
    global _last
    last = _last
    if name is last[0]:
        return last[1]
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
        key = _PREFIXES[end >> 1] + a2b_hex(digits) + name[end:]
    except Error:  # (other letters than a-f)
        key = name
    _last = (name, key)
    return key


def unpack(key: bytes) -> bytes:
    """The name kept under a key."""
    global _last
    if key[:1] != b"\0":
        return key
    last = _last
    if key is last[1]:
        return last[0]
    end = key[1] + 2
    name = b2a_hex(key[2:end]) + key[end:]
    _last = (name, key)
    return name
