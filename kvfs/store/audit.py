"""A store's books checked against its tiers: residency vs DRAM tier vs SSD extents vs the SSD
index vs the space both allocators account for. Pure reads of in-memory state (and of the
index); meant for a quiet moment (no write, offload or read in flight), when every
difference is a bug.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Collection

from kvfs.disk.engine import ALIGN
from kvfs.disk.records import DiskRecord

if TYPE_CHECKING:
    from kvfs.store.tiered import TieredStore


def audit(store: TieredStore, writing: Collection[int] = ()) -> list[str]:
    """What contradicts itself; `writing` names versions being written (unsealed, DRAM only)."""
    books = store.residency
    problems = list(books.problems())
    dram, ssd = store.dram, store.ssd
    busy = books.busy_versions()
    for version, entry in books.entries().items():
        if entry.in_dram != (version in dram):
            problems.append(f"version {version}: the books say in DRAM {entry.in_dram}, the DRAM tier "
                            f"{version in dram}")
        if entry.on_ssd != (ssd is not None and version in ssd):
            problems.append(f"version {version}: the books say on SSD {entry.on_ssd}, the SSD tier "
                            f"{ssd is not None and version in ssd}")
    for version in dram.versions():
        if version not in books and version not in writing and not busy.get(version, None):
            problems.append(f"version {version} is in DRAM but neither sealed, written nor in use")
    problems += _dram_space(store)
    if ssd is not None:
        removals = set(books.removals())
        for version in ssd.extents:
            entry = books.entry(version)
            if (entry is None or not entry.on_ssd) and version not in removals:
                problems.append(f"version {version} is on SSD but the books neither keep nor remove it")
        problems += _ssd_index(store)
        problems += _ssd_space(store)
    return problems


def _dram_space(store: TieredStore) -> list[str]:
    arena = store.dram.arena
    blocks = sum(store.dram.block_bytes(version) for version in store.dram.versions())
    if blocks != arena.used:
        return [f"the DRAM arena accounts {arena.used} bytes, the versions' blocks take {blocks}"]
    return []


def _ssd_index(store: TieredStore) -> list[str]:
    ssd = store.ssd
    assert ssd is not None
    problems = []
    records = {r.version: r for r in ssd.index.records() if isinstance(r, DiskRecord)}
    if set(records) != set(ssd.extents):
        problems.append(f"the SSD index holds {sorted(set(records) ^ set(ssd.extents))} unlike the tier")
    for version, record in records.items():
        extents = ssd.extents.get(version)
        if extents is not None and [(e.offset, e.length, e.checksum) for e in extents] != record.chunks:
            problems.append(f"version {version}: the index's chunks differ from the tier's extents")
        entry = store.residency.entry(version)
        if entry is not None and entry.saved and (record.file.size != entry.size
                                                 or [c for _, _, c in record.chunks] != entry.checksums):
            problems.append(f"version {version}: its saved record disagrees with its size or checksums")
    return problems


def _ssd_space(store: TieredStore) -> list[str]:
    ssd = store.ssd
    assert ssd is not None
    allocator = ssd.allocator
    taken = sum(allocator.allocated_size(e.offset) for extents in ssd.extents.values() for e in extents)
    taken += sum(allocator.allocated_size(offset) for offset, _ in ssd.headers.values())
    taken += ALIGN * len(ssd._header_pages)  # set aside for the next commits
    if taken != ssd.used:
        return [f"the SSD allocator accounts {ssd.used} bytes, extents and headers take {taken}"]
    return []
