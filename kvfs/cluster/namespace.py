"""The namespace: inodes, directory entries, attributes and user xattrs (pure)."""

from __future__ import annotations

import errno
import stat
from dataclasses import dataclass, field

from kvfs.errors import MetadataError

ROOT_INO = 1
NAME_MAX = 255
SYMLINK_MAX = 4095  # PATH_MAX - 1: the longest target the kernel hands to symlink()


@dataclass(slots=True, eq=False)
class Inode:
    ino: int
    mode: int
    uid: int
    gid: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    parent: int = 0  # 0 once unlinked
    name: bytes = b""
    # name -> (child inode, entry id); insertion order is entry-id order, which
    # lets a listing resume after any entry even while entries come and go.
    children: dict[bytes, tuple[int, int]] | None = None
    xattrs: dict[bytes, bytes] = field(default_factory=dict)
    version: int = 0  # the file's current version
    entry_id: int = 0  # position in its parent's listing
    refs: int = 0  # bit n set: node n's kernel holds a lookup reference
    watchers: int = 0  # bit n set: node n keeps a copy of this directory's names
    target: bytes = b""  # a symbolic link's target (fixed at creation)
    subdirs: int = 0  # directories among the children (derived, not saved): st_nlink is 2 + subdirs

    @property
    def referenced(self) -> bool:
        return self.refs != 0

    @property
    def is_dir(self) -> bool:
        return self.children is not None

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.mode)

    @property
    def is_file(self) -> bool:
        """A regular file: the only kind of inode that has versions and bytes."""
        return self.children is None and not stat.S_ISLNK(self.mode)

    @property
    def linked(self) -> bool:
        return self.parent != 0 or self.ino == ROOT_INO


def check_name(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise MetadataError(errno.ENAMETOOLONG, f"name of {len(name)} bytes (limit {NAME_MAX})")
    if not name or b"/" in name or b"\0" in name:
        raise MetadataError(errno.EINVAL, f"invalid name {name!r}")


def check_target(target: bytes) -> None:
    """A symbolic link's target: as Linux file systems accept it (non-empty, at most PATH_MAX - 1)."""
    if not target:
        raise MetadataError(errno.ENOENT, "empty symbolic link target")
    if len(target) > SYMLINK_MAX:
        raise MetadataError(errno.ENAMETOOLONG, f"symbolic link target of {len(target)} bytes (limit {SYMLINK_MAX})")
    if b"\0" in target:
        raise MetadataError(errno.EINVAL, f"symbolic link target {target[:64]!r} holds a NUL byte")


class Namespace:
    """Directories and their entries; every inode knows its one parent and name."""

    def __init__(self, now_ns: int, root_mode: int = 0o755, root_uid: int = 0, root_gid: int = 0) -> None:
        root = Inode(ROOT_INO, stat.S_IFDIR | root_mode, root_uid, root_gid, now_ns, now_ns, now_ns, children={})
        root.refs = -1  # every node references the root, always
        self.inodes: dict[int, Inode] = {ROOT_INO: root}
        self.next_ino = ROOT_INO + 1
        self.next_entry_id = 1
        self.files = 0
        # Inodes whose persistent fields changed since the owner last saved them.
        self.dirty: set[int] = {ROOT_INO}
        # Entries added or removed in watched directories: (watchers, directory, name, added).
        self.changes: list[tuple[int, int, bytes, bool]] = []

    def get(self, ino: int) -> Inode:
        inode = self.inodes.get(ino)
        if inode is None:
            raise MetadataError(errno.ENOENT, f"inode {ino} does not exist")
        return inode

    def directory(self, ino: int) -> Inode:
        inode = self.get(ino)
        if inode.children is None:
            raise MetadataError(errno.ENOTDIR, f"inode {ino} is not a directory")
        return inode

    def lookup(self, parent: int, name: bytes) -> Inode | None:
        directory = self.directory(parent)
        if name == b".":
            return directory
        if name == b"..":
            return self.inodes[directory.parent or ROOT_INO]
        entry = directory.children.get(name)  # type: ignore[union-attr]
        return None if entry is None else self.inodes[entry[0]]

    def existing(self, parent: int, name: bytes) -> Inode:
        inode = self.lookup(parent, name)
        if inode is None:
            raise MetadataError(errno.ENOENT, f"no entry {name!r} in directory {parent}")
        return inode

    def new_inode(self, mode: int, uid: int, gid: int, now_ns: int, directory: bool) -> Inode:
        inode = Inode(self.next_ino, mode, uid, gid, now_ns, now_ns, now_ns, children={} if directory else None)
        self.next_ino += 1
        self.inodes[inode.ino] = inode
        self.dirty.add(inode.ino)
        if not directory:
            self.files += 1
        return inode

    def new_symlink(self, target: bytes, uid: int, gid: int, now_ns: int) -> Inode:
        inode = Inode(self.next_ino, stat.S_IFLNK | 0o777, uid, gid, now_ns, now_ns, now_ns, target=target)
        self.next_ino += 1
        self.inodes[inode.ino] = inode
        self.dirty.add(inode.ino)
        return inode

    def link(self, parent: Inode, name: bytes, inode: Inode, now_ns: int) -> None:
        assert parent.children is not None and name not in parent.children
        parent.children[name] = (inode.ino, self.next_entry_id)
        inode.entry_id = self.next_entry_id
        self.next_entry_id += 1
        inode.parent, inode.name = parent.ino, name
        if inode.is_dir:
            parent.subdirs += 1
        parent.mtime_ns = parent.ctime_ns = now_ns
        self.dirty.update((parent.ino, inode.ino))
        if parent.watchers:
            self.changes.append((parent.watchers, parent.ino, name, True))

    def unlink(self, inode: Inode, now_ns: int) -> None:
        """Removes the inode's entry; the inode goes too unless the kernel still references it."""
        self.detach(inode, now_ns)
        self.collect(inode)

    def detach(self, inode: Inode, now_ns: int) -> None:
        """Removes the inode's entry but keeps the inode (for rename)."""
        parent = self.inodes[inode.parent]
        del parent.children[inode.name]  # type: ignore[union-attr]
        if inode.is_dir:
            parent.subdirs -= 1
        parent.mtime_ns = parent.ctime_ns = now_ns
        if parent.watchers:
            self.changes.append((parent.watchers, parent.ino, inode.name, False))
        inode.parent = 0
        inode.ctime_ns = now_ns
        self.dirty.update((parent.ino, inode.ino))

    def collect(self, inode: Inode) -> None:
        """Frees an inode that no entry and no kernel reference points at."""
        if not inode.linked and not inode.referenced and inode.ino in self.inodes:
            del self.inodes[inode.ino]
            self.dirty.add(inode.ino)
            if inode.is_file:
                self.files -= 1

    def restore(self, inodes: list[Inode]) -> None:
        """Rebuilds the tree from saved inodes (each knows its parent, name and entry id)."""
        for inode in inodes:
            self.inodes[inode.ino] = inode
            self.next_ino = max(self.next_ino, inode.ino + 1)
            self.next_entry_id = max(self.next_entry_id, inode.entry_id + 1)
            if inode.is_file:
                self.files += 1
        for inode in sorted(inodes, key=lambda i: i.entry_id):
            if inode.parent:
                parent = self.inodes[inode.parent]
                parent.children[inode.name] = (inode.ino, inode.entry_id)  # type: ignore[index]
                parent.subdirs += inode.is_dir
        self.dirty.clear()

    def is_ancestor(self, ancestor: int, ino: int) -> bool:
        while ino != ROOT_INO and ino != 0:
            if ino == ancestor:
                return True
            ino = self.inodes[ino].parent
        return ancestor == ROOT_INO

    def listing(self, directory: Inode, start_id: int, limit: int) -> list[tuple[bytes, Inode, int]]:
        out = []
        for name, (ino, entry_id) in directory.children.items():  # type: ignore[union-attr]
            if entry_id <= start_id:
                continue
            out.append((name, self.inodes[ino], entry_id))
            if len(out) >= limit:
                break
        return out
