"""Request and response messages of the metadata service.

Every call into the master is one of these structs, answered by one response
struct (or a `MetadataError`). msgspec structs are cheap to build in-process and
encode to msgpack unchanged when the master moves behind RPC.
"""

from __future__ import annotations

import msgspec


class Attr(msgspec.Struct):
    """Attributes of one inode, with the file's current version."""

    ino: int
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    version: int = 0  # current file version (0 for directories)
    sealed: bool = True


class DirEntry(msgspec.Struct):
    name: bytes
    attr: Attr
    next_id: int  # position to resume a listing after this entry


class VersionInfo(msgspec.Struct):
    """What the object directory knows of one file version."""

    version: int
    ino: int
    size: int
    sealed: bool
    node: int
    checksums: list[int]
    hits: int
    last_access_ns: int
    readers: int
    writers: int
    on_disk: bool = False
    node_name: str = ""  # the storing node's, from the registry
    node_address: str = ""
    node_live: bool = True


class FileRecord(msgspec.Struct):
    """A file's path and attributes, as the master describes it to a node for its SSD index
    and a node reports it back to restore the file (the index keeps its own struct,
    kvfs.disk.records.DiskFile: a change here never changes the disk format)."""

    path: list[bytes]
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    xattrs: dict[bytes, bytes]


# Requests ---------------------------------------------------------------------------


class Request(msgspec.Struct, tag=True):
    pass


class Lookup(Request):
    parent: int
    name: bytes


class GetAttr(Request):
    ino: int


class SetAttr(Request):
    ino: int
    mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None


class MkDir(Request):
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int


class Symlink(Request):
    parent: int
    name: bytes
    target: bytes
    uid: int
    gid: int


class ReadLink(Request):
    ino: int


class Create(Request):
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    node: int
    exclusive: bool


class Unlink(Request):
    parent: int
    name: bytes


class RmDir(Request):
    parent: int
    name: bytes


class Rename(Request):
    parent_old: int
    name_old: bytes
    parent_new: int
    name_new: bytes
    noreplace: bool = False


class ReadDir(Request):
    ino: int
    start_id: int
    limit: int


class Forget(Request):
    """The node's kernel no longer references these inodes."""

    inos: list[int]


class OpenRead(Request):
    ino: int


class OpenWrite(Request):
    """Opens a file for writing: joins its unsealed version or starts a new one (copy-on-write)."""

    ino: int
    node: int
    truncate: bool


class Release(Request):
    version: int
    writer: bool


class Seal(Request):
    """The last writer closed the version: its bytes are final."""

    version: int
    size: int
    mtime_ns: int
    checksums: list[int]
    ctime_ns: int = 0  # the last write's (0: mtime_ns), later than mtime_ns after a utimensat


class GetXattr(Request):
    ino: int
    name: bytes


class SetXattr(Request):
    ino: int
    name: bytes
    value: bytes


class ListXattr(Request):
    ino: int


class RemoveXattr(Request):
    ino: int
    name: bytes


class GetVersion(Request):
    version: int


class Reclaim(Request):
    """Evicts whole files stored on `node` until `nbytes` are freed (or nothing is evictable).

    tier "dram": files whose only copy is in DRAM; tier "disk": files on the node's SSD."""

    node: int
    nbytes: int
    tier: str = "dram"


class Offloaded(Request):
    """These versions are now safe on the node's SSD."""

    versions: list[int]


class GetRecord(Request):
    version: int


class Lost(Request):
    """The node found the only copy of a version corrupt: the file must go."""

    version: int


class Restore(Request):
    """Recovery: a sealed file found in a node's SSD index re-enters the namespace."""

    version: int
    node: int
    record: FileRecord
    checksums: list[int]


class CollectOrphans(Request):
    """Removes temp files that no writer has touched for the grace period."""


class Stats(Request):
    pass


class Held(msgspec.Struct):
    """One version a node holds, as it reports it when (re-)registering."""

    version: int
    size: int
    sealed: bool
    on_disk: bool
    mtime_ns: int = 0
    checksums: list[int] = []
    record: FileRecord | None = None  # from the SSD index: how to restore a file the master forgot


class Register(Request):
    """A node (re)joins: it gets its id, then reports what it holds, then finishes."""

    name: str
    address: str  # host:port of its peer server


class Report(Request):
    held: list[Held]
    opens: list[tuple[int, bool, int]] = []  # (version, writer, handles) the node has open, wherever stored


class FinishRegistration(Request):
    pass


class Activity(msgspec.Struct):
    """A node's counters since it started, reported with its heartbeats."""

    lookups_found: int = 0
    lookups_absent: int = 0
    opens_dram: int = 0
    opens_ssd: int = 0
    opens_peer: int = 0
    offload_backlog_files: int = 0
    offload_backlog_bytes: int = 0
    read_bytes: int = 0  # read through the mount (every tier)
    written_bytes: int = 0
    evicted_files: int = 0
    transport: str = ""  # how it fetches from peers: "tcp", or "rdma" (TCP with peers without it)
    io_engine: str = ""  # how its SSD tier does I/O: "io_uring" or "threads" ("" without an SSD tier)
    # Files the SSD tier failed to take (a storage failure; they stay in DRAM), and why.
    offload_failed_files: int = 0
    offload_failed_bytes: int = 0
    storage_error: str = ""


class Heartbeat(Request):
    dram_capacity: int
    dram_used: int
    ssd_capacity: int = 0
    ssd_used: int = 0
    activity: Activity | None = None  # what the node served since it started (for `kvfs status`)


class ClusterStatus(Request):
    pass


class DirUsage(Request):
    """Use per top-level directory; `files`: also sum what each holds (a walk of the namespace)."""

    files: bool = True


class RemoveNode(Request):
    """An operator's decision: a node that is down will not come back; its files go."""

    name: str


class WatchNames(Request):
    """The directory's names, a page at a time, and from the first page on a push of each
    name added or removed there (unless it holds more than `limit` names: then nothing)."""

    ino: int
    limit: int
    start_id: int = 0  # resume after this entry (0: the first page, which starts the watch)
    page: int = 4096  # names per answer (a frame header holds at most 1 MiB)


class Unwatch(Request):
    inos: list[int]


# Responses --------------------------------------------------------------------------


class Done(msgspec.Struct):
    """A mutation's result: versions whose data the owning node must now free, and
    versions on SSD whose index records must be rewritten (their path changed)."""

    dropped: list[int] = []
    relocated: list[int] = []


class Entry(msgspec.Struct):
    attr: Attr | None  # None: no such name (a negative entry)
    # A sealed file whose bytes are on another (live) node: where, as in `Opened`, so
    # that the caller can start fetching before it opens (kvfs.node.prefetch).
    node: int = 0
    address: str = ""
    checksums: list[int] = []


class Opened(msgspec.Struct):
    attr: Attr
    version: int
    # For a new copy-on-write version: the version and size whose bytes to copy first;
    # the caller holds a read reference on `copy_from` and releases it after copying.
    copy_from: int = 0
    copy_size: int = 0
    dropped: list[int] = []
    # Where the bytes are when another node stores them: its id and peer address, and
    # the chunk checksums to verify what it sends.
    node: int = 0
    address: str = ""
    checksums: list[int] = []


class Removed(msgspec.Struct):
    """Files taken out of the namespace by eviction or collection, for the kernel to forget."""

    dropped: list[int]
    entries: list[tuple[int, bytes, int]]  # (directory, name, inode)
    freed_bytes: int


class Listing(msgspec.Struct):
    entries: list[DirEntry]


class LinkTarget(msgspec.Struct):
    target: bytes


class XattrValue(msgspec.Struct):
    value: bytes


class XattrNames(msgspec.Struct):
    names: list[bytes]


class Restored(msgspec.Struct):
    kept: bool  # False: a newer version of the same path won
    dropped: list[int]


class MasterStats(msgspec.Struct):
    inodes: int
    files: int
    sealed_bytes: int
    capacity: int = 0  # cluster-wide (live nodes); 0 in single-node mode
    used: int = 0


class Registered(msgspec.Struct):
    node: int


class Reported(msgspec.Struct):
    """Reported versions the node must free (the master knows better ones, or none)."""

    dropped: list[int]


class Beat(msgspec.Struct):
    """What happened elsewhere that the node must act on."""

    dropped: list[int]  # versions it stores whose files are gone
    forget: list[tuple[int, bytes, int]]  # (directory, name, inode) its kernel may still cache


class Names(msgspec.Struct):
    names: list[bytes]
    complete: bool  # False: the directory is larger than asked for, and is not watched
    next_id: int = 0  # where the next page starts; 0: this was the last page
    # What a lookup of each name answers, for the names a node may answer from its copy
    # (sealed files on live nodes); None: ask the master (directories, files being written).
    entries: list[Entry | None] = []


# A change in a watched directory: (directory, name, present, entry). `present` False:
# the name was removed; True: it was added or its entry changed (a new version, a seal,
# new attributes), with the entry a lookup now answers (None: ask the master).
NameChange = tuple[int, bytes, bool, Entry | None]


class NameChanges(msgspec.Struct):
    """Pushed to nodes watching directories, in order."""

    changes: list[NameChange]


def entry_bytes(name: bytes, entry: Entry | None) -> int:
    """A bound on the encoded size of one name with its entry (pages and pushes stay
    well under a frame's header limit)."""
    return len(name) + 24 + (0 if entry is None else 128 + len(entry.address) + 9 * len(entry.checksums))


class NodeStatus(msgspec.Struct):
    node: int
    name: str
    address: str
    live: bool
    seconds_since_heartbeat: float
    dram_capacity: int
    dram_used: int
    ssd_capacity: int
    ssd_used: int
    files: int
    dram_only_files: int
    ssd_files: int
    bytes: int
    activity: Activity = msgspec.field(default_factory=Activity)


class ClusterInfo(msgspec.Struct):
    nodes: list[NodeStatus]
    inodes: int
    files: int
    sealed_bytes: int


class DirUsageRow(msgspec.Struct):
    """One top-level directory: what it holds (sealed files), and lookups and reader opens in
    it since the master started."""

    name: str
    files: int = 0
    bytes: int = 0
    dram_only_bytes: int = 0  # not yet on an SSD tier
    ssd_bytes: int = 0
    hits: int = 0  # reader opens of the files it holds now
    lookups_found: int = 0
    lookups_absent: int = 0
    opens: int = 0
    open_bytes: int = 0


class DirUsageInfo(msgspec.Struct):
    dirs: list[DirUsageRow]


# What each request is answered with (the RPC client decodes responses by it).
RESPONSE_TYPES: dict[type, type] = {
    Lookup: Entry, GetAttr: Attr, SetAttr: Attr, MkDir: Attr, Create: Opened, Unlink: Done, RmDir: Done,
    Rename: Done, ReadDir: Listing, Forget: Done, OpenRead: Opened, OpenWrite: Opened, Release: Done,
    Seal: Attr, GetXattr: XattrValue, SetXattr: Done, ListXattr: XattrNames, RemoveXattr: Done,
    GetVersion: VersionInfo, Reclaim: Removed, Offloaded: Done, GetRecord: FileRecord, Lost: Removed,
    Restore: Restored, CollectOrphans: Removed, Stats: MasterStats, Register: Registered, Report: Reported,
    FinishRegistration: Done, Heartbeat: Beat, ClusterStatus: ClusterInfo, WatchNames: Names, Unwatch: Done,
    RemoveNode: Removed, DirUsage: DirUsageInfo, Symlink: Attr, ReadLink: LinkTarget,
}
