"""A node's extended attributes: `user.*` ones the master keeps, the read-only
`user.kvfs.*` ones computed from the master's and the store's facts (what `kvfs
inspect` shows), and the root directory's statistics, usage and control.

A collaborator of the node's file service (`Node.xattrs`); it reads the service's
attributes and counters through the small `XattrNode` interface.
"""

from __future__ import annotations

import errno
import json
import logging
from typing import Any, Protocol

import msgspec

from kvfs.checksum import format_checksum
from kvfs.cluster.embedded import MasterClient
from kvfs.cluster.namespace import ROOT_INO
from kvfs.config import format_size
from kvfs.errors import StorageError
from kvfs.store.tiered import TieredStore
from kvfs.wire import messages as m

log = logging.getLogger("kvfs.node")

VIRTUAL_XATTRS = (b"user.kvfs.tier", b"user.kvfs.size", b"user.kvfs.version", b"user.kvfs.sealed",
                  b"user.kvfs.chunks", b"user.kvfs.checksum", b"user.kvfs.hits", b"user.kvfs.last_access_ns",
                  b"user.kvfs.node", b"user.kvfs.node_name", b"user.kvfs.on_ssd", b"user.kvfs.leases",
                  b"user.kvfs.ssd_extents", b"user.kvfs.info")
VIRTUAL_PREFIX = b"user.kvfs."
USER_PREFIX = b"user."  # the only namespace a setxattr may use (kvfs.cluster.validate)
ROOT_STATS = b"user.kvfs.stats"  # JSON counters of the node's store, on the root directory
ROOT_USAGE = b"user.kvfs.usage"  # JSON use per top-level directory (`kvfs du`), on the root directory
ROOT_USAGE_COUNTERS = b"user.kvfs.usage_counters"  # the same without summing the files (cheap)
ROOT_CONTROL = b"user.kvfs.control"  # "sync" (wait for offload), "flush" (offload all), "drop-dram"


class XattrNode(Protocol):
    """What the extended attributes need of the node's file service."""

    node_id: int

    async def getattr(self, ino: int) -> m.Attr:
        """A file's attributes as the kernel sees them."""

    async def change(self, request: m.Request) -> Any:
        """A change of this node, sent to the master: its answer."""

    async def promote(self, ino: int) -> None:
        """A temp file only this node knows goes to the master first (kvfs.node.private)."""

    def is_private_ino(self, ino: int) -> bool:
        """A temp file only this node knows: it has no user.* attribute (setting one promotes it)."""

    def store_stats(self) -> dict[str, float]:
        """The node's store and activity counters."""


class NodeXattrs:
    def __init__(self, master: MasterClient, store: TieredStore, node: XattrNode) -> None:
        self.master = master
        self.store = store
        self.node = node

    async def getxattr(self, ino: int, name: bytes) -> bytes:
        if ino == ROOT_INO and name == ROOT_STATS:
            namespace = await self.master.call(m.Stats())
            holdings = self.store.holdings()
            on_ssd = sum(1 for holding in holdings if holding[3])
            stats = {**self.node.store_stats(), "files": namespace.files, "inodes": namespace.inodes,
                     "sealed_bytes": namespace.sealed_bytes, "stored_files": len(holdings),
                     "stored_bytes": sum(holding[1] for holding in holdings), "ssd_files": on_ssd,
                     "dram_only_files": len(holdings) - on_ssd}
            return json.dumps(stats, sort_keys=True).encode()
        if ino == ROOT_INO and name in (ROOT_USAGE, ROOT_USAGE_COUNTERS):
            usage = await self.master.call(m.DirUsage(files=name == ROOT_USAGE))
            return msgspec.json.encode(usage)
        if name.startswith(VIRTUAL_PREFIX):
            return await self._virtual_xattr(ino, name)
        if not name.startswith(USER_PREFIX):
            # Only user.* attributes can be set, so no other exists: answered here. The
            # kernel asks for security.capability before every write to a file (to clear
            # it), which would otherwise be a master round trip per write.
            raise StorageError(errno.ENODATA, f"no xattr {name!r} on inode {ino} (only user.* attributes exist)")
        if self.node.is_private_ino(ino):
            raise StorageError(errno.ENODATA, f"no xattr {name!r} on inode {ino}")
        return (await self.master.call(m.GetXattr(ino, name))).value

    async def setxattr(self, ino: int, name: bytes, value: bytes) -> None:
        if ino == ROOT_INO and name == ROOT_CONTROL:
            return await self._control(value.decode(errors="replace").strip())
        if name.startswith(VIRTUAL_PREFIX):
            raise StorageError(errno.EPERM, f"xattr {name!r} is read-only (maintained by kvfs)")
        await self.node.promote(ino)
        await self.node.change(m.SetXattr(ino, name, value))
        await self._refresh_file_record(ino)

    async def removexattr(self, ino: int, name: bytes) -> None:
        if name.startswith(VIRTUAL_PREFIX):
            raise StorageError(errno.EPERM, f"xattr {name!r} is read-only (maintained by kvfs)")
        await self.node.promote(ino)
        await self.node.change(m.RemoveXattr(ino, name))
        await self._refresh_file_record(ino)

    async def _refresh_file_record(self, ino: int) -> None:
        attr = await self.master.call(m.GetAttr(ino))
        if attr.version:
            await self.store.refresh_record(attr.version)

    async def _control(self, command: str) -> None:
        if command == "sync":  # what the offloader has queued is on SSD when this returns
            self.store.retry_now()
            await self.store.wait_offloaded()
            self._check_offloaded("sync")
        elif command == "flush":  # everything sealed is on SSD when this returns (also in watermark mode)
            self.store.retry_now()
            self.store.queue_all_dram_only()
            await self.store.wait_offloaded()
            self._check_offloaded("flush")
        elif command == "drop-dram":
            demoted = self.store.demote_all()
            log.info("control: dropped the DRAM copies of %d files already on SSD", demoted)
        else:
            raise StorageError(errno.EINVAL, f"unknown control command {command!r} (sync, flush, drop-dram)")

    def _check_offloaded(self, command: str) -> None:
        """sync and flush fail with EIO while files wait for the SSD tier to work again."""
        failed, nbytes = self.store.offload_failed()
        if failed:
            raise StorageError(errno.EIO, f"control {command}: {failed} files ({format_size(nbytes)}) could not be "
                                          f"copied to SSD: {self.store.faults.last_error()}")

    async def listxattr(self, ino: int) -> list[bytes]:
        if self.node.is_private_ino(ino):  # (ls -l asks: no reason to hand the file over)
            return list(VIRTUAL_XATTRS)
        names = (await self.master.call(m.ListXattr(ino))).names
        if ino == ROOT_INO:
            return names + [ROOT_STATS, ROOT_USAGE]
        attr = await self.node.getattr(ino)
        return names + list(VIRTUAL_XATTRS) if attr.version else names

    async def _virtual_xattr(self, ino: int, name: bytes) -> bytes:
        await self.node.promote(ino)
        attr = await self.node.getattr(ino)
        if not attr.version or name not in VIRTUAL_XATTRS:
            raise StorageError(errno.ENODATA, f"no xattr {name!r} on inode {ino}")
        info: m.VersionInfo = await self.master.call(m.GetVersion(attr.version))
        facts = self._file_facts(attr, info)
        if name == b"user.kvfs.info":
            return json.dumps(facts, sort_keys=True).encode()
        values = {
            b"user.kvfs.tier": facts["tier"],
            b"user.kvfs.size": facts["size"],
            b"user.kvfs.version": facts["version"],
            b"user.kvfs.sealed": "yes" if info.sealed else "no",
            b"user.kvfs.chunks": len(facts["chunks"]),
            b"user.kvfs.checksum": ",".join(chunk["checksum"] for chunk in facts["chunks"] if chunk["checksum"]),
            b"user.kvfs.hits": info.hits,
            b"user.kvfs.last_access_ns": info.last_access_ns,
            b"user.kvfs.node": info.node,
            b"user.kvfs.node_name": info.node_name,
            b"user.kvfs.on_ssd": "yes" if info.on_disk else "no",
            b"user.kvfs.leases": f"readers={info.readers} writers={info.writers}",
            b"user.kvfs.ssd_extents": facts["ssd_extents"],
        }
        return str(values[name]).encode()

    def _file_facts(self, attr: m.Attr, info: m.VersionInfo) -> dict:
        """Everything `kvfs inspect` shows of a file: where its chunks are, their checksums, use."""
        stored_here = info.node == self.node.node_id
        tier = self.store.tier_of(info.version) if stored_here else "peer"
        chunk_total = len(info.checksums) if info.sealed else -(-attr.size // self.store.chunk_size)
        chunks = [{"index": index, "offset": index * self.store.chunk_size,
                   "length": min(self.store.chunk_size, attr.size - index * self.store.chunk_size),
                   "checksum": format_checksum(info.checksums[index]) if index < len(info.checksums) else ""}
                  for index in range(chunk_total)]
        return {"size": attr.size, "version": info.version, "sealed": info.sealed, "tier": tier,
                "node": info.node, "node_name": info.node_name, "node_address": info.node_address,
                "node_up": info.node_live, "stored_here": stored_here, "on_ssd": info.on_disk,
                "hits": info.hits, "last_access_ns": info.last_access_ns,
                "readers": info.readers, "writers": info.writers, "chunk_size": self.store.chunk_size, "chunks": chunks,
                "ssd_extents": self.store.describe_extents(info.version) if stored_here else ""}
