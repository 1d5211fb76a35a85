"""The master's durable records, pure: what a save writes and how a load reads it back.

A save turns the metadata service's dirty sets into `Change`s: one record per inode, per
file version and per node, and one for the counters (the next inode, entry, version and node
numbers); a record whose object is gone is a deletion (value None). A store (lmdb in
kvfs.cluster.persist, etcd in kvfs.net.etcdstate) writes them in one transaction and,
once that committed, clears the dirty sets (`clear_dirty`). A load decodes the stored
records into a `Loaded` and hands it to `MetadataService.load`.

Nodes are written only when the registry changed (a registration, a new address, a node
forgotten, a block of numbers granted to it), never on every request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated

import msgspec

from kvfs.cluster.master import MetadataService
from kvfs.cluster.namespace import Inode, make_inode
from kvfs.cluster.objects import FileVersion
from kvfs.cluster.registry import NODE_ID_MAX, Grant

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


class SavedCounters(msgspec.Struct, array_like=True):
    layout: int
    next_ino: int
    next_entry_id: int
    next_version: int
    # The next node id (Registry.next_id): ids of removed nodes are not handed out again after
    # a restart or failover. 0: saved before it was (the load derives it from the nodes, as then).
    next_node: Annotated[int, msgspec.Meta(ge=0, le=NODE_ID_MAX + 1)] = 0


class SavedNode(msgspec.Struct, array_like=True):
    name: str
    address: str  # its peer address
    # The number blocks granted to it (first inode, first version, count): a Publish of their
    # numbers is accepted after a restart or a failover (records saved before have none).
    grants: list[tuple[int, int, int]] = []


NodeFields = tuple[str, str, tuple[Grant, ...]]  # a node as saved: name, peer address, grants


class SavedMeta(msgspec.Struct):
    """The lmdb store's meta record: the counters and every node (layout 1)."""

    layout: int
    next_ino: int
    next_entry_id: int
    next_version: int
    nodes: list[tuple[int, str, str]]  # id, name, peer address


class Kind(Enum):
    INODE = "i"
    VERSION = "v"
    COUNTERS = "c"
    NODE = "n"


@dataclass(frozen=True)
class Change:
    kind: Kind
    number: int  # the inode, version or node number (0 for the counters)
    value: bytes | None  # the encoded record; None: delete it


_encode = msgspec.msgpack.Encoder().encode
_decode_inode = msgspec.msgpack.Decoder(SavedInode).decode
_decode_version = msgspec.msgpack.Decoder(SavedVersion).decode
_decode_counters = msgspec.msgpack.Decoder(SavedCounters).decode
_decode_node = msgspec.msgpack.Decoder(SavedNode).decode


def encode_inode(inode: Inode) -> bytes:
    return _encode(SavedInode(inode.mode, inode.uid, inode.gid, inode.atime_ns, inode.mtime_ns, inode.ctime_ns,
                              inode.parent, inode.name, inode.entry_id, inode.is_dir, inode.version, inode.xattrs,
                              inode.target))


def encode_version(version: FileVersion) -> bytes:
    return _encode(SavedVersion(version.ino, version.node, version.size, version.sealed, version.current,
                                version.on_disk, version.checksums))


def saved_nodes(service: MetadataService) -> dict[int, NodeFields]:
    """The nodes a save keeps: every registered node but the permanent (embedded) one."""
    registry = service.registry
    return {n.node_id: (n.name, n.address, tuple(n.grants)) for n in registry.nodes.values()
            if n.node_id not in registry.permanent}


def is_dirty(service: MetadataService) -> bool:
    return bool(service.ns.dirty or service.objects.dirty or service.registry.dirty)


def changes(service: MetadataService, written_nodes: dict[int, NodeFields]) -> list[Change]:
    """What changed since the dirty sets were last cleared. `written_nodes` are the nodes
    as the store last wrote them: nodes are compared with it only when the registry is
    dirty (the caller keeps `saved_nodes(service)` as the new written set once committed)."""
    ns, objects = service.ns, service.objects
    out: list[Change] = []
    for ino in sorted(ns.dirty):
        inode = ns.inodes.get(ino)
        out.append(Change(Kind.INODE, ino, encode_inode(inode) if inode is not None and inode.linked else None))
    for version_id in sorted(objects.dirty):
        version = objects.versions.get(version_id)
        out.append(Change(Kind.VERSION, version_id, None if version is None else encode_version(version)))
    if service.registry.dirty:
        current = saved_nodes(service)
        for node_id, fields in sorted(current.items()):
            if written_nodes.get(node_id) != fields:
                name, address, grants = fields
                out.append(Change(Kind.NODE, node_id, _encode(SavedNode(name, address, list(grants)))))
        out.extend(Change(Kind.NODE, node_id, None) for node_id in sorted(written_nodes.keys() - current.keys()))
    if out:
        out.append(Change(Kind.COUNTERS, 0, _encode(SavedCounters(LAYOUT, ns.next_ino, ns.next_entry_id,
                                                                  objects.next_version,
                                                                  service.registry.next_id))))
    return out


def clear_dirty(service: MetadataService) -> None:
    """After the changes taken from the service committed."""
    service.ns.dirty.clear()
    service.objects.dirty.clear()
    service.registry.dirty = False


def encode_meta(service: MetadataService) -> bytes:
    """The lmdb store's meta record."""
    ns = service.ns
    nodes = [(node_id, name, address) for node_id, (name, address, _) in saved_nodes(service).items()]
    return _encode(SavedMeta(LAYOUT, ns.next_ino, ns.next_entry_id, service.objects.next_version, nodes))


@dataclass
class Loaded:
    """Stored records, decoded, ready for `MetadataService.load`."""

    inodes: list[Inode] = field(default_factory=list)
    versions: list[FileVersion] = field(default_factory=list)
    next_ino: int = 0
    next_entry_id: int = 0
    next_version: int = 0
    next_node: int = 0  # the saved high-water mark of node ids (0: none saved)
    nodes: list[tuple[int, str, str]] = field(default_factory=list)
    grants: dict[int, list[Grant]] = field(default_factory=dict)  # by node id
    found: bool = False  # any counters record: state was saved before

    def add(self, kind: Kind, number: int, value: bytes) -> None:
        """One stored record (msgspec.DecodeError on a damaged one)."""
        if kind is Kind.INODE:
            self.inodes.append(decode_inode(number, value))
        elif kind is Kind.VERSION:
            self.versions.append(decode_version(number, value))
        elif kind is Kind.NODE:
            node = _decode_node(value)
            self.nodes.append((number, node.name, node.address))
            self.grants[number] = [tuple(grant) for grant in node.grants]  # type: ignore[misc]
        else:
            counters = _decode_counters(value)
            self.next_ino, self.next_entry_id, self.next_version = (counters.next_ino, counters.next_entry_id,
                                                                    counters.next_version)
            self.next_node = counters.next_node
            self.found = True

    def add_meta(self, value: bytes) -> None:
        """The lmdb store's meta record."""
        meta = msgspec.msgpack.decode(value, type=SavedMeta)
        self.next_ino, self.next_entry_id, self.next_version = meta.next_ino, meta.next_entry_id, meta.next_version
        self.nodes = list(meta.nodes)
        self.found = True

    def into(self, service: MetadataService) -> int:
        """Fills a fresh service; the number of files (0 when nothing was saved)."""
        if not self.found:
            return 0
        service.load(self.inodes, self.versions, self.next_ino, self.next_entry_id, self.next_version, self.nodes,
                     self.grants)
        service.registry.reserve(self.next_node)
        return service.ns.files

    def written_nodes(self) -> dict[int, NodeFields]:
        """The nodes as they are stored, as `saved_nodes` gives them (for `changes`)."""
        return {number: (name, address, tuple(self.grants.get(number, ()))) for number, name, address in self.nodes}


def decode_inode(ino: int, value: bytes) -> Inode:
    saved = _decode_inode(value)
    # Equal numbers as one int object, as the live master keeps them (32 B per file for each:
    # docs/cluster.md, "Memory per file"); the times are packed into one by the inode.
    version = ino if saved.version == ino else saved.version
    entry_id = ino if saved.entry_id == ino else saved.entry_id
    return make_inode(ino, saved.mode, saved.uid, saved.gid, saved.atime_ns, saved.mtime_ns, saved.ctime_ns,
                      saved.parent, saved.name, {} if saved.is_dir else None, dict(saved.xattrs), version,
                      entry_id, target=saved.target)


def decode_version(version_id: int, value: bytes) -> FileVersion:
    saved = _decode_version(value)
    return FileVersion(version_id, version_id if saved.ino == version_id else saved.ino, saved.node, saved.size,
                       saved.sealed, saved.current, checksums=saved.checksums, on_disk=saved.on_disk)
