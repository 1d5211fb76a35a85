"""Running totals of what each node stores, kept as versions change (pure).

`kvfs status` shows per node its files, those only in DRAM, those on SSD and their
bytes. Summed over every version on each call, that is O(all files) on the master's
loop (a second at a few million files); kept here, it is O(nodes).

The totals count current versions. `CountedObjects` is the object directory with
the counting added around each change of what counts (a version added, sealed,
retired, forgotten, offloaded, resized); the service changes `on_disk`, `size` and
`current` through it, never by assigning the attribute, or the totals drift
(tests/test_loop_bounds.py compares them with a full recount after random work).
"""

from __future__ import annotations

from typing import Callable

from kvfs.cluster.objects import FileVersion, ObjectDirectory

# Per node: [files, DRAM-only files, files on SSD, bytes] of its current versions.
FILES, DRAM_ONLY, SSD, BYTES = range(4)


def count_nodes(objects: ObjectDirectory) -> dict[int, list[int]]:
    """The totals counted from scratch (O(all versions)): for checks, never on a request."""
    counts: dict[int, list[int]] = {}
    for version in objects.versions.values():
        if version.current:
            entry = counts.setdefault(version.node, [0, 0, 0, 0])
            entry[FILES] += 1
            entry[SSD if version.on_disk else DRAM_ONLY] += 1
            entry[BYTES] += version.size
    return counts


class CountedObjects(ObjectDirectory):
    def __init__(self) -> None:
        super().__init__()
        self.node_totals: dict[int, list[int]] = {}
        # Per node, how many of its versions were ever forgotten: a registration that saw no
        # forget since it began knows every version it was told about is still there (O(1)).
        self.forgotten: dict[int, int] = {}
        self._counting = True  # (off while a saved state loads: counted once at the end)
        # Told of a version whose copy moved between tiers (the master files its inode under
        # the node's other tier in the eviction policy): whoever set `on_disk`, it follows.
        self.tier_changed: Callable[[FileVersion], None] = lambda version: None

    def _count(self, version: FileVersion, sign: int) -> None:
        node, size, _, current, on_disk = version.fields()  # (one read: this runs on every create)
        if not current:
            return
        entry = self.node_totals.get(node)
        if entry is None:
            entry = self.node_totals[node] = [0, 0, 0, 0]
        entry[FILES] += sign
        entry[SSD if on_disk else DRAM_ONLY] += sign
        entry[BYTES] += sign * size
        if not entry[FILES]:
            del self.node_totals[node]

    def totals(self, node: int) -> tuple[int, int, int, int]:
        """(files, DRAM-only files, files on SSD, bytes) of the node's current versions."""
        entry = self.node_totals.get(node)
        return (entry[FILES], entry[DRAM_ONLY], entry[SSD], entry[BYTES]) if entry else (0, 0, 0, 0)

    # Every way a version enters, changes what counts, or leaves.

    def load(self, versions: list[FileVersion], next_version: int) -> None:
        self._counting = False
        try:
            super().load(versions, next_version)
        finally:
            self._counting = True
        self.node_totals = {node: counts for node, counts in count_nodes(self).items() if counts[FILES]}

    def load_more(self, versions: list[FileVersion], next_version: int) -> None:
        """Versions added to a loaded directory (a standby applying commits), each counted
        as it comes: O(versions given), not a recount of all."""
        super().load(versions, next_version)

    def _add(self, version: FileVersion) -> None:
        super()._add(version)
        if self._counting:
            self._count(version, 1)

    def seal(self, version: FileVersion, size: int, checksums: list[int]) -> None:
        node, before, _, current, _ = version.fields()
        super().seal(version, size, checksums)  # (sets the size to `size`, nothing else that counts)
        if current and size != before:  # (only its bytes change: one add, on every create)
            self.node_totals[node][BYTES] += size - before

    def retire(self, version: FileVersion, dropped: list[int]) -> None:
        self._count(version, -1)
        version.current = False  # (what the directory's retire sets first; it may forget it too)
        super().retire(version, dropped)

    def forget(self, version: FileVersion) -> None:
        if version.version in self.versions:
            self._count(version, -1)
            self.forgotten[version.node] = self.forgotten.get(version.node, 0) + 1
        super().forget(version)

    def set_on_disk(self, version: FileVersion, on_disk: bool) -> None:
        if version.on_disk != on_disk:
            self._count(version, -1)
            version.on_disk = on_disk
            self._count(version, 1)
            self.tier_changed(version)

    def set_size(self, version: FileVersion, size: int) -> None:
        self._count(version, -1)
        version.size = size
        self._count(version, 1)

    def uncurrent(self, version: FileVersion) -> None:
        """No longer its file's content, without the retire's bookkeeping (a version being forgotten)."""
        self._count(version, -1)
        version.current = False
