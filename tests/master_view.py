"""What of a metadata service's state is saved to lmdb, as plain values to compare: memory
against what a fresh service loads back (kvfs.cluster.persist)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvfs.clock import SystemClock
from kvfs.cluster.master import MasterSettings, MetadataService
from kvfs.cluster.namespace import ROOT_INO
from kvfs.cluster.persist import MasterState
from kvfs.policy import LruPolicy


def saved_view(service: MetadataService) -> dict[str, Any]:
    """The persisted fields. Access times are left out: reads move them in memory only, by
    design (a read is not worth a write); they are saved with the inode's next change."""
    inodes = {ino: (i.mode, i.uid, i.gid, i.mtime_ns, i.ctime_ns, i.parent, i.name, i.entry_id, i.is_dir,
                    i.version, dict(i.xattrs), i.target)
              for ino, i in service.ns.inodes.items() if i.linked}
    versions = {v.version: (v.ino, v.node, v.size, v.sealed, v.current, v.on_disk, list(v.checksums))
                for v in service.objects.versions.values()}
    registry = service.registry
    nodes = sorted((n.node_id, n.name, n.address, tuple(n.grants)) for n in registry.nodes.values()
                   if n.node_id not in registry.permanent)
    return {"inodes": inodes, "versions": versions, "nodes": nodes, "next_ino": service.ns.next_ino,
            "next_entry_id": service.ns.next_entry_id, "next_version": service.objects.next_version,
            "next_node": registry.next_id}


def reloaded_view(service: MetadataService, state: MasterState) -> dict[str, Any]:
    """What a restarted master would hold: the saved state, loaded into a fresh service."""
    fresh = MetadataService(service.clock, LruPolicy(), service.settings)
    state.load(fresh)
    return saved_view(fresh)


def names_on_disk(directory: Path) -> set[bytes]:
    """The root's names in a master's lmdb, loaded as a restarted master would."""
    service = MetadataService(SystemClock(), LruPolicy(), MasterSettings(cluster=True))
    state = MasterState(directory)
    try:
        state.load(service)
    finally:
        state.close()
    return set(service.ns.inodes[ROOT_INO].children)
