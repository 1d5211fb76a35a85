"""The simplest pyfuse3 filesystem that can hold KV blocks: the ceiling of this stack.

One flat directory of files kept in Python memory, no metadata layer, no
capacity management. scripts/bench.py measures kvfs against it in the same run.
Usage: python scripts/trivialfs.py MOUNTPOINT (foreground; SIGTERM unmounts).
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import sys
import time

import pyfuse3
import trio

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from kvfs.fuse.mount import tune_connection  # noqa: E402  (same kernel tuning as kvfs)
from kvfs.config import MountConfig  # noqa: E402

TIMEOUT = 60.0


class TrivialFs(pyfuse3.Operations):
    def __init__(self) -> None:
        super().__init__()
        self.names: dict[bytes, int] = {}
        self.data: dict[int, bytearray] = {}
        self.next_ino = 2
        self.handles: dict[int, int] = {}

    def _attr(self, ino: int) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = ino
        entry.entry_timeout = entry.attr_timeout = TIMEOUT
        if ino == pyfuse3.ROOT_INODE:
            entry.st_mode, entry.st_size = stat.S_IFDIR | 0o755, 0
        else:
            entry.st_mode, entry.st_size = stat.S_IFREG | 0o644, len(self.data[ino])
        entry.st_blksize = 1 << 20
        now = time.time_ns()
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = now
        return entry

    async def lookup(self, parent_inode, name, ctx):
        ino = self.names.get(name)
        if ino is None:
            entry = pyfuse3.EntryAttributes()
            entry.st_ino = 0
            entry.entry_timeout = 1.0
            return entry
        return self._attr(ino)

    async def getattr(self, inode, ctx):
        return self._attr(inode)

    async def setattr(self, inode, attr, fields, fh, ctx):
        if fields.update_size:
            del self.data[inode][attr.st_size:]
        return self._attr(inode)

    async def create(self, parent_inode, name, mode, flags, ctx):
        ino = self.next_ino
        self.next_ino += 1
        self.names[name], self.data[ino] = ino, bytearray()
        return pyfuse3.FileInfo(fh=ino), self._attr(ino)

    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        return memoryview(self.data[fh])[off : off + size]

    async def write(self, fh, off, buf):
        data = self.data[fh]
        if off == len(data):
            data += buf
        else:
            data[off : off + len(buf)] = buf
        return len(buf)

    async def release(self, fh):
        pass

    async def rename(self, parent_inode_old, name_old, parent_inode_new, name_new, flags, ctx):
        old = self.names.pop(name_new, None)
        if old is not None:
            del self.data[old]
        self.names[name_new] = self.names.pop(name_old)

    async def unlink(self, parent_inode, name, ctx):
        try:
            del self.data[self.names.pop(name)]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id, token):
        for index, (name, ino) in enumerate(list(self.names.items())[start_id:], start_id + 1):
            if not pyfuse3.readdir_reply(token, name, self._attr(ino), index):
                return


async def serve(mountpoint: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, tune_connection, mountpoint, MountConfig(mountpoint, 1 << 30))
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            nursery.start_soon(_stop_on_signal, signals)
            await pyfuse3.main()
            nursery.cancel_scope.cancel()


async def _stop_on_signal(signals) -> None:
    async for _ in signals:
        pyfuse3.terminate()
        return


def main() -> None:
    mountpoint = sys.argv[1]
    options = set(pyfuse3.default_options) | {"fsname=trivialfs", "noatime"}
    pyfuse3.init(TrivialFs(), mountpoint, options)
    try:
        trio.run(serve, mountpoint)
    finally:
        pyfuse3.close(unmount=True)


if __name__ == "__main__":
    main()
