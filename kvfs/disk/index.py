"""The lmdb index of the SSD tier: which file versions are on disk, and where.

A record is written only after its chunks and its extent header are on disk and
synced, and deleted before its extents are freed, so after a crash at any point
the index points only at complete, checksummed data. Each record carries the
file's path and attributes, so that a restart can rebuild the namespace from the
index alone; the extent headers hold the same records, so that the index itself
can be rebuilt from the segments (kvfs/disk/rebuild.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import lmdb
import msgspec

from kvfs.disk.records import DiskDir, DiskRecord, IndexEntry, LayoutMeta


def _key(version: int) -> bytes:
    return version.to_bytes(8, "big")


def open_environment(path: Path, map_size: int) -> lmdb.Environment:
    return lmdb.open(str(path), map_size=map_size, max_dbs=3, sync=True, metasync=True)


class DiskIndex:
    def __init__(self, path: Path, map_size: int = 1 << 30) -> None:
        self.env = open_environment(path, map_size)
        self._files = self.env.open_db(b"files")
        self._meta = self.env.open_db(b"meta")
        # A single-node mount's directories (kvfs/node/dirrecords.py); a kvfs that predates
        # it opens only `files` and `meta`, so the layout stays 2.
        self._dirs = self.env.open_db(b"dirs")
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode_entry = msgspec.msgpack.Decoder(IndexEntry).decode

    def layout(self) -> LayoutMeta | None:
        with self.env.begin(db=self._meta) as txn:
            raw = txn.get(b"layout")
        return None if raw is None else msgspec.msgpack.decode(raw, type=LayoutMeta)

    def set_layout(self, meta: LayoutMeta) -> None:
        with self.env.begin(db=self._meta, write=True) as txn:
            txn.put(b"layout", self._encode(meta))

    def put(self, entries: list[IndexEntry]) -> None:
        """Stores entries durably (one transaction, synced on commit)."""
        with self.env.begin(db=self._files, write=True) as txn:
            for entry in entries:
                txn.put(_key(entry.record.version), self._encode(entry))

    def delete(self, versions: list[int]) -> None:
        with self.env.begin(db=self._files, write=True) as txn:
            for version in versions:
                txn.delete(_key(version))

    def count(self) -> int:
        with self.env.begin(db=self._files) as txn:
            return txn.stat(self._files)["entries"]

    def entries(self) -> Iterator[IndexEntry | bytes]:
        """Every entry; one that does not decode is yielded as its raw key."""
        with self.env.begin(db=self._files) as txn:
            for key, value in txn.cursor():
                try:
                    yield self._decode_entry(value)
                except msgspec.DecodeError:
                    yield bytes(key)

    def records(self) -> Iterator[DiskRecord]:
        """Every record that decodes."""
        for entry in self.entries():
            if isinstance(entry, IndexEntry):
                yield entry.record

    def delete_keys(self, keys: list[bytes]) -> None:
        with self.env.begin(db=self._files, write=True) as txn:
            for key in keys:
                txn.delete(key)

    def put_dirs(self, changes: dict[int, DiskDir | None]) -> None:
        """Stores and deletes (None) directory records durably (one transaction, synced)."""
        with self.env.begin(db=self._dirs, write=True) as txn:
            for ino, record in changes.items():
                if record is None:
                    txn.delete(_key(ino))
                else:
                    txn.put(_key(ino), self._encode(record))

    def replace_dirs(self, records: dict[int, DiskDir]) -> None:
        """Replaces every directory record at once (one transaction, synced)."""
        with self.env.begin(db=self._dirs, write=True) as txn:
            txn.drop(self._dirs, delete=False)
            for ino, record in records.items():
                txn.put(_key(ino), self._encode(record))

    def dirs(self) -> Iterator[tuple[bytes, DiskDir | None]]:
        """Every directory record by its raw key; None for one that does not decode."""
        decode = msgspec.msgpack.Decoder(DiskDir).decode
        with self.env.begin(db=self._dirs) as txn:
            for key, value in txn.cursor():
                try:
                    yield bytes(key), decode(value)
                except msgspec.DecodeError:
                    yield bytes(key), None

    def close(self) -> None:
        self.env.close()
