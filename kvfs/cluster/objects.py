"""The object directory: file versions, their chunks, where they live (pure).

A file's bytes are an immutable version once sealed. Writing a sealed file
starts a new version (copy-on-write) and retires the old one, which lives on
until its last open handle is released: readers keep the bytes they opened.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field

from kvfs.errors import MetadataError


@dataclass(slots=True, eq=False)
class FileVersion:
    version: int
    ino: int
    node: int  # the node that stores the bytes
    size: int = 0
    sealed: bool = False
    current: bool = True  # still the version its file's name refers to
    readers: int = 0
    writers: int = 0
    checksums: list[int] = field(default_factory=list)
    on_disk: bool = False  # a copy is safe on the node's SSD
    hits: int = 0
    last_access_ns: int = 0
    held: bool = False  # retired, but an inode a kernel references still shows it (see master)

    @property
    def in_use(self) -> bool:
        return self.readers > 0 or self.writers > 0


class ObjectDirectory:
    def __init__(self) -> None:
        self.versions: dict[int, FileVersion] = {}
        self.next_version = 1
        self.sealed_bytes = 0
        self.dirty: set[int] = set()  # versions changed since the owner last saved them
        # Versions dropped since the master last routed them to the nodes that store them.
        self.dropped_log: list[FileVersion] = []

    def get(self, version: int) -> FileVersion:
        found = self.versions.get(version)
        if found is None:
            raise MetadataError(errno.ESTALE, f"file version {version} is gone")
        return found

    def create(self, ino: int, node: int) -> FileVersion:
        version = FileVersion(self.next_version, ino, node)
        self.next_version += 1
        self.versions[version.version] = version
        self.dirty.add(version.version)
        return version

    def restore(self, version_id: int, ino: int, node: int, size: int, checksums: list[int]) -> FileVersion:
        """A sealed version found on a node's SSD after a restart keeps its id."""
        version = FileVersion(version_id, ino, node, on_disk=True)
        self.versions[version_id] = version
        self.next_version = max(self.next_version, version_id + 1)
        self.seal(version, size, checksums)
        return version

    def load(self, versions: list[FileVersion], next_version: int) -> None:
        """Saved versions after a master restart (no open handles yet: nodes report theirs)."""
        for version in versions:
            self.versions[version.version] = version
            if version.sealed:
                self.sealed_bytes += version.size
        self.next_version = max([next_version] + [v.version + 1 for v in versions])
        self.dirty.clear()

    def seal(self, version: FileVersion, size: int, checksums: list[int]) -> None:
        version.sealed, version.size, version.checksums = True, size, checksums
        self.sealed_bytes += size
        self.dirty.add(version.version)

    def retire(self, version: FileVersion, dropped: list[int]) -> None:
        """The version is no longer its file's content; drop it once nobody has it open."""
        version.current = False
        self.dirty.add(version.version)
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
        if version.sealed:
            self.sealed_bytes -= version.size
        self.dirty.add(version.version)
        self.dropped_log.append(version)
