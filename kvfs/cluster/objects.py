"""The object directory: file versions, their chunks, where they live (pure).

A file's bytes are an immutable version once sealed. Writing a sealed file
starts a new version (copy-on-write) and retires the old one, which lives on
until its last open handle is released: readers keep the bytes they opened.
"""

from __future__ import annotations

import errno
from array import array
from itertools import compress
from typing import Callable, Iterator, Sequence

from kvfs.cluster.table import NumberTable
from kvfs.errors import MetadataError


SHARED_SIZES = 4096  # distinct file sizes whose int objects versions share
# Ids of a node's id array examined per add or forget of one of its versions while the array
# is being compacted: the compaction's cost is spread over the changes that made it due (a
# rebuild in one go is ~80 ms per million ids), and it ends before the forgotten ids double.
COMPACT_STEP = 4
_SEALED, _CURRENT, _ON_DISK, _HELD = 1, 2, 4, 8
_NO_SUMS = b""


def _flag(bit: int, doc: str) -> property:
    def get(self: FileVersion) -> bool:
        return bool(self._flags & bit)

    def put(self: FileVersion, value: bool) -> None:
        self._flags = self._flags | bit if value else self._flags & ~bit

    return property(get, put, doc=doc)


class FileVersion:
    """One version of a file's bytes. Slots only, its four flags in one int and its chunk
    checksums packed 8 bytes each: a master holds millions (docs/cluster.md, "Memory per
    file"). `checksums` reads and takes a list of ints, as the wire and the saved state do."""

    __slots__ = ("version", "ino", "node", "size", "_flags", "readers", "writers", "_sums", "hits",
                 "last_access_ns")

    def __init__(self, version: int, ino: int, node: int, size: int = 0, sealed: bool = False,
                 current: bool = True, readers: int = 0, writers: int = 0, checksums: Sequence[int] = (),
                 on_disk: bool = False, hits: int = 0, last_access_ns: int = 0, held: bool = False) -> None:
        self.version, self.ino = version, ino
        self.node = node  # the node that stores the bytes
        self.size = size
        self._flags = (_SEALED if sealed else 0) | (_CURRENT if current else 0) | (_ON_DISK if on_disk else 0) \
            | (_HELD if held else 0)
        self.readers, self.writers = readers, writers
        self._sums = _pack(checksums)
        self.hits, self.last_access_ns = hits, last_access_ns

    sealed = _flag(_SEALED, "its bytes are final")
    current = _flag(_CURRENT, "still the version its file's name refers to")
    on_disk = _flag(_ON_DISK, "a copy is safe on the node's SSD")
    held = _flag(_HELD, "retired, but an inode a kernel references still shows it (see master)")

    @property
    def checksums(self) -> list[int]:
        return memoryview(self._sums).cast("Q").tolist() if self._sums else []

    @checksums.setter
    def checksums(self, value: Sequence[int]) -> None:
        self._sums = _pack(value)

    @property
    def in_use(self) -> bool:
        return self.readers > 0 or self.writers > 0

    def __repr__(self) -> str:
        return f"FileVersion({self.version}, ino {self.ino}, node {self.node}, {self.size} bytes)"


def _pack(checksums: Sequence[int]) -> bytes:
    return array("Q", checksums).tobytes() if checksums else _NO_SUMS


class NodeIds:
    """A node's version ids, 8 bytes each, in an array that ids are appended to. Ids of
    versions forgotten since stay until they outnumber the live ones; the array is then
    compacted a few ids per change (`step`), never in one go: meanwhile the ids are those
    kept so far, then the rest of the old array (ids appended meanwhile go to its end)."""

    __slots__ = ("kept", "old", "pos")

    def __init__(self) -> None:
        self.kept = array("Q")
        self.old: array[int] | None = None  # being compacted, from `pos` on
        self.pos = 0

    def append(self, version_id: int) -> None:
        (self.kept if self.old is None else self.old).append(version_id)

    def __len__(self) -> int:
        return len(self.kept) + (len(self.old) - self.pos if self.old is not None else 0)

    def ids(self) -> array[int]:
        """A copy of the ids (in C): callers walk it while versions come and go."""
        return self.kept + self.old[self.pos:] if self.old is not None else self.kept[:]

    def __getitem__(self, index: slice) -> array[int]:
        return self.ids() if index == slice(None) else self.ids()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids())

    @property
    def compacting(self) -> bool:
        return self.old is not None

    def start(self) -> None:
        self.old, self.kept, self.pos = self.kept, array("Q"), 0

    def step(self, live: Callable[[int], bool], count: int) -> int:
        """Keeps the live ids of the next `count` of the old array; returns how many it examined."""
        old, pos = self.old, self.pos
        assert old is not None
        chunk = old[pos:pos + count]
        self.kept.extend(compress(chunk, map(live, chunk)))
        self.pos = pos + len(chunk)
        if self.pos >= len(old):
            self.old, self.pos = None, 0
        return len(chunk)


class ObjectDirectory:
    def __init__(self) -> None:
        self.versions: NumberTable[FileVersion] = NumberTable()  # ids only grow (kvfs.cluster.table)
        self.next_version = 1
        self.sealed_bytes = 0
        self.dirty: set[int] = set()  # versions changed since the owner last saved them
        # node -> its versions' ids (append-only, 8 bytes each; ids of versions forgotten since
        # stay until they are half of the array, then go a few per change: `NodeIds`): a
        # node's death, registration and removal touch that node's versions only.
        self.by_node: dict[int, NodeIds] = {}
        self._node_versions: dict[int, int] = {}  # node -> how many versions it stores
        self._sizes: dict[int, int] = {}  # sizes seen, each one int object (see `seal`)
        self.retired: set[int] = set()  # versions no longer current, kept while open or held (a few)
        # Versions their node no longer holds (it registered again without them, or it was
        # forgotten): hidden until they are forgotten, a slice at a time (not saved).
        self.gone: set[int] = set()
        # Versions dropped since the master last routed them to the nodes that store them.
        self.dropped_log: list[FileVersion] = []

    def get(self, version: int) -> FileVersion:
        found = self.versions.get(version)
        if found is None:
            raise MetadataError(errno.ESTALE, f"file version {version} is gone")
        return found

    def create(self, ino: int, node: int) -> FileVersion:
        # A file's first version takes its inode's number when no version id reached it yet
        # (the master numbers new inodes past the version ids): one int object for both.
        number = ino if ino >= self.next_version else self.next_version
        version = FileVersion(number, ino, node)
        self.next_version = number + 1
        self._add(version)
        self.dirty.add(version.version)
        return version

    def restore(self, version_id: int, ino: int, node: int, size: int, checksums: list[int]) -> FileVersion:
        """A sealed version found on a node's SSD after a restart keeps its id."""
        version = FileVersion(version_id, ino, node, on_disk=True)
        self._add(version)
        self.next_version = max(self.next_version, version_id + 1)
        self.seal(version, size, checksums)
        return version

    def load(self, versions: list[FileVersion], next_version: int) -> None:
        """Saved versions after a master restart (no open handles yet: nodes report theirs)."""
        for version in versions:
            self._add(version)
            if not version.current:
                self.retired.add(version.version)
            if version.sealed:
                self.sealed_bytes += version.size
        self.next_version = max([next_version] + [v.version + 1 for v in versions])
        self.dirty.clear()

    def _add(self, version: FileVersion) -> None:
        self.versions[version.version] = version
        ids = self.by_node.get(version.node)
        if ids is None:
            ids = self.by_node[version.node] = NodeIds()
        ids.append(version.version)
        self._node_versions[version.node] = self._node_versions.get(version.node, 0) + 1
        if ids.compacting:
            ids.step(self.versions.__contains__, COMPACT_STEP)

    def of_node(self, node: int) -> list[FileVersion]:
        """The versions stored on a node (O(its versions), not of every version)."""
        versions = self.versions
        ids = self.by_node.get(node, NodeIds())
        if len(ids) == self._node_versions.get(node, 0):  # no forgotten ids among them
            return [versions[version_id] for version_id in ids]
        found = []
        for version_id in dict.fromkeys(ids):  # (an id forgotten, then restored, is there twice)
            version = versions.get(version_id)
            if version is not None and version.node == node:
                found.append(version)
        return found

    def count(self, node: int) -> int:
        """How many versions the node stores."""
        return self._node_versions.get(node, 0)

    def seal(self, version: FileVersion, size: int, checksums: list[int]) -> None:
        # KV-cache blocks come in a few sizes: one int object per size, not one per version.
        if len(self._sizes) < SHARED_SIZES:
            size = self._sizes.setdefault(size, size)
        else:
            size = self._sizes.get(size, size)
        version.sealed, version.size, version.checksums = True, size, checksums
        self.sealed_bytes += size
        self.dirty.add(version.version)

    def retire(self, version: FileVersion, dropped: list[int]) -> None:
        """The version is no longer its file's content; drop it once nobody has it open."""
        version.current = False
        self.dirty.add(version.version)
        if version.version in self.versions:
            self.retired.add(version.version)
        self._drop_if_unused(version, dropped)

    def release(self, version: FileVersion, writer: bool, dropped: list[int]) -> None:
        if writer:
            version.writers = max(0, version.writers - 1)
        else:
            version.readers = max(0, version.readers - 1)
        self._drop_if_unused(version, dropped)

    def _drop_if_unused(self, version: FileVersion, dropped: list[int]) -> None:
        if not version.current and not version.in_use and not version.held and version.version in self.versions:
            self.forget(version)
            dropped.append(version.version)

    def forget(self, version: FileVersion) -> None:
        """Removes a version from the directory; its node is told to free the bytes."""
        del self.versions[version.version]
        self.retired.discard(version.version)
        self.gone.discard(version.version)
        node = version.node
        left = self._node_versions[node] = self._node_versions[node] - 1
        if not left:
            del self._node_versions[node], self.by_node[node]
        else:
            ids = self.by_node[node]
            if not ids.compacting and len(ids) > 2 * left + 64:  # mostly forgotten ids: keep the live ones
                ids.start()
            if ids.compacting:
                ids.step(self.versions.__contains__, COMPACT_STEP)
        if version.sealed:
            self.sealed_bytes -= version.size
        self.dirty.add(version.version)
        self.dropped_log.append(version)
