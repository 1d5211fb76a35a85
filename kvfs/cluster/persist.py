"""The master's durable state in lmdb: inodes, file versions, node names.

After every request the master writes what the request changed (the dirty sets
of the namespace, the object directory and the registry, as kvfs.cluster.records
encodes them) in one transaction, so a restart, even after kill -9, finds every
name it ever acknowledged. Commits are not fsynced one by one (the page cache
survives a killed process); a timer syncs them. What a machine crash loses on the
master is re-learned from the nodes, which report everything they hold when they
register again.

Open handles, kernel references and liveness are not saved: nodes report their
open handles when they register again, and every node starts out not alive.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lmdb

from kvfs.cluster import records
from kvfs.cluster.master import MetadataService
from kvfs.cluster.records import Kind

log = logging.getLogger(__name__)


def _key(number: int) -> bytes:
    return number.to_bytes(8, "big")


class MasterState:
    def __init__(self, directory: Path, map_size: int = 8 << 30) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(directory / "master.lmdb"), map_size=map_size, max_dbs=3,
                             sync=False, metasync=False, subdir=True)
        self._inodes = self.env.open_db(b"inodes")
        self._versions = self.env.open_db(b"versions")
        self._meta = self.env.open_db(b"meta")
        self.commits = 0

    def load(self, service: MetadataService) -> int:
        """Fills a fresh service with the saved state; returns the number of files."""
        loaded = records.Loaded()
        with self.env.begin() as txn:
            raw_meta = txn.get(b"meta", db=self._meta)
            if raw_meta is None:
                return 0
            loaded.add_meta(raw_meta)
            for key, value in txn.cursor(db=self._inodes):
                loaded.add(Kind.INODE, int.from_bytes(key, "big"), value)
            for key, value in txn.cursor(db=self._versions):
                loaded.add(Kind.VERSION, int.from_bytes(key, "big"), value)
        return loaded.into(service)

    def save(self, service: MetadataService) -> None:
        """Writes what changed since the last save, in one transaction."""
        if not records.is_dirty(service):
            return
        dbs = {Kind.INODE: self._inodes, Kind.VERSION: self._versions}
        with self.env.begin(write=True) as txn:
            # Nodes live in the meta record here (the layout of existing data directories).
            for change in records.changes(service, {}):
                db = dbs.get(change.kind)
                if db is None:
                    continue
                if change.value is None:
                    txn.delete(_key(change.number), db=db)
                else:
                    txn.put(_key(change.number), change.value, db=db)
            txn.put(b"meta", records.encode_meta(service), db=self._meta)
        records.clear_dirty(service)
        self.commits += 1

    def sync(self) -> None:
        started = time.monotonic()
        self.env.sync(True)
        elapsed = time.monotonic() - started
        if elapsed > 1:
            log.warning("syncing the master state took %.1f s", elapsed)

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
