"""A node's private temp files and the numbers they are made with (pure: no I/O).

A writer's temp file (a name ending in the temp suffix: vLLM's and LMCache's
`<name>.tmp`) is created, written and closed on its node alone; the master first
hears of it when it is renamed to its final name (one `Publish`: create, seal and
rename). Until then no other node can see it, and nothing of it was acknowledged as
durable: a node killed before the rename loses it, as the writer expects of a temp
file. Its inode and version numbers come from blocks the master grants ahead
(`NumberBlocks`), so that a create needs no request (docs/semantics.md, "Temp files").
"""

from __future__ import annotations

import stat
from collections import deque
from dataclasses import dataclass, field

from kvfs.wire import messages as m

BLOCK = 4096  # numbers asked for at a time: one GrantNumbers per 4,096 temp files
REFILL_BELOW = BLOCK // 4  # the next block is asked for (in the background) once fewer remain


class NumberBlocks:
    """Inode and version numbers granted by the master, handed out once each. A block's
    numbers left unused when the node stops are never used: the master never grants them
    again (its counters moved past them and were saved)."""

    def __init__(self) -> None:
        self._blocks: deque[list[int]] = deque()  # [next inode, next version, numbers left]

    def add(self, block: m.Numbers) -> None:
        if block.count > 0:
            self._blocks.append([block.first_ino, block.first_version, block.count])

    @property
    def left(self) -> int:
        return sum(block[2] for block in self._blocks)

    def low(self) -> bool:
        return self.left < REFILL_BELOW

    def take(self) -> tuple[int, int] | None:
        """(inode, version), or None when every granted number is used."""
        if not self._blocks:
            return None
        block = self._blocks[0]
        taken = (block[0], block[1])
        block[0] += 1
        block[1] += 1
        block[2] -= 1
        if not block[2]:
            self._blocks.popleft()
        return taken


@dataclass(slots=True, eq=False)
class PrivateFile:
    """One temp file only this node knows."""

    parent: int
    name: bytes
    ino: int
    version: int
    mode: int
    uid: int
    gid: int
    created_ns: int
    mtime_ns: int
    ctime_ns: int
    size: int = 0  # once sealed (while written: the node's WriteState has it)
    sealed: bool = False
    checksums: list[int] = field(default_factory=list)
    linked: bool = True  # False once unlinked while still open (its bytes go at the last close)
    last_used: float = 0.0  # (monotonic) the last create, write session or rename, for orphan collection

    def attr(self) -> m.Attr:
        return m.Attr(self.ino, stat.S_IFREG | stat.S_IMODE(self.mode), 1 if self.linked else 0, self.uid,
                      self.gid, self.size, self.created_ns, self.mtime_ns, self.ctime_ns, self.version,
                      self.sealed)


class PrivateFiles:
    """The node's private temp files, by name, inode and version."""

    def __init__(self) -> None:
        self._by_name: dict[tuple[int, bytes], PrivateFile] = {}
        self._by_ino: dict[int, PrivateFile] = {}
        self._by_version: dict[int, PrivateFile] = {}

    def __len__(self) -> int:
        return len(self._by_ino)

    def __contains__(self, ino: int) -> bool:
        return ino in self._by_ino

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._by_ino.values()))

    def add(self, file: PrivateFile) -> None:
        self._by_name[(file.parent, file.name)] = file
        self._by_ino[file.ino] = file
        self._by_version[file.version] = file

    def named(self, parent: int, name: bytes) -> PrivateFile | None:
        return self._by_name.get((parent, name))

    def of_ino(self, ino: int) -> PrivateFile | None:
        return self._by_ino.get(ino)

    def of_version(self, version: int) -> PrivateFile | None:
        return self._by_version.get(version)

    def move(self, file: PrivateFile, parent: int, name: bytes) -> None:
        """A rename to another temp name (the caller removed what had that name)."""
        del self._by_name[(file.parent, file.name)]
        file.parent, file.name = parent, name
        self._by_name[(parent, name)] = file

    def unlink(self, file: PrivateFile) -> None:
        """The name goes; the file stays (by inode and version) until `forget`."""
        if file.linked and self._by_name.get((file.parent, file.name)) is file:
            del self._by_name[(file.parent, file.name)]
        file.linked = False

    def forget(self, file: PrivateFile) -> None:
        """Published, or unlinked and closed: no longer private."""
        if file.linked and self._by_name.get((file.parent, file.name)) is file:
            del self._by_name[(file.parent, file.name)]
        self._by_ino.pop(file.ino, None)
        self._by_version.pop(file.version, None)
