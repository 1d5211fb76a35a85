"""The pyfuse3 `Operations` of kvfs: kernel requests in, `Node` calls out.

Thin by design: attribute conversion, handle and lookup-count bookkeeping and
errno mapping live here; every decision is made by the node and the master.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from typing import Sequence

import pyfuse3
import trio

from kvfs.wire import messages as m
from kvfs.net.rpc import MasterUnavailable
from kvfs.config import MountConfig
from kvfs.errors import KvfsError
from kvfs.fuse.errors import fuse_handler
from kvfs.fuse.handles import HandleTable, LookupCounts
from kvfs.fuse.privilege import has_cap_sys_admin
from kvfs.histogram import OperationStats
from kvfs.node.service import Node, OpenFile
from kvfs.node.xattrs import ROOT_CONTROL

log = logging.getLogger("kvfs.fuse")

BLOCK_SIZE = 4096  # f_bsize/f_frsize: LMCache aligns O_DIRECT I/O to it
IO_SIZE = 1 << 20  # st_blksize: the largest FUSE request, so buffered callers send whole ones
READDIR_BATCH = 256


class KvfsOperations(pyfuse3.Operations):
    supports_dot_lookup = True
    enable_writeback_cache = False  # write-through keeps st_size exact and close-to-open simple

    def __init__(self, node: Node, config: MountConfig) -> None:
        super().__init__()
        self.node = node
        self.entry_timeout = config.entry_timeout_s
        self.negative_timeout = config.negative_timeout_s
        self.files: HandleTable[OpenFile] = HandleTable()
        self.lookups = LookupCounts()
        self._forgotten: set[int] = set()
        self._forgotten_event = trio.Event()
        self.operation_stats = OperationStats()  # kept by fuse_handler

    def _entry(self, attr: m.Attr, handed: bool = True) -> pyfuse3.EntryAttributes:
        if handed and stat.S_ISDIR(attr.mode):  # what the kernel holds, and since when (kvfs.node.kernelattrs)
            self.node.kernel_dirs.handed(attr, self.node.clock.monotonic())
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = attr.ino
        entry.generation = 0
        entry.entry_timeout = self.entry_timeout
        entry.attr_timeout = self.entry_timeout
        entry.st_mode = attr.mode
        entry.st_nlink = attr.nlink
        entry.st_uid = attr.uid
        entry.st_gid = attr.gid
        entry.st_rdev = 0
        entry.st_size = attr.size
        entry.st_blksize = IO_SIZE
        entry.st_blocks = -(-attr.size // 512)
        entry.st_atime_ns = attr.atime_ns
        entry.st_mtime_ns = attr.mtime_ns
        entry.st_ctime_ns = attr.ctime_ns
        return entry

    def _referenced(self, attr: m.Attr) -> pyfuse3.EntryAttributes:
        """An entry the kernel will hold a lookup reference on."""
        self.lookups.add(attr.ino)
        return self._entry(attr)

    # Names -----------------------------------------------------------------------------

    @fuse_handler
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        attr = await self.node.lookup(parent_inode, name)
        if attr is None:  # a negative entry the kernel caches for negative_timeout
            entry = pyfuse3.EntryAttributes()
            entry.st_ino = 0
            # (not one answered from a miss of the last second: kvfs.node.misses)
            entry.entry_timeout = 0 if self.node.misses.uncached(parent_inode, name) else self.negative_timeout
            return entry
        return self._referenced(attr)

    def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:  # type: ignore[override]
        # forget may not await: inodes the kernel dropped are handed to run_forgetter().
        for ino, count in inode_list:
            if self.lookups.forget(ino, count):
                self._forgotten.add(ino)
        if self._forgotten:
            self._forgotten_event.set()

    async def run_forgetter(self) -> None:
        """Tells the master which inodes the kernel no longer references (a background task)."""
        while True:
            await self._forgotten_event.wait()
            self._forgotten_event = trio.Event()
            # An inode looked up again since it was forgotten is referenced once more.
            gone = [ino for ino in self._forgotten if not self.lookups.known(ino)]
            self._forgotten.clear()
            if gone:
                try:
                    await self.node.forget(gone)
                except MasterUnavailable:  # a new master knows no kernel references anyway
                    log.warning("could not tell the master to forget %d inodes: it is unreachable", len(gone))
                except Exception:
                    log.exception("telling the master to forget %d inodes failed", len(gone))

    @fuse_handler
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        kept = self.node.kernel_dirs.answer(inode, self.node.clock.monotonic(), self.entry_timeout)
        if kept is not None:  # dropped after a private temp file's change only: valid as long as it was
            entry = self._entry(kept[0], handed=False)
            entry.attr_timeout = kept[1]
            return entry
        return self._entry(await self.node.getattr(inode))

    @fuse_handler
    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes, fields: pyfuse3.SetattrFields,
                      fh: int | None, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        handle = self.files.get(fh) if fh is not None else None
        result = await self.node.setattr(
            inode,
            size=attr.st_size if fields.update_size else None,
            mode=attr.st_mode if fields.update_mode else None,
            uid=attr.st_uid if fields.update_uid else None,
            gid=attr.st_gid if fields.update_gid else None,
            atime_ns=attr.st_atime_ns if fields.update_atime else None,
            mtime_ns=attr.st_mtime_ns if fields.update_mtime else None,
            handle=handle,
        )
        return self._entry(result)

    @fuse_handler
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._referenced(await self.node.mkdir(parent_inode, name, mode & ~ctx.umask, ctx.uid, ctx.gid))

    @fuse_handler
    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.node.rmdir(parent_inode, name)

    @fuse_handler
    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        await self.node.unlink(parent_inode, name)

    @fuse_handler
    async def rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                     flags: int, ctx: pyfuse3.RequestContext) -> None:
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise KvfsError(errno.EINVAL, "RENAME_EXCHANGE is not supported")
        await self.node.rename(parent_inode_old, name_old, parent_inode_new, name_new,
                               noreplace=bool(flags & pyfuse3.RENAME_NOREPLACE))

    @fuse_handler
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._referenced(await self.node.symlink(parent_inode, name, target, ctx.uid, ctx.gid))

    @fuse_handler
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise KvfsError(errno.EPERM, "hard links are not supported (a KV block has exactly one name)")

    @fuse_handler
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        raise KvfsError(errno.EPERM, "device nodes, fifos and sockets are not supported")

    @fuse_handler
    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.node.readlink(inode)

    # Directories -----------------------------------------------------------------------

    @fuse_handler
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        attr = await self.node.getattr(inode)
        if not stat.S_ISDIR(attr.mode):
            raise KvfsError(errno.ENOTDIR, f"inode {inode} is not a directory")
        return inode

    @fuse_handler
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        while True:
            entries = await self.node.readdir(fh, start_id, READDIR_BATCH)
            for entry in entries:
                if not pyfuse3.readdir_reply(token, entry.name, self._entry(entry.attr), entry.next_id):
                    return
                self.lookups.add(entry.attr.ino)
                start_id = entry.next_id
            if len(entries) < READDIR_BATCH:
                return

    @fuse_handler
    async def releasedir(self, fh: int) -> None:
        return None

    @fuse_handler
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        return None

    # Files -----------------------------------------------------------------------------

    @fuse_handler
    async def create(self, parent_inode: int, name: bytes, mode: int, flags: int,
                     ctx: pyfuse3.RequestContext) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        handle, attr = await self.node.create(parent_inode, name, mode & ~ctx.umask, ctx.uid, ctx.gid,
                                              exclusive=bool(flags & os.O_EXCL))
        return pyfuse3.FileInfo(fh=self.files.add(handle)), self._referenced(attr)

    @fuse_handler
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        handle, keep_cache = await self.node.open(inode, flags, ctx.uid)
        return pyfuse3.FileInfo(fh=self.files.add(handle), keep_cache=keep_cache)

    @fuse_handler
    async def read(self, fh: int, off: int, size: int) -> bytes:
        return await self.node.read(self.files.get(fh), off, size)  # type: ignore[return-value]

    @fuse_handler
    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.node.write(self.files.get(fh), off, buf)

    async def flush(self, fh: int) -> None:
        # Bytes are in the DRAM tier as soon as write returns, and a file is sealed at the
        # RELEASE of its last writer (close() of one descriptor may leave a duplicate open):
        # close() has nothing to wait for. ENOSYS makes the kernel stop sending FLUSH, one
        # round trip less per close.
        raise pyfuse3.FUSEError(errno.ENOSYS)

    @fuse_handler
    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.node.fsync(self.files.get(fh))

    @fuse_handler
    async def release(self, fh: int) -> None:
        await self.node.release(self.files.pop(fh))

    # Extended attributes and file system -----------------------------------------------

    @fuse_handler
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.node.xattrs.getxattr(inode, name)

    @fuse_handler
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext) -> None:
        if name == ROOT_CONTROL and inode == pyfuse3.ROOT_INODE and not has_cap_sys_admin(ctx.pid):
            raise KvfsError(errno.EPERM, f"{ROOT_CONTROL.decode()}: needs CAP_SYS_ADMIN (uid {ctx.uid}, "
                                         f"pid {ctx.pid} has not)")
        try:
            await self.node.xattrs.setxattr(inode, name, value)
        finally:  # (a directory's ctime moved: a getattr answered meanwhile may show it or not)
            self.node.kernel_dirs.changed(inode)

    @fuse_handler
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        return await self.node.xattrs.listxattr(inode)

    @fuse_handler
    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        try:
            await self.node.xattrs.removexattr(inode, name)
        finally:
            self.node.kernel_dirs.changed(inode)

    @fuse_handler
    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        await self.node.getattr(inode)  # permissions are checked by the kernel (default_permissions)
        return True

    @fuse_handler
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        stats = await self.node.stats()
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = BLOCK_SIZE
        data.f_blocks = stats.capacity // BLOCK_SIZE
        data.f_bfree = data.f_bavail = (stats.capacity - stats.used) // BLOCK_SIZE
        inode_capacity = max(stats.inodes, stats.capacity // BLOCK_SIZE)
        data.f_files = inode_capacity
        data.f_ffree = data.f_favail = inode_capacity - stats.inodes
        data.f_namemax = 255
        return data
