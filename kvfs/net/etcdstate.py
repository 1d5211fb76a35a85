"""The master's state in etcd: the records of kvfs.cluster.records under
/kvfs/<cluster>/state/, written by the leader only, fenced on its epoch.

Every commit is an etcd txn whose compare is `create_revision(leader key) == epoch`:
once another master leads (the key was created anew, so its create_revision changed)
or the key is gone, the txn writes nothing and `commit` raises `Fenced`. A batch larger
than etcd allows in one txn (128 operations, ~1.5 MiB a request by default) is cut into
several, the counters first: a part written before a crash never holds an inode or
version number that the counters saved would hand out again.

The load reads every record in pages from one revision (a consistent snapshot); a
hot standby then follows the changes from there (kvfs.net.follow).
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from kvfs.batching import batches
from kvfs.cluster import records
from kvfs.cluster.master import MetadataService
from kvfs.cluster.records import Change, Kind
from kvfs.net.etcd import MAX_TXN_OPS, EtcdClient, EtcdError, create_revision_is, delete, leader_key, put

TXN_BYTES = 512 << 10  # record bytes per txn (base64 and JSON make ~1.4x that on the wire)
LOAD_PAGE = 10000


class Fenced(EtcdError):
    """A write was refused: this master's epoch is no longer the leader key's."""


@dataclass
class Batch:
    changes: list[Change]
    nodes: dict[int, records.NodeFields] | None  # the nodes as written once this commits (None: unchanged)


def split(changes: list[Change], max_ops: int = MAX_TXN_OPS, max_bytes: int = TXN_BYTES) -> list[list[Change]]:
    """The changes in txns of at most MAX_OPS operations and about MAX_BYTES, counters first."""
    ordered = sorted(changes, key=lambda change: change.kind is not Kind.COUNTERS)
    return batches(ordered, lambda change: len(change.value or b"") + 32, max_bytes, max_ops)


class EtcdState:
    def __init__(self, client: EtcdClient, cluster: str) -> None:
        self.client = client
        self.cluster = cluster
        self.leader = leader_key(cluster)
        self.prefix = f"/kvfs/{cluster}/state/".encode()
        self._written_nodes: dict[int, records.NodeFields] = {}
        self.txns = 0
        self.revision = 0  # etcd's revision after the last commit

    def key(self, kind: Kind, number: int) -> bytes:
        if kind is Kind.COUNTERS:
            return self.prefix + b"c"
        return self.prefix + kind.value.encode() + b"/" + number.to_bytes(8, "big")

    def parse_key(self, key: bytes) -> tuple[Kind, int]:
        rest = key[len(self.prefix):]
        if rest == b"c":
            return Kind.COUNTERS, 0
        if len(rest) != 10 or rest[1:2] != b"/":
            raise EtcdError(f"etcd {key!r}: not a kvfs state record")
        return Kind(rest[:1].decode()), int.from_bytes(rest[2:], "big")

    async def load(self, service: MetadataService, revision: int = 0) -> int:
        """Fills a fresh service with the state in etcd (at REVISION when given: Compacted
        when etcd no longer has it; `client.read_revision` says which was read); the number
        of files. Each page is
        decoded in a worker thread while the next is fetched, and the service loaded in one:
        the event loop keeps renewing the lease meanwhile (a load of a million files takes
        longer than a TTL)."""
        loaded = records.Loaded()
        send, receive = trio.open_memory_channel[list[tuple[bytes, bytes]]](2)
        failed: list[EtcdError] = []

        async def fetch() -> None:
            async with send:
                try:
                    async for page in self.client.pages(self.prefix, limit=LOAD_PAGE, revision=revision):
                        await send.send(page)
                except EtcdError as error:  # raised below, not as a group of the nursery's
                    failed.append(error)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(fetch)
            async with receive:
                async for page in receive:
                    await trio.to_thread.run_sync(self._decode, page, loaded)
        if failed:
            raise failed[0]
        self._written_nodes = loaded.written_nodes()
        return await trio.to_thread.run_sync(loaded.into, service)

    def adopt(self, service: MetadataService) -> None:
        """A service that holds exactly the state in etcd (a standby's copy, kvfs.net.follow):
        the next `take` writes what changes from here."""
        records.clear_dirty(service)
        self._written_nodes = records.saved_nodes(service)

    def _decode(self, page: list[tuple[bytes, bytes]], loaded: records.Loaded) -> None:
        for key, value in page:
            kind, number = self.parse_key(key)
            try:
                loaded.add(kind, number, value)
            except Exception as error:  # a damaged record: named, and the load fails
                raise EtcdError(f"etcd {key!r}: cannot decode: {error}") from None

    def take(self, service: MetadataService) -> Batch | None:
        """Every change since the last take (the service's dirty sets are cleared), or None."""
        if not records.is_dirty(service):
            return None
        changes = records.changes(service, self._written_nodes)
        nodes = records.saved_nodes(service) if service.registry.dirty else None
        records.clear_dirty(service)
        if nodes is not None:
            self._written_nodes = nodes  # what the next diff is against (a failed commit ends the leadership)
        return Batch(changes, nodes) if changes else None

    async def commit(self, batch: Batch, epoch: int) -> None:
        """Writes the batch, fenced on EPOCH. Raises Fenced, or EtcdError (the outcome is
        then unknown; the same batch may be written again: its puts are idempotent)."""
        fence = [create_revision_is(self.leader, epoch)]
        for part in split(batch.changes):
            operations = [delete(self.key(c.kind, c.number)) if c.value is None else
                          put(self.key(c.kind, c.number), c.value) for c in part]
            succeeded, revision, _ = await self.client.txn(fence, operations)
            self.txns += 1
            self.revision = max(self.revision, revision)
            if not succeeded:
                raise Fenced(f"etcd refused a write of epoch {epoch}: {self.leader.decode()} was created anew "
                             f"or is gone (another master leads, or this one's lease expired)")
