"""The master's durable state in lmdb: inodes, file versions, node names.

After every request the master writes what the request changed (the dirty sets
of the namespace, the object directory and the registry) in one transaction, so
a restart, even after kill -9, finds every name it ever acknowledged. Commits
are not fsynced one by one (the page cache survives a killed process); a timer
syncs them. What a machine crash loses on the master is re-learned from the
nodes, which report everything they hold when they register again.

Open handles, kernel references and liveness are not saved: nodes report their
open handles when they register again, and every node starts out not alive.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import lmdb
import msgspec

from kvfs.cluster.master import MetadataService
from kvfs.cluster.namespace import Inode
from kvfs.cluster.objects import FileVersion

log = logging.getLogger(__name__)

LAYOUT = 1


class SavedInode(msgspec.Struct, array_like=True):
    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    parent: int
    name: bytes
    entry_id: int
    is_dir: bool
    version: int
    xattrs: dict[bytes, bytes]
    target: bytes = b""  # a symbolic link's (state saved before symlinks existed has none)


class SavedVersion(msgspec.Struct, array_like=True):
    ino: int
    node: int
    size: int
    sealed: bool
    current: bool
    on_disk: bool
    checksums: list[int]


class SavedMeta(msgspec.Struct):
    layout: int
    next_ino: int
    next_entry_id: int
    next_version: int
    nodes: list[tuple[int, str, str]]  # id, name, peer address


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
        self._encode = msgspec.msgpack.Encoder().encode
        self.commits = 0

    def load(self, service: MetadataService) -> int:
        """Fills a fresh service with the saved state; returns the number of files."""
        decode_inode = msgspec.msgpack.Decoder(SavedInode).decode
        decode_version = msgspec.msgpack.Decoder(SavedVersion).decode
        with self.env.begin() as txn:
            raw_meta = txn.get(b"meta", db=self._meta)
            if raw_meta is None:
                return 0
            meta = msgspec.msgpack.decode(raw_meta, type=SavedMeta)
            inodes = []
            for key, value in txn.cursor(db=self._inodes):
                saved = decode_inode(value)
                inode = Inode(int.from_bytes(key, "big"), saved.mode, saved.uid, saved.gid, saved.atime_ns,
                              saved.mtime_ns, saved.ctime_ns, saved.parent, saved.name,
                              {} if saved.is_dir else None, dict(saved.xattrs), saved.version, saved.entry_id,
                              target=saved.target)
                inodes.append(inode)
            versions = []
            for key, value in txn.cursor(db=self._versions):
                saved_version = decode_version(value)
                versions.append(FileVersion(int.from_bytes(key, "big"), saved_version.ino, saved_version.node,
                                            saved_version.size, saved_version.sealed, saved_version.current,
                                            checksums=saved_version.checksums, on_disk=saved_version.on_disk))
        service.load(inodes, versions, meta.next_ino, meta.next_entry_id, meta.next_version, meta.nodes)
        return service.ns.files

    def save(self, service: MetadataService) -> None:
        """Writes what changed since the last save, in one transaction."""
        ns, objects, registry = service.ns, service.objects, service.registry
        if not ns.dirty and not objects.dirty and not registry.dirty:
            return
        with self.env.begin(write=True) as txn:
            for ino in ns.dirty:
                inode = ns.inodes.get(ino)
                if inode is not None and inode.linked:
                    txn.put(_key(ino), self._encode(SavedInode(
                        inode.mode, inode.uid, inode.gid, inode.atime_ns, inode.mtime_ns, inode.ctime_ns,
                        inode.parent, inode.name, inode.entry_id, inode.is_dir, inode.version, inode.xattrs,
                        inode.target)),
                        db=self._inodes)
                else:
                    txn.delete(_key(ino), db=self._inodes)
            for version_id in objects.dirty:
                version = objects.versions.get(version_id)
                if version is not None:
                    txn.put(_key(version_id), self._encode(SavedVersion(
                        version.ino, version.node, version.size, version.sealed, version.current, version.on_disk,
                        version.checksums)), db=self._versions)
                else:
                    txn.delete(_key(version_id), db=self._versions)
            nodes = [(n.node_id, n.name, n.address) for n in registry.nodes.values() if n.node_id not in registry.permanent]
            txn.put(b"meta", self._encode(SavedMeta(LAYOUT, ns.next_ino, ns.next_entry_id, objects.next_version,
                                                    nodes)), db=self._meta)
        ns.dirty.clear()
        objects.dirty.clear()
        registry.dirty = False
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
