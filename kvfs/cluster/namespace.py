"""The namespace: inodes, directory entries, attributes and user xattrs (pure)."""

from __future__ import annotations

import errno
import stat

from kvfs.cluster.entries import Entries
from kvfs.cluster.names import pack, unpack
from kvfs.cluster.table import NumberTable
from kvfs.cluster.times import BASE_NS, CTIME_SHIFT, FIELD_BITS, FIELD_MASK, MTIME_SHIFT, Times
from kvfs.cluster.times import atime_of, ctime_of, mtime_of, pack as pack_times, unpack as unpack_times
from kvfs.errors import MetadataError

ROOT_INO = 1
NAME_MAX = 255
SYMLINK_MAX = 4095  # PATH_MAX - 1: the longest target the kernel hands to symlink()


_SHARED_METAS = 4096  # distinct (mode, uid, gid) that inodes share one tuple for
Meta = tuple[int, int, int, dict[bytes, bytes] | None]  # mode, uid, gid, user attributes
_metas: dict[tuple[int, int, int], Meta] = {}


def _meta(mode: int, uid: int, gid: int, xattrs: dict[bytes, bytes] | None) -> Meta:
    """An inode's mode, owner and user attributes in one tuple: without attributes, one
    tuple per distinct (mode, uid, gid) (most files share one), not three slots each."""
    if xattrs:
        return (mode, uid, gid, xattrs)
    key = (mode, uid, gid)
    found = _metas.get(key)
    if found is None:
        found = (mode, uid, gid, None)
        if len(_metas) < _SHARED_METAS:
            _metas[key] = found
    return found


class Inode:
    """One inode. Slots only, and nothing a plain file does not need: a master holds
    millions of them (docs/cluster.md, "Memory per file"). A directory (`Directory`) has its
    entries, subdirectory count and watchers in its `children` (kvfs.cluster.entries), a
    symbolic link (`Symlink`) its target: a plain file reads both from the class (None, b"")
    and takes no slot for them. Mode, uid, gid and user attributes are one shared tuple
    (`meta`, read-only) until the first attribute is set. Build one from saved fields with
    `make_inode`, which picks the class."""

    __slots__ = ("ino", "meta", "_times", "parent", "key", "version", "entry_id", "refs")
    children: Entries | None = None  # a directory's entries (a slot of `Directory`)
    target: bytes = b""  # a symbolic link's target, fixed at creation (a slot of `Symlink`)

    def __init__(self, ino: int, mode: int, uid: int, gid: int, atime_ns: int, mtime_ns: int, ctime_ns: int,
                 parent: int = 0, name: bytes = b"", children: Entries | dict | None = None,
                 xattrs: dict[bytes, bytes] | None = None, version: int = 0, entry_id: int = 0,
                 refs: int = 0, target: bytes = b"") -> None:
        self.ino = ino
        self.meta = _meta(mode, uid, gid, dict(xattrs) if xattrs else None)
        # The three times as one packed int (kvfs.cluster.times).
        self._times: Times = pack_times(atime_ns - BASE_NS, mtime_ns - BASE_NS, ctime_ns - BASE_NS)
        self.parent = parent  # 0 once unlinked
        self.key = pack(name) if name else name  # the name as its directory keeps it (kvfs.cluster.names)
        if children is not None:  # ({} from a saved state: its entries are linked as they load)
            self.children = children if isinstance(children, Entries) else Entries()
        self.version = version  # the file's current version
        self.entry_id = entry_id  # position in its parent's listing
        self.refs = refs  # bit n set: node n's kernel holds a lookup reference
        if target:
            self.target = target

    @property
    def name(self) -> bytes:
        return unpack(self.key)

    @name.setter
    def name(self, value: bytes) -> None:
        self.key = pack(value)

    @property
    def mode(self) -> int:
        return self.meta[0]

    @mode.setter
    def mode(self, value: int) -> None:
        _, uid, gid, xattrs = self.meta
        self.meta = _meta(value, uid, gid, xattrs)

    @property
    def uid(self) -> int:
        return self.meta[1]

    @uid.setter
    def uid(self, value: int) -> None:
        mode, _, gid, xattrs = self.meta
        self.meta = _meta(mode, value, gid, xattrs)

    @property
    def gid(self) -> int:
        return self.meta[2]

    @gid.setter
    def gid(self, value: int) -> None:
        mode, uid, _, xattrs = self.meta
        self.meta = _meta(mode, uid, value, xattrs)

    # Times are kept as offsets from BASE_NS, the three in one object (kvfs.cluster.times);
    # read back, the same ns.
    @property
    def atime_ns(self) -> int:
        return atime_of(self._times) + BASE_NS

    @atime_ns.setter
    def atime_ns(self, value: int) -> None:
        _, mtime, ctime = unpack_times(self._times)
        self._times = pack_times(value - BASE_NS, mtime, ctime)

    @property
    def mtime_ns(self) -> int:
        return mtime_of(self._times) + BASE_NS

    @mtime_ns.setter
    def mtime_ns(self, value: int) -> None:
        atime, _, ctime = unpack_times(self._times)
        self._times = pack_times(atime, value - BASE_NS, ctime)

    @property
    def ctime_ns(self) -> int:
        return ctime_of(self._times) + BASE_NS

    @ctime_ns.setter
    def ctime_ns(self, value: int) -> None:
        atime, mtime, _ = unpack_times(self._times)
        self._times = pack_times(atime, mtime, value - BASE_NS)

    def entries_changed(self, now_ns: int) -> None:
        """mtime and ctime both `now_ns` (a directory's entries changed), in one repacking."""
        offset = now_ns - BASE_NS
        self._times = pack_times(atime_of(self._times), offset, offset)

    def modified(self, mtime_ns: int, ctime_ns: int) -> None:
        """A seal's or publish's times: mtime as given, ctime moved to `ctime_ns` unless it is
        later already (ctime never goes back)."""
        times, mtime, ctime = self._times, mtime_ns - BASE_NS, ctime_ns - BASE_NS
        if type(times) is int and times >= 0 and not (mtime | ctime) >> FIELD_BITS:  # (narrow to narrow, inline)
            old_ctime = times >> CTIME_SHIFT
            self._times = (times & FIELD_MASK | mtime << MTIME_SHIFT
                           | (ctime if ctime >= old_ctime else old_ctime) << CTIME_SHIFT)
            return
        atime, _, old_ctime = unpack_times(times)
        self._times = pack_times(atime, mtime, ctime if ctime >= old_ctime else old_ctime)

    def access(self, now_ns: int) -> Times:
        """Sets atime; returns the times as now kept, immutable (a version read now keeps the
        same object: `FileVersion.last_access` reads its atime, no object of its own)."""
        times, atime = self._times, now_ns - BASE_NS
        if type(times) is int and times >= 0 and not atime >> FIELD_BITS:  # (narrow to narrow, inline)
            self._times = times = times >> MTIME_SHIFT << MTIME_SHIFT | atime
            return times
        _, mtime, ctime = unpack_times(times)
        self._times = times = pack_times(atime, mtime, ctime)
        return times

    def times(self) -> tuple[int, int, int]:
        """atime, mtime and ctime in ns (one call for an attribute reply's three)."""
        times = self._times
        if type(times) is int and times >= 0:  # (the narrow form, decoded inline)
            return ((times & FIELD_MASK) + BASE_NS, (times >> MTIME_SHIFT & FIELD_MASK) + BASE_NS,
                    (times >> CTIME_SHIFT) + BASE_NS)
        atime, mtime, ctime = unpack_times(times)
        return atime + BASE_NS, mtime + BASE_NS, ctime + BASE_NS

    @property
    def xattrs(self) -> dict[bytes, bytes]:
        """The user attributes (read-only: change them with set_xattr and remove_xattr)."""
        xattrs = self.meta[3]
        return xattrs if xattrs is not None else {}

    @xattrs.setter
    def xattrs(self, value: dict[bytes, bytes]) -> None:
        mode, uid, gid, _ = self.meta
        self.meta = _meta(mode, uid, gid, dict(value) or None)

    def set_xattr(self, name: bytes, value: bytes) -> None:
        mode, uid, gid, xattrs = self.meta
        if xattrs is None:  # (a shared tuple's: this inode gets a tuple and a dict of its own)
            self.meta = _meta(mode, uid, gid, {name: value})
        else:
            xattrs[name] = value

    def remove_xattr(self, name: bytes) -> bytes | None:
        mode, uid, gid, xattrs = self.meta
        if xattrs is None:
            return None
        value = xattrs.pop(name, None)
        if not xattrs:
            self.meta = _meta(mode, uid, gid, None)
        return value

    @property
    def subdirs(self) -> int:
        return self.children.subdirs if self.children is not None else 0

    @property
    def watchers(self) -> int:
        """Bit n set: node n keeps a copy of this directory's names (files have none)."""
        return self.children.watchers if self.children is not None else 0

    @watchers.setter
    def watchers(self, value: int) -> None:
        if self.children is not None:
            self.children.watchers = value

    @property
    def referenced(self) -> bool:
        return self.refs != 0

    @property
    def is_dir(self) -> bool:
        return self.children is not None

    @property
    def is_symlink(self) -> bool:
        return stat.S_ISLNK(self.meta[0])

    @property
    def is_file(self) -> bool:
        """A regular file: the only kind of inode that has versions and bytes."""
        return self.children is None and not stat.S_ISLNK(self.meta[0])

    @property
    def linked(self) -> bool:
        return self.parent != 0 or self.ino == ROOT_INO

    def __repr__(self) -> str:
        return f"Inode({self.ino}, {self.name!r} in {self.parent}, mode {self.mode:o})"


class Directory(Inode):
    __slots__ = ("children",)


class Symlink(Inode):
    __slots__ = ("target",)


def make_inode(ino: int, mode: int, uid: int, gid: int, atime_ns: int, mtime_ns: int, ctime_ns: int,
               parent: int = 0, name: bytes = b"", children: Entries | dict | None = None,
               xattrs: dict[bytes, bytes] | None = None, version: int = 0, entry_id: int = 0,
               refs: int = 0, target: bytes = b"") -> Inode:
    """An inode of the class its fields call for (a directory has `children`, a symlink a `target`)."""
    kind = Directory if children is not None else Symlink if target else Inode
    return kind(ino, mode, uid, gid, atime_ns, mtime_ns, ctime_ns, parent, name, children, xattrs, version,
                entry_id, refs, target)


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
        root = Directory(ROOT_INO, stat.S_IFDIR | root_mode, root_uid, root_gid, now_ns, now_ns, now_ns, children=Entries())
        root.refs = -1  # every node references the root, always
        # ino -> inode: numbers only grow, so slots in pages, not a dict (kvfs.cluster.table)
        self.inodes: NumberTable[Inode] = NumberTable(((ROOT_INO, root),))
        self.next_ino = ROOT_INO + 1
        self.next_entry_id = 1
        self.files = 0
        # Inodes whose persistent fields changed since the owner last saved them.
        self.dirty: set[int] = {ROOT_INO}
        # Entries added or removed in watched directories: (watchers, directory, name, added).
        self.changes: list[tuple[int, int, bytes, bool]] = []
        # Per node: the directories it watches (a node that goes down gives them back without
        # a walk). The inodes its kernel references are known only by their bits (`refs`)
        # and counted (`held`: no walk for a node that held none); a node that goes down has
        # them walked for in slices (kvfs.cluster.membership), and while that walk runs,
        # what its next incarnation references is listed in `walking`, for the walk to leave alone.
        self.watched_by: dict[int, set[int]] = {}
        self.held: dict[int, int] = {}
        self.walking: dict[int, set[int]] = {}

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
        inodes = self.inodes
        directory = inodes.get(parent)
        if directory is None or directory.children is None:  # (the hot path calls no helper)
            directory = self.directory(parent)  # raises
        if name == b".":
            return directory
        if name == b"..":
            return inodes[directory.parent or ROOT_INO]
        ino = directory.children.get(name)  # type: ignore[union-attr]
        return None if ino is None else inodes[ino]

    def existing(self, parent: int, name: bytes) -> Inode:
        inode = self.lookup(parent, name)
        if inode is None:
            raise MetadataError(errno.ENOENT, f"no entry {name!r} in directory {parent}")
        return inode

    def new_inode(self, mode: int, uid: int, gid: int, now_ns: int, directory: bool, at_least: int = 0) -> Inode:
        """A new inode, numbered past every inode number and entry id handed out (and past
        `at_least`: the master passes its next version id), so that its link can take its
        number as entry id and its first version as version id: one int object for the three
        (docs/cluster.md, "Memory per file"). Numbers skipped so are never used."""
        number = max(self.next_ino, self.next_entry_id, at_least)
        if directory:
            inode: Inode = Directory(number, mode, uid, gid, now_ns, now_ns, now_ns, children=Entries())
        else:
            inode = Inode(number, mode, uid, gid, now_ns, now_ns, now_ns)
        self.next_ino = number + 1
        self.inodes[inode.ino] = inode
        self.dirty.add(inode.ino)
        if not directory:
            self.files += 1
        return inode

    def new_symlink(self, target: bytes, uid: int, gid: int, now_ns: int) -> Inode:
        inode = Symlink(self.next_ino, stat.S_IFLNK | 0o777, uid, gid, now_ns, now_ns, now_ns, target=target)
        self.next_ino += 1
        self.inodes[inode.ino] = inode
        self.dirty.add(inode.ino)
        return inode

    def link(self, parent: Inode, name: bytes, inode: Inode, now_ns: int) -> None:
        assert parent.children is not None and name not in parent.children
        # Entry ids only grow; a link right after its inode was made (numbered past every entry
        # id: `new_inode`) takes the inode's number, the same int object (32 B per file).
        entry_id = self.next_entry_id
        if inode.ino >= entry_id:
            entry_id = inode.ino
        inode.parent, inode.key = parent.ino, pack(name)
        parent.children.add(inode.key, inode.ino, entry_id)  # (one key object for the two)
        inode.entry_id = entry_id
        self.next_entry_id = entry_id + 1
        if inode.children is not None:
            parent.children.subdirs += 1
        parent.entries_changed(now_ns)
        self.dirty.update((parent.ino, inode.ino))
        if parent.children.watchers:
            self.changes.append((parent.children.watchers, parent.ino, name, True))

    def unlink(self, inode: Inode, now_ns: int) -> None:
        """Removes the inode's entry; the inode goes too unless the kernel still references it."""
        self.detach(inode, now_ns)
        self.collect(inode)

    def detach(self, inode: Inode, now_ns: int) -> None:
        """Removes the inode's entry but keeps the inode (for rename)."""
        parent = self.inodes[inode.parent]
        parent.children.remove(inode.key, inode.entry_id)  # type: ignore[union-attr]
        if inode.children is not None:
            parent.children.subdirs -= 1  # type: ignore[union-attr]
        parent.entries_changed(now_ns)
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
            elif inode.watchers:
                self.unwatch(inode, inode.watchers)

    def reference(self, inode: Inode, node: int) -> None:
        """Node `node`'s kernel holds a lookup reference to the inode."""
        if inode.ino != ROOT_INO:
            bit = 1 << node
            if not inode.refs & bit:
                inode.refs |= bit
                self.held[node] = self.held.get(node, 0) + 1
            if self.walking:
                # Listed even when the bit is set: a previous incarnation's bit may still wait
                # for the walk, which leaves the inodes listed alone.
                again = self.walking.get(node)
                if again is not None:
                    again.add(inode.ino)

    def unreference(self, inode: Inode, node: int) -> None:
        if inode.ino != ROOT_INO and inode.refs & (1 << node):
            inode.refs &= ~(1 << node)
            self.held[node] -= 1
            if self.walking:
                again = self.walking.get(node)
                if again is not None:
                    again.discard(inode.ino)

    def walked(self, inode: Inode, node: int) -> None:
        """A walk found a dead incarnation's reference (kvfs.cluster.membership): it goes."""
        inode.refs &= ~(1 << node)
        self.held[node] -= 1

    def watch(self, directory: Inode, node: int) -> None:
        directory.watchers |= 1 << node
        self.watched_by.setdefault(node, set()).add(directory.ino)

    def unwatch(self, directory: Inode, nodes: int) -> None:
        """The nodes with a bit set in `nodes` no longer watch the directory."""
        directory.watchers &= ~nodes
        for node, watched in self.watched_by.items():
            if nodes & (1 << node):
                watched.discard(directory.ino)

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
                entries = self.inodes[inode.parent].children
                entries.add(inode.key, inode.ino, inode.entry_id)  # type: ignore[union-attr]
                entries.subdirs += inode.is_dir  # type: ignore[union-attr]
        self.dirty.clear()

    def is_ancestor(self, ancestor: int, ino: int) -> bool:
        while ino != ROOT_INO and ino != 0:
            if ino == ancestor:
                return True
            ino = self.inodes[ino].parent
        return ancestor == ROOT_INO

    def depth(self, inode: Inode) -> int:
        """How many links lie between the root and INODE (0 for the root or one not linked)."""
        depth, parent = 0, inode.parent
        while parent and inode.ino != ROOT_INO:
            depth += 1
            if parent == ROOT_INO:
                break
            above = self.inodes.get(parent)
            parent = above.parent if above is not None else 0
        return depth

    def listing(self, directory: Inode, start_id: int, limit: int) -> list[tuple[bytes, Inode, int]]:
        """Up to `limit` entries after entry `start_id`: O(log n + limit) (kvfs.cluster.entries)."""
        inodes = self.inodes
        return [(inode.name, inode, entry_id) for inode, entry_id in
                ((inodes[ino], entry_id) for ino, entry_id in directory.children.page(start_id, limit))]  # type: ignore[union-attr]
