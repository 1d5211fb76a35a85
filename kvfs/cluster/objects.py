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
from kvfs.cluster.times import BASE_NS, Times, atime_of
from kvfs.cluster.times import pack as pack_times
from kvfs.errors import MetadataError


# Ids of a node's id array examined per add or forget of one of its versions while the array
# is being compacted: the compaction's cost is spread over the changes that made it due (a
# rebuild in one go is ~80 ms per million ids), and it ends before the forgotten ids double.
COMPACT_STEP = 4
_SEALED, _CURRENT, _ON_DISK, _HELD = 1, 2, 4, 8
# A version's node, size and four flags, one int: `size << 36 | node << 4 | flags`, one
# object per distinct value (KV-cache blocks come in a few sizes: nodes x sizes x flags).
_FLAG_MASK = (1 << 4) - 1
_NODE_SHIFT = 4
_NODE_MAX = (1 << 32) - 1  # (node ids count registered names: 4G of them)
_SIZE_SHIFT = _NODE_SHIFT + 32
_SIZE_MAX = (1 << 64) - 1
_SHARED_PLACES = 16384  # distinct such ints versions share (past that, each its own)
_NO_SUMS = b""
# A version's use, one int: hits in the low bits, then open readers, then open writers. Closed
# and read at most 256 times it is a cached small int (no object of its own). Hits stop at
# the field's top (4G opens), counts of open handles too (more cannot be open at once).
_COUNT_BITS = 32
_COUNT_MAX = (1 << _COUNT_BITS) - 1
_READERS_SHIFT = _COUNT_BITS
_WRITERS_SHIFT = 2 * _COUNT_BITS


Fields = tuple[int, int, bool, bool, bool]  # node, size, sealed, current, on_disk
_places: dict[int, int] = {}
# The shared ints' fields, decoded once: reading them is then one dict lookup, not a dozen
# operations on a three-digit int (a request's hot path reads several). As bounded as `_places`.
_decoded: dict[int, Fields] = {}


def _decode(place: int) -> Fields:
    return (place >> _NODE_SHIFT & _NODE_MAX, place >> _SIZE_SHIFT, place & _SEALED != 0, place & _CURRENT != 0,
            place & _ON_DISK != 0)


def _shared(place: int) -> int:
    found = _places.get(place)
    if found is not None:
        return found
    if len(_places) < _SHARED_PLACES:
        _places[place] = place
        _decoded[place] = _decode(place)
    return place


def _flag(bit: int, doc: str) -> property:
    def get(self: FileVersion) -> bool:
        return self._place & bit != 0  # (no call of bool(): this runs on every request)

    def put(self: FileVersion, value: bool) -> None:
        self._place = _shared(self._place | bit if value else self._place & ~bit)

    return property(get, put, doc=doc)


def _count(shift: int, doc: str) -> property:
    clear = ~(_COUNT_MAX << shift)

    def get(self: FileVersion) -> int:
        return self._use >> shift & _COUNT_MAX

    def put(self: FileVersion, value: int) -> None:
        if not 0 <= value <= _COUNT_MAX:
            value = 0 if value < 0 else _COUNT_MAX
        self._use = self._use & clear | value << shift

    return property(get, put, doc=doc)


def _place(node: int, size: int, flags: int) -> int:
    if not 0 <= node <= _NODE_MAX or not 0 <= size <= _SIZE_MAX:
        raise ValueError(f"a file version of {size} bytes on node {node}")
    return _shared(size << _SIZE_SHIFT | node << _NODE_SHIFT | flags)


class FileVersion:
    """One version of a file's bytes. Slots only: a master holds millions (docs/cluster.md,
    "Memory per file"). Its node, size and four flags are one shared int (`_place`), its hits
    and open readers and writers one int (`_use`, 0 while closed and unread), its chunk
    checksums packed 8 bytes each (one checksum: the int itself). `checksums` reads and
    takes a list of ints, as the wire and the saved state do."""

    __slots__ = ("version", "ino", "_place", "_use", "_sums", "last_access")

    def __init__(self, version: int, ino: int, node: int, size: int = 0, sealed: bool = False,
                 current: bool = True, readers: int = 0, writers: int = 0, checksums: Sequence[int] = (),
                 on_disk: bool = False, hits: int = 0, last_access_ns: int = 0, held: bool = False) -> None:
        self.version, self.ino = version, ino
        self._place = _place(node, size, (_SEALED if sealed else 0) | (_CURRENT if current else 0)
                             | (_ON_DISK if on_disk else 0) | (_HELD if held else 0))
        self._use = 0
        if writers == 1 and not readers and not hits:  # (a create's: no property calls)
            self._use = 1 << _WRITERS_SHIFT
        elif readers or writers or hits:
            self.readers, self.writers, self.hits = readers, writers, hits
        self._sums = _pack(checksums)
        # Its last open for reading (None: never) as the atime of packed times (kvfs.cluster.times):
        # the object its inode keeps then (`Inode.access`), shared, or one of its own when loaded.
        self.last_access: Times | None = pack_times(last_access_ns - BASE_NS, 0, 0) if last_access_ns else None

    @property
    def node(self) -> int:
        """The node that stores the bytes."""
        return self._place >> _NODE_SHIFT & _NODE_MAX

    @node.setter
    def node(self, value: int) -> None:
        place = self._place
        self._place = _place(value, place >> _SIZE_SHIFT, place & _FLAG_MASK)

    @property
    def size(self) -> int:
        return self._place >> _SIZE_SHIFT

    @size.setter
    def size(self, value: int) -> None:
        place = self._place
        if place >> _SIZE_SHIFT != value:
            self._place = _place(place >> _NODE_SHIFT & _NODE_MAX, value, place & _FLAG_MASK)

    sealed = _flag(_SEALED, "its bytes are final")
    current = _flag(_CURRENT, "still the version its file's name refers to")
    on_disk = _flag(_ON_DISK, "a copy is safe on the node's SSD")
    held = _flag(_HELD, "retired, but an inode a kernel references still shows it (see master)")
    hits = _count(0, "opens for reading so far (not saved)")
    readers = _count(_READERS_SHIFT, "handles open for reading")
    writers = _count(_WRITERS_SHIFT, "handles open for writing")

    def fields(self) -> Fields:
        """(node, size, sealed, current, on_disk) from one read of the packed int: a request
        that needs several of them calls this once instead of a property each."""
        found = _decoded.get(self._place)
        return found if found is not None else _decode(self._place)

    def seal(self, size: int, checksums: Sequence[int]) -> None:
        """Its bytes are final: sealed, size and checksums in one go (one shared int looked up)."""
        place = self._place
        self._place = _place(place >> _NODE_SHIFT & _NODE_MAX, size, place & _FLAG_MASK | _SEALED)
        self._sums = _pack(checksums)

    @property
    def last_access_ns(self) -> int:
        return 0 if self.last_access is None else atime_of(self.last_access) + BASE_NS

    @property
    def checksums(self) -> list[int]:
        sums = self._sums
        if type(sums) is int:
            return [sums]
        return memoryview(sums).cast("Q").tolist() if sums else []

    @checksums.setter
    def checksums(self, value: Sequence[int]) -> None:
        self._sums = _pack(value)

    def closed(self, writer: bool) -> None:
        """One open handle fewer, for writing or reading (never below none)."""
        shift = _WRITERS_SHIFT if writer else _READERS_SHIFT
        if self._use >> shift & _COUNT_MAX:
            self._use -= 1 << shift

    @property
    def in_use(self) -> bool:
        return self._use > _COUNT_MAX  # an open reader or writer

    def __repr__(self) -> str:
        return f"FileVersion({self.version}, ino {self.ino}, node {self.node}, {self.size} bytes)"


def _pack(checksums: Sequence[int]) -> bytes | int:
    """Checksums 8 bytes each; one (a one-chunk file) as the int it is, 32-36 B, not 41."""
    if len(checksums) == 1:
        value = checksums[0]
        if not isinstance(value, int):  # (as array("Q") refuses what it cannot hold)
            raise TypeError(f"checksum {value!r} is not an int")
        if not 0 <= value < 1 << 64:
            raise OverflowError(f"checksum {value} is not an unsigned 64-bit int")
        return int(value)
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

    def create(self, ino: int, node: int, writers: int = 0) -> FileVersion:
        # A file's first version takes its inode's number when no version id reached it yet
        # (the master numbers new inodes past the version ids): one int object for both.
        number = ino if ino >= self.next_version else self.next_version
        version = FileVersion(number, ino, node, writers=writers)
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
        node = version.node
        ids = self.by_node.get(node)
        if ids is None:
            ids = self.by_node[node] = NodeIds()
        ids.append(version.version)
        self._node_versions[node] = self._node_versions.get(node, 0) + 1
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
        version.seal(size, checksums)
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
        version.closed(writer)
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
