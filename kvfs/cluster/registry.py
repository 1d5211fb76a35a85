"""The node registry: which nodes exist, where they listen, whether they are alive (pure).

A node registers under a stable name and keeps the same id across restarts (its
SSD index refers to it). It is alive while it heartbeats; one that misses
heartbeats for `dead_after_s` is declared dead (`expired`, asked by
kvfs.cluster.liveness, which first rules out the master's own stalls). After a
master restart every known node starts out not alive until it registers again.

An id is never handed out twice, not even after the node that had it was removed and
the master restarted or failed over: a new node would otherwise inherit what the id
meant (the removed node's version records, the fencing of its late frames, its
outboxes, its metrics). The next id (`next_id`, the high-water mark) is saved with the
counters (kvfs.cluster.records) and `reserve`d on a load.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfs.wire.messages import Activity, NameChange

LOCAL_NODE = 1  # the only node of a single-node (embedded) mount
NODE_ID_MAX = (1 << 32) - 1  # a version keeps its node's id in 32 bits (kvfs.cluster.objects)
# Number blocks remembered per node (kvfs.node.private): a node uses its blocks oldest first
# and holds two or three at a time (it asks for the next when a quarter is left), so the
# newest eight always include every block it may still publish from, even after it restarted
# a few times and left blocks unused.
GRANTS_KEPT = 8

Grant = tuple[int, int, int]  # a GrantNumbers block: first inode, first version, count


@dataclass(slots=True)
class Usage:
    """Capacity and use of a node's tiers, as its last heartbeat reported them."""

    dram_capacity: int = 0
    dram_used: int = 0
    ssd_capacity: int = 0
    ssd_used: int = 0


@dataclass(slots=True, eq=False)
class NodeRecord:
    node_id: int
    name: str
    address: str  # host:port of its peer server ("" for the embedded node)
    live: bool = False
    registering: bool = False  # reporting its holdings; its files stay hidden until done
    last_seen: float = 0.0
    usage: Usage = field(default_factory=Usage)
    activity: Activity = field(default_factory=Activity)  # its counters, as its last heartbeat reported them
    reported: set[int] = field(default_factory=set)  # versions reported during registration
    # While the versions a node did not report in its last registration are removed (in slices,
    # kvfs.cluster.membership): those it did report (and any added since), and the first id
    # newer than the registration. Its other versions older than that are hidden meanwhile.
    kept: set[int] | None = None
    kept_below: int = 0
    forgotten_at: int = 0  # how many of its versions had been forgotten when it registered
    outbox_dropped: list[int] = field(default_factory=list)  # versions it must free
    outbox_forget: list[tuple[int, bytes, int]] = field(default_factory=list)  # names its kernel must forget
    outbox_names: list[NameChange] = field(default_factory=list)  # changes in watched directories
    grants: list[Grant] = field(default_factory=list)  # its number blocks, oldest first (saved with it)

    def grant(self, first_ino: int, first_version: int, count: int) -> None:
        """A block granted to this node; the oldest beyond GRANTS_KEPT is forgotten."""
        self.grants = [*self.grants[-(GRANTS_KEPT - 1):], (first_ino, first_version, count)]

    def granted(self, ino: int, version: int) -> bool:
        """Whether (ino, version) is a pair of one of its blocks: the node takes a block's
        inode and version numbers together, at the same offset."""
        for first_ino, first_version, count in self.grants:
            offset = ino - first_ino
            if 0 <= offset < count and version - first_version == offset:
                return True
        return False


class Registry:
    def __init__(self, dead_after_s: float) -> None:
        self.dead_after_s = dead_after_s
        self.nodes: dict[int, NodeRecord] = {}
        self.by_name: dict[str, int] = {}
        self.next_id = LOCAL_NODE
        self.dirty = False  # names or addresses changed since the owner last saved them
        self.permanent: set[int] = set()  # nodes that never expire (the embedded node)

    def add_local(self) -> None:
        node = self.register("local", "", now=0.0)
        node.live, node.registering = True, False
        self.permanent.add(node.node_id)

    def register(self, name: str, address: str, now: float) -> NodeRecord:
        node_id = self.by_name.get(name)
        if node_id is None:
            node_id = self.next_id
            self.next_id += 1
            self.by_name[name] = node_id
            self.nodes[node_id] = NodeRecord(node_id, name, address)
        node = self.nodes[node_id]
        if node.address != address:
            node.address = address
        self.dirty = True
        node.registering, node.live, node.last_seen = True, False, now
        node.reported, node.kept = set(), None
        node.outbox_dropped, node.outbox_forget, node.outbox_names = [], [], []
        return node

    def load(self, records: list[tuple[int, str, str]], now: float, grants: dict[int, list[Grant]] | None = None) -> None:
        """Nodes known before a restart: not alive until they register again (and heard
        from at `now`, so that a dead node's time to be forgotten counts from this start),
        with the number blocks granted to them."""
        for node_id, name, address in records:
            self.nodes[node_id] = NodeRecord(node_id, name, address, last_seen=now,
                                             grants=list((grants or {}).get(node_id, ())))
            self.by_name[name] = node_id
            self.next_id = max(self.next_id, node_id + 1)

    def reserve(self, next_id: int) -> None:
        """Ids below NEXT_ID were handed out before (the saved high-water mark; 0: none saved,
        as in state written before it was): none of them is handed out again."""
        self.next_id = max(self.next_id, next_id)

    def is_live(self, node_id: int) -> bool:
        node = self.nodes.get(node_id)
        return node is not None and node.live

    def holds(self, node_id: int, version_id: int) -> bool:
        """Whether a version's node is live and holds it (it reported it, or the version is
        newer than its registration): O(1), whatever the node stores."""
        node = self.nodes.get(node_id)
        return node is not None and node.live and (
            node.kept is None or version_id >= node.kept_below or version_id in node.kept)

    def adopt(self, node_id: int, version_id: int) -> None:
        """A version the node stores now (restored from its SSD), which its reconciliation keeps."""
        node = self.nodes.get(node_id)
        if node is not None and node.kept is not None:
            node.kept.add(version_id)

    def live_nodes(self) -> list[NodeRecord]:
        return [node for node in self.nodes.values() if node.live]

    def expired(self, now: float) -> list[NodeRecord]:
        """Live or registering nodes whose last heartbeat is older than the deadline."""
        return [node for node in self.nodes.values()
                if (node.live or node.registering) and node.node_id not in self.permanent
                and now - node.last_seen > self.dead_after_s]
