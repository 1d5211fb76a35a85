"""Request and response messages of the metadata service.

Every call into the master is one of these structs, answered by one response
struct (or a `MetadataError`). msgspec structs are cheap to build in-process and
encode to msgpack unchanged when the master moves behind RPC.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

# Bounds that decoding itself enforces on every request (kvfs.cluster.validate adds what a
# type cannot say, and checks structs built in-process, which are never decoded). They are
# wide enough for anything a kernel hands a node: a request outside them comes from no
# correct peer, and its connection is closed. Times are bounded by the validator instead,
# which answers EINVAL: a user's utimensat may ask for any time.
U32_MAX = 2**32 - 1
MODE_MAX = 0o177777  # file type and permission bits, nothing above
WIRE_NAME_MAX = 4096  # PATH_MAX; names are 255 bytes (ENAMETOOLONG from the validator)
XATTR_NAME_MAX = 255  # the kernel's limits, which it checks before a request is made
XATTR_SIZE_MAX = 65536
NODE_NAME_MAX = 255
ADDRESS_MAX = 1024
TEXT_MAX = 65536  # free text a node reports (its storage error)
MAX_IDS = 1 << 20  # inodes or versions in one request: about what a header can hold
MAX_CHUNKS = 1 << 19  # checksums of one file: 2 TiB of 4 MiB chunks
MAX_PATH_DEPTH = 2048  # elements of a restored path (PATH_MAX / 2)
MAX_XATTRS = 1 << 14  # attributes of one restored file
MAX_HELD = 1 << 17  # versions in one registration report (nodes send 2,000)
READDIR_MAX = 1 << 16  # entries listed for one ReadDir at most (nodes ask for 256)
RELOCATED_MAX = 1 << 15  # versions in one heartbeat answer whose records move (the master sends 14,563)

U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack itself carries nothing above 2^64 - 1
U32 = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
Mode = Annotated[int, msgspec.Meta(ge=0, le=MODE_MAX)]
VersionId = Annotated[int, msgspec.Meta(ge=1)]  # 0 is "no version"
Name = Annotated[bytes, msgspec.Meta(max_length=WIRE_NAME_MAX)]
XattrName = Annotated[bytes, msgspec.Meta(max_length=XATTR_NAME_MAX)]
XattrData = Annotated[bytes, msgspec.Meta(max_length=XATTR_SIZE_MAX)]
NodeName = Annotated[str, msgspec.Meta(max_length=NODE_NAME_MAX)]
Address = Annotated[str, msgspec.Meta(max_length=ADDRESS_MAX)]
Text = Annotated[str, msgspec.Meta(max_length=TEXT_MAX)]
Word = Annotated[str, msgspec.Meta(max_length=16)]
Ids = Annotated[list[U64], msgspec.Meta(max_length=MAX_IDS)]
Checksums = Annotated[list[U64], msgspec.Meta(max_length=MAX_CHUNKS)]


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


class Sealed(Attr):
    """A seal's answer: the file's attributes and, with `Seal.release`, the versions the
    writer's release dropped (the node frees them)."""

    dropped: list[int] = []
    changes: list[NameChange] = []  # name changes waiting for the caller (see `NameChanges`)


def sealed(attr: Attr, dropped: list[int]) -> Sealed:
    return Sealed(attr.ino, attr.mode, attr.nlink, attr.uid, attr.gid, attr.size, attr.atime_ns, attr.mtime_ns,
                  attr.ctime_ns, attr.version, attr.sealed, dropped)


class Made(Attr):
    """A mkdir's answer: the new directory's attributes and its parent's after it (the
    kernel asks for those next, having dropped its own copy: kvfs.node.dircache.OwnChanges).
    A node of before 2026-12-02 reads it as the `Attr` it was."""

    parent: Attr | None = None


def made(attr: Attr, parent: Attr) -> Made:
    return Made(attr.ino, attr.mode, attr.nlink, attr.uid, attr.gid, attr.size, attr.atime_ns, attr.mtime_ns,
                attr.ctime_ns, attr.version, attr.sealed, parent)


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

    path: Annotated[list[Name], msgspec.Meta(max_length=MAX_PATH_DEPTH)]
    size: U64
    mode: Mode
    uid: U32
    gid: U32
    mtime_ns: int
    xattrs: Annotated[dict[XattrName, XattrData], msgspec.Meta(max_length=MAX_XATTRS)]


# Requests ---------------------------------------------------------------------------


class Request(msgspec.Struct, tag=True):
    pass


class Lookup(Request):
    parent: U64
    name: Name
    # A node's temp suffix: a miss then also says whether the directory, if small, holds a
    # name ending in it (`Entry.no_temps`), for the writer's temp-name lookup that follows.
    temp_suffix: Name = b""


class GetAttr(Request):
    ino: U64


class SetAttr(Request):
    ino: U64
    mode: Mode | None = None
    uid: U32 | None = None
    gid: U32 | None = None
    atime_ns: int | None = None
    mtime_ns: int | None = None


class MkDir(Request):
    parent: U64
    name: Name
    mode: Mode
    uid: U32
    gid: U32


class Symlink(Request):
    parent: U64
    name: Name
    target: Name
    uid: U32
    gid: U32


class ReadLink(Request):
    ino: U64


class Create(Request):
    parent: U64
    name: Name
    mode: Mode
    uid: U32
    gid: U32
    node: U64
    exclusive: bool


class Unlink(Request):
    parent: U64
    name: Name


class RmDir(Request):
    parent: U64
    name: Name


class Rename(Request):
    parent_old: U64
    name_old: Name
    parent_new: U64
    name_new: Name
    noreplace: bool = False


class ReadDir(Request):
    ino: U64
    start_id: U64
    limit: U64  # at most READDIR_MAX are listed


class Forget(Request):
    """The node's kernel no longer references these inodes."""

    inos: Ids


class OpenRead(Request):
    ino: U64
    # Versions whose reader handles closed on this node since its last request, released
    # before this open (their Release rides along instead of a round trip each).
    released: Ids = []


class OpenWrite(Request):
    """Opens a file for writing: joins its unsealed version or starts a new one (copy-on-write)."""

    ino: U64
    node: U64
    truncate: bool


class Release(Request):
    version: U64
    writer: bool


class Seal(Request):
    """The last writer closed the version: its bytes are final."""

    version: U64
    size: U64
    mtime_ns: int
    checksums: Checksums
    ctime_ns: int = 0  # the last write's (0: mtime_ns), later than mtime_ns after a utimensat
    # The last writer's Release too, in the same request (one round trip per close): the
    # answer is then a `Sealed`, with the versions the release dropped.
    release: bool = False


class GetXattr(Request):
    ino: U64
    name: XattrName


class SetXattr(Request):
    ino: U64
    name: XattrName
    value: XattrData


class ListXattr(Request):
    ino: U64


class RemoveXattr(Request):
    ino: U64
    name: XattrName


class GetVersion(Request):
    version: U64


class Reclaim(Request):
    """Evicts whole files stored on `node` until `nbytes` are freed (or nothing is evictable).

    tier "dram": files whose only copy is in DRAM; tier "disk": files on the node's SSD."""

    node: U64
    nbytes: U64
    tier: Literal["dram", "disk"] = "dram"


class Offloaded(Request):
    """These versions are now safe on the node's SSD."""

    versions: Ids


class GetRecord(Request):
    version: U64


class Lost(Request):
    """The node found the only copy of a version corrupt: the file must go."""

    version: U64


class Restore(Request):
    """Recovery: a sealed file found in a node's SSD index re-enters the namespace."""

    version: VersionId
    node: U64
    record: FileRecord
    checksums: Checksums


class CollectOrphans(Request):
    """Removes temp files that no writer has touched for the grace period."""


class Stats(Request):
    pass


class Held(msgspec.Struct):
    """One version a node holds, as it reports it when (re-)registering."""

    version: VersionId
    size: U64
    sealed: bool
    on_disk: bool
    mtime_ns: int = 0
    checksums: Checksums = []
    record: FileRecord | None = None  # from the SSD index: how to restore a file the master forgot


class Register(Request):
    """A node (re)joins: it gets its id, then reports what it holds, then finishes."""

    name: NodeName
    address: Address  # host:port of its peer server


class Report(Request):
    held: Annotated[list[Held], msgspec.Meta(max_length=MAX_HELD)]
    # (version, writer, handles) the node has open, wherever stored
    opens: Annotated[list[tuple[U64, bool, U64]], msgspec.Meta(max_length=MAX_IDS)] = []


class FinishRegistration(Request):
    pass


class Activity(msgspec.Struct):
    """A node's counters since it started, reported with its heartbeats."""

    lookups_found: U64 = 0
    lookups_absent: U64 = 0
    opens_dram: U64 = 0
    opens_ssd: U64 = 0
    opens_peer: U64 = 0
    offload_backlog_files: U64 = 0
    offload_backlog_bytes: U64 = 0
    read_bytes: U64 = 0  # read through the mount (every tier)
    written_bytes: U64 = 0
    evicted_files: U64 = 0
    transport: Word = ""  # how it fetches from peers: "tcp", or "rdma" (TCP with peers without it)
    io_engine: Word = ""  # how its SSD tier does I/O: "io_uring" or "threads" ("" without an SSD tier)
    # Files the SSD tier failed to take (a storage failure; they stay in DRAM), and why.
    offload_failed_files: U64 = 0
    offload_failed_bytes: U64 = 0
    storage_error: Text = ""


class Heartbeat(Request):
    dram_capacity: U64
    dram_used: U64
    ssd_capacity: U64 = 0
    ssd_used: U64 = 0
    activity: Activity | None = None  # what the node served since it started (for `kvfs status`)
    applied: U64 = 0  # the last numbered push of name changes applied on this connection (an acknowledgement)


class ClusterStatus(Request):
    pass


class DirUsage(Request):
    """Use per top-level directory; `files`: also sum what each holds (a walk of the namespace)."""

    files: bool = True


class RemoveNode(Request):
    """An operator's decision: a node that is down will not come back; its files go."""

    name: NodeName


class WatchNames(Request):
    """The directory's names, a page at a time, and from the first page on a push of each
    name added or removed there (unless it holds more than `limit` names: then nothing)."""

    ino: U64
    limit: U64
    start_id: U64 = 0  # resume after this entry (0: the first page, which starts the watch)
    page: U64 = 4096  # names per answer (a frame header holds at most 1 MiB)


class Unwatch(Request):
    inos: Ids


NUMBERS_MAX = 1 << 16  # inode and version numbers granted in one block at most


class GrantNumbers(Request):
    """A block of `count` inode and `count` version numbers for the caller's node-private
    temp files (kvfs.node.private): never handed out again, across restarts too."""

    count: Annotated[int, msgspec.Meta(ge=1, le=NUMBERS_MAX)]


class Publish(Request):
    """A node-private temp file enters the namespace as `name` in `parent`: create, seal (when
    `sealed`) and rename in one request, with rename's replace rules (`noreplace`: EEXIST
    when the name exists). `ino` and `version` come from a block the master granted the
    node. Unsealed (`writers` handles still open on the node): the file is handed to the
    master while being written, which then goes on as for any file created there."""

    parent: U64
    name: Name
    node: U64
    ino: U64
    version: VersionId
    mode: Mode
    uid: U32
    gid: U32
    size: U64
    checksums: Checksums
    mtime_ns: int
    ctime_ns: int
    sealed: bool = True
    writers: U64 = 0
    noreplace: bool = False


# Responses --------------------------------------------------------------------------

TEMP_SCAN_NAMES = 64  # the largest directory whose names a Lookup miss checks for a temp suffix


class Done(msgspec.Struct):
    """A mutation's result: versions whose data the owning node must now free, and
    versions on SSD whose index records must be rewritten (their path changed)."""

    dropped: list[int] = []
    relocated: list[int] = []
    # A rename's: the attributes of the directories it changed, after it (the kernel asks for
    # them next, having dropped its own copy).
    directories: list[Attr] = []
    changes: list[NameChange] = []  # name changes waiting for the caller (see `NameChanges`)


class Entry(msgspec.Struct):
    attr: Attr | None  # None: no such name (a negative entry)
    # A sealed file whose bytes are on another (live) node: where, as in `Opened`, so
    # that the caller can start fetching before it opens (kvfs.node.prefetch).
    node: int = 0
    address: str = ""
    checksums: list[int] = []
    # A miss asked with a temp suffix: True when the name is absent (not a hidden file) and
    # the directory, of at most TEMP_SCAN_NAMES names, holds no name ending in the suffix.
    # False: it may (or the master did not look).
    no_temps: bool = False


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
    # A create's: the attributes of the directory it added the name to, after it (the
    # kernel asks for them next, having dropped its own copy).
    parent: Attr | None = None
    changes: list[NameChange] = []  # name changes waiting for the caller (see `NameChanges`)


class Removed(msgspec.Struct):
    """Files taken out of the namespace by eviction or collection, for the kernel to forget."""

    dropped: list[int]
    entries: list[tuple[int, bytes, int]]  # (directory, name, inode)
    freed_bytes: int
    # (Reclaim) the caller's versions that other nodes' requests released since its last
    # heartbeat: their room is free now, not at the next beat.
    released: list[int] = []
    files: int = 0  # (RemoveNode) files removed, those listed and those that go in slices after


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


class Numbers(msgspec.Struct):
    """A GrantNumbers' block: inodes first_ino .. first_ino + count - 1, versions likewise."""

    first_ino: int
    first_version: int
    count: int


class Published(msgspec.Struct):
    """A Publish's result: the file's attributes, as a rename's `Done` otherwise."""

    attr: Attr
    dropped: list[int] = []
    relocated: list[int] = []
    directories: list[Attr] = []
    changes: list[NameChange] = []  # name changes waiting for the caller (see `NameChanges`)


class Registered(msgspec.Struct):
    node: int


class Reported(msgspec.Struct):
    """Reported versions the node must free (the master knows better ones, or none)."""

    dropped: list[int]


class Beat(msgspec.Struct):
    """What happened elsewhere that the node must act on."""

    dropped: list[int]  # versions it stores whose files are gone
    forget: list[tuple[int, bytes, int]]  # (directory, name, inode) its kernel may still cache
    pushed: U64 = 0  # the pushes numbered so far on this connection: the node's copies are current once applied
    # Versions on its SSD whose index records it must rewrite (a rename moved their path).
    relocated: Annotated[list[VersionId], msgspec.Meta(max_length=RELOCATED_MAX)] = []


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
    """Pushed to nodes watching directories, in order. A master that answers a node's
    `Create`, `Seal` or change (`Opened`, `Sealed`, `Done`) hands it the changes waiting
    for it in the answer's `changes` instead (its own among them): one frame instead of
    two, in the same order as if pushed just before the answer (kvfs.net.rpc)."""

    changes: list[NameChange]
    seq: U64 = 0  # the push's number on this connection, acknowledged with Heartbeat.applied (0: more follow)


def added_name(request: Request) -> tuple[int, bytes] | None:
    """(directory, name) where a request makes a name, or replaces one (a rename's target);
    None for a request that makes none."""
    if isinstance(request, Rename):
        return request.parent_new, request.name_new
    if isinstance(request, (MkDir, Symlink, Create, Publish)):
        return request.parent, request.name
    return None


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
    Lookup: Entry, GetAttr: Attr, SetAttr: Attr, MkDir: Made, Create: Opened, Unlink: Done, RmDir: Done,
    Rename: Done, ReadDir: Listing, Forget: Done, OpenRead: Opened, OpenWrite: Opened, Release: Done,
    Seal: Sealed, GetXattr: XattrValue, SetXattr: Done, ListXattr: XattrNames, RemoveXattr: Done,
    GetVersion: VersionInfo, Reclaim: Removed, Offloaded: Done, GetRecord: FileRecord, Lost: Removed,
    Restore: Restored, CollectOrphans: Removed, Stats: MasterStats, Register: Registered, Report: Reported,
    FinishRegistration: Done, Heartbeat: Beat, ClusterStatus: ClusterInfo, WatchNames: Names, Unwatch: Done,
    RemoveNode: Removed, DirUsage: DirUsageInfo, Symlink: Attr, ReadLink: LinkTarget, GrantNumbers: Numbers,
    Publish: Published,
}
