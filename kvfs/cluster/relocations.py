"""Index records to rewrite after a rename, handed to each file's own node (pure).

A node's SSD index records each file's path, read back only when a master that lost its
state restores files from the nodes' records. A rename of a directory changes the path
of every file below it: listing them in the rename's answer made the master's work and
the answer O(subtree), past a frame header's 1 MiB at about 280K files on SSD, and only
the caller's records were rewritten. Instead the rename starts a walk of the moved
subtree, a slice of entries per step of the master's backlog (kvfs.cluster.backlog),
which puts each version on SSD in its own node's outbox; the outboxes go out with the
heartbeats, at most BEAT_IDS versions each, and each node rewrites those records in the
background (kvfs.node.relocations: `GetRecord` then gives the path as it is at that
moment, so a record rewritten twice, or late, still ends right).

Nothing of it is saved: what it would restore is derived again. Every registration
reports each file on the node's SSD with its record (`Held.record`), and a node
registers after each of its restarts and after each master restart or failover (its
connection broke). `check` compares those paths with the namespace and puts each stale
one in the node's outbox. So a walk cut short by a master restart, a slice lost with a
broken connection, or a node that died before rewriting what it was sent all end with
the next registration; with no restart, the walk and the heartbeats deliver everything.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Container, Iterator, Mapping

from kvfs.cluster.backlog import STEP_ITEMS, Backlog
from kvfs.cluster.namespace import ROOT_INO, Inode, Namespace
from kvfs.cluster.objects import FileVersion
from kvfs.cluster.registry import Registry
from kvfs.wire import messages as m

ID_BYTES = 9  # a version id in msgpack, at most
# Versions per heartbeat answer: 128 KiB, with its 256 KiB of drops and 512 KiB of names
# under a frame header's 1 MiB (kvfs.cluster.membership).
BEAT_IDS = (128 << 10) // ID_BYTES


class Relocations:
    def __init__(self, ns: Namespace, versions: Mapping[int, FileVersion], registry: Registry, backlog: Backlog,
                 slice_items: int = STEP_ITEMS) -> None:
        self.ns, self.versions, self.registry, self.backlog = ns, versions, registry, backlog
        self.slice_items = slice_items  # entries a walk looks at per step
        self._outboxes: dict[int, deque[int]] = {}  # node -> versions whose records it must rewrite
        self.walks = 0  # walks started, since start (for the tests and the benchmark)
        self.walked = 0  # entries looked at by walks
        self.found_stale = 0  # records a registration reported with a path no longer theirs

    def start(self, root: int) -> None:
        """A rename moved `root` (a directory, or a file on another node than the caller)."""
        self.walks += 1
        self.backlog.add(self._walk(root))

    def add(self, node: int, version: int) -> None:
        self._outboxes.setdefault(node, deque()).append(version)

    def pending(self, node: int) -> int:
        """Versions waiting for `node`'s heartbeats."""
        return len(self._outboxes.get(node, ()))

    def _walk(self, root: int) -> Iterator[None]:
        """The versions on SSD at or below `root`, a slice of entries per step. Entries
        moved in or out meanwhile have walks of their own; entry ids only grow, so a page
        after the last id seen neither skips nor repeats an entry that stayed."""
        inodes, versions, outboxes = self.ns.inodes, self.versions, self._outboxes
        stack: list[tuple[int, int]] = [(root, 0)]  # (inode, entry id after which its listing goes on)
        while stack:
            budget = self.slice_items
            # A node down now registers before its next heartbeat, and its report names what is
            # stale then: nothing is kept for it meanwhile.
            told = {node.node_id: deque() for node in self.registry.nodes.values() if node.live or node.registering}
            while stack and budget > 0:
                ino, after = stack.pop()
                inode = inodes.get(ino)
                if inode is None:
                    continue
                if inode.children is None:  # (a file: the root of a file's rename)
                    children = [(ino, 0)]
                    budget -= 1
                else:
                    children = inode.children.page(after, budget)
                    if len(children) == budget:  # (maybe more: the rest of it after its subdirectories)
                        stack.append((ino, children[-1][1]))
                    budget -= len(children) + 1
                    self.walked += len(children)
                for child_ino, _ in children:
                    child = inodes[child_ino]
                    if child.children is not None:
                        stack.append((child_ino, 0))
                        continue
                    version = versions.get(child.version)
                    if version is not None and version.on_disk and version.current:
                        box = told.get(version.node)
                        if box is not None:
                            box.append(version.version)
            for node, box in told.items():
                if box:
                    outboxes.setdefault(node, deque()).extend(box)
            yield

    def beat(self, node: int) -> list[int]:
        """What a heartbeat answer of `node` carries: the oldest BEAT_IDS of its outbox."""
        box = self._outboxes.get(node)
        if not box:
            return []
        taken = [box.popleft() for _ in range(min(len(box), BEAT_IDS))]
        if not box:
            del self._outboxes[node]
        return taken

    def registered(self, node: int) -> None:
        """A node (re)registered: its report says again which of its records are stale."""
        self._outboxes.pop(node, None)

    def forget(self, registered: Container[int]) -> None:
        """Outboxes of nodes no longer registered (forgotten: their records went with them).
        O(outboxes): called before every backlog slice."""
        for node in [node for node in self._outboxes if node not in registered]:
            del self._outboxes[node]

    def check(self, node: int, held: list[m.Held]) -> None:
        """A registering node's report: each file on its SSD whose record names another path
        than the namespace does (a rename whose rewrite it never got) goes in its outbox.
        O(reported) with the paths of their directories computed once per report."""
        inodes, versions, paths = self.ns.inodes, self.versions, {ROOT_INO: []}
        for item in held:
            record = item.record
            if record is None:
                continue
            version = versions.get(item.version)
            if version is None or version.node != node or not version.current:
                continue
            inode = inodes.get(version.ino)
            if inode is None or not inode.linked or inode.version != version.version:
                continue
            path = record.path
            directory = paths.get(inode.parent)
            if directory is None:
                directory = self._directory_path(inode.parent, paths)
            if len(path) != len(directory) + 1 or path[-1] != inode.name or path[:-1] != directory:
                self.found_stale += 1
                self.add(node, version.version)

    def _directory_path(self, ino: int, paths: dict[int, list[bytes]]) -> list[bytes]:
        """A directory's names from the root down, from the nearest one already in `paths`."""
        above: list[Inode] = []
        while ino not in paths:
            directory = self.ns.inodes[ino]
            above.append(directory)
            ino = directory.parent
        path = paths[ino]
        for directory in reversed(above):
            path = paths[directory.ino] = [*path, directory.name]
        return path
