"""The master's durable state in lmdb: inodes, file versions, node names.

After every batch of requests (those a connection's loop handles together) the
master writes what they changed (the dirty sets of the namespace, the object
directory and the registry, as kvfs.cluster.records encodes them) in one
transaction, before any of them is answered, so a restart, even after kill -9, finds every
name it ever acknowledged. Commits are not fsynced one by one (the page cache
survives a killed process); a timer syncs them. What a machine crash loses on the
master is re-learned from the nodes, which report everything they hold when they
register again.

Open handles, kernel references and liveness are not saved: nodes report their
open handles when they register again, and every node starts out not alive.
"""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path

import lmdb
import msgspec

from kvfs.cluster import records
from kvfs.cluster.master import MetadataService
from kvfs.cluster.records import Kind
from kvfs.errors import MetadataError

log = logging.getLogger(__name__)


COUNTERS_KEY = b"counters"  # the next inode, entry and version numbers
NODE_PREFIX = b"node/"  # + the node id: its name, peer address and number blocks
OLD_META_KEY = b"meta"  # the first layout: counters and every node in one record, rewritten by every save


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
        self._upgrade = False  # the old meta record is still there

    def load(self, service: MetadataService) -> int:
        """Fills a fresh service with the saved state; returns the number of files. A damaged
        record (or a field out of its bounds) is named, and nothing is loaded: MetadataError."""
        loaded = records.Loaded()
        kind, key = Kind.COUNTERS, COUNTERS_KEY  # the record being read (one try for all: none per record)
        try:
            with self.env.begin() as txn:
                raw_counters = txn.get(COUNTERS_KEY, db=self._meta)
                raw_meta = txn.get(OLD_META_KEY, db=self._meta)
                if raw_counters is not None:
                    loaded.add(Kind.COUNTERS, 0, raw_counters)
                    kind = Kind.NODE
                    for key, value in txn.cursor(db=self._meta):
                        if key.startswith(NODE_PREFIX):
                            loaded.add(Kind.NODE, int.from_bytes(key[len(NODE_PREFIX):], "big"), value)
                elif raw_meta is not None:  # a data directory of the first layout: nodes inside the meta record
                    key = OLD_META_KEY
                    loaded.add_meta(raw_meta)
                else:
                    return 0
                kind = Kind.INODE
                for key, value in txn.cursor(db=self._inodes):
                    loaded.add(Kind.INODE, int.from_bytes(key, "big"), value)
                kind = Kind.VERSION
                for key, value in txn.cursor(db=self._versions):
                    loaded.add(Kind.VERSION, int.from_bytes(key, "big"), value)
        except msgspec.DecodeError as error:
            raise MetadataError(errno.EIO, f"{self.env.path()}: the {kind.name.lower()} record {bytes(key)!r} is "
                                           f"damaged ({error}); not loaded") from None
        files = loaded.into(service)
        if raw_counters is None:  # the next save writes the nodes as records of their own and drops the old meta record
            self._upgrade = True
            service.registry.dirty = True
        return files

    def save(self, service: MetadataService) -> bool:
        """Writes what changed since the last save, in one transaction (False: nothing had
        changed, none was made). Nodes are written only when the registry changed (a
        registration, a node forgotten), not with every request; the counters are one small record."""
        if not records.is_dirty(service):
            return False
        dbs = {Kind.INODE: self._inodes, Kind.VERSION: self._versions}
        with self.env.begin(write=True) as txn:
            # the nodes as stored, read only when the registry changed (rarely; a few records)
            written = self._stored_nodes(txn) if service.registry.dirty else {}
            for change in records.changes(service, written):
                if change.kind is Kind.COUNTERS:
                    key, db = COUNTERS_KEY, self._meta
                elif change.kind is Kind.NODE:
                    key, db = NODE_PREFIX + _key(change.number), self._meta
                else:
                    key, db = _key(change.number), dbs[change.kind]
                if change.value is None:
                    txn.delete(key, db=db)
                else:
                    txn.put(key, change.value, db=db)
            if self._upgrade:
                txn.delete(OLD_META_KEY, db=self._meta)
        records.clear_dirty(service)
        self._upgrade = False
        self.commits += 1
        return True

    def _stored_nodes(self, txn: lmdb.Transaction) -> dict[int, records.NodeFields]:
        loaded = records.Loaded()
        for key, value in txn.cursor(db=self._meta):
            if key.startswith(NODE_PREFIX):
                loaded.add(Kind.NODE, int.from_bytes(key[len(NODE_PREFIX):], "big"), value)
        return loaded.written_nodes()

    def sync(self) -> None:
        started = time.monotonic()
        self.env.sync(True)
        elapsed = time.monotonic() - started
        if elapsed > 1:
            log.warning("syncing the master state took %.1f s", elapsed)

    def close(self) -> None:
        self.env.sync(True)
        self.env.close()
