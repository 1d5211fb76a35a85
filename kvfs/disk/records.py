"""The SSD tier's durable records: what its index and its extent headers hold.

These structs are the on-disk format, versioned by `LAYOUT_VERSION`, and belong
to the tier alone: the cluster's RPC messages are converted to and from them at
the node (kvfs/node/membership.py), so a change on the wire never changes the disk format.
Changing a field here is a layout change: bump `LAYOUT_VERSION`.
"""

from __future__ import annotations

import msgspec

# 1: lmdb records only (kvfs before extent headers). 2: every file has an extent header.
LAYOUT_VERSION = 2

Chunk = tuple[int, int, int]  # (tier offset, length, xxh3-64 of the bytes)


class DiskFile(msgspec.Struct):
    """A file as the tier remembers it, enough to restore it in the namespace."""

    path: list[bytes]  # components from the root
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    xattrs: dict[bytes, bytes]


class DiskRecord(msgspec.Struct):
    """One file version stored on the tier, and where its chunks are."""

    version: int
    file: DiskFile
    chunks: list[Chunk]


class IndexEntry(msgspec.Struct):
    """The value of an index key: the record, and where its extent header block is."""

    record: DiskRecord
    header: int  # tier offset
    header_length: int  # page-rounded


class DiskDir(msgspec.Struct):
    """A directory of a single-node mount, as its record in the index's `dirs` table holds it
    (key: the directory's inode number in the namespace that wrote it). The table came after
    layout 2 and sits beside the files: a tier without it mounts as before (files only)."""

    parent: int  # the parent's inode number, as keyed in the same table; 0 for the root
    name: bytes
    mode: int
    uid: int
    gid: int
    mtime_ns: int


class LayoutMeta(msgspec.Struct):
    layout: int
    chunk_size: int
    segment_size: int
