"""What a node exports: its FUSE requests, tiers, movement between them, peers and master."""

from __future__ import annotations

from dataclasses import dataclass

from kvfs import __version__
from kvfs.cluster.master import MetadataService
from kvfs.net.rdma import RdmaExporter, RdmaTransport
from kvfs.net.transport import PeerServer, TcpTransport
from kvfs.metrics.families import Families
from kvfs.histogram import OperationStats
from kvfs.metrics.master import describe_namespace
from kvfs.node.service import TIERS, Node


@dataclass
class NodeMetrics:
    node: Node
    fuse: OperationStats  # the FUSE handlers' requests
    embedded: MetadataService | None = None  # single-node mode: the in-process master
    peer_server: PeerServer | None = None
    name: str = "local"

    def describe(self, out: Families) -> None:
        node, store = self.node, self.node.store
        out.gauges("node_info", "this node (value 1)", ("node", "node_id", "version"),
                   {(self.name, str(node.node_id), __version__): 1})
        out.operations("fuse_operations", "FUSE requests", "operation", self.fuse)
        out.counters("lookups", "names looked up by the kernel, found or absent (the cache's hits and misses)",
                     ("result",), {("found",): node.lookups_found, ("absent",): node.lookups_absent})
        out.counters("tier_hits", "reader opens served by each tier", ("tier",),
                     {(tier,): node.reader_opens[tier] for tier in TIERS})
        misses = {("dram",): node.reader_opens["ssd"] + node.reader_opens["peer"]}
        if store.ssd is not None:
            misses[("ssd",)] = node.reader_opens["peer"]
        out.counters("tier_misses", "reader opens that a tier could not serve (they went to a lower one)",
                     ("tier",), misses)
        out.counters("served_bytes", "bytes read through the mount, by the tier that served them", ("tier",),
                     {(tier,): node.served_bytes[tier] for tier in TIERS})
        capacity = {("dram",): store.dram.capacity}
        used = {("dram",): store.dram.used}
        if store.ssd is not None:
            capacity[("ssd",)], used[("ssd",)] = store.ssd.capacity, store.ssd.used
        out.gauges("tier_capacity_bytes", "capacity of each tier", ("tier",), capacity)
        out.gauges("tier_used_bytes", "bytes in use in each tier", ("tier",), used)
        self._movement(out)
        self._cluster(out)
        if self.embedded is not None:
            describe_namespace(out, self.embedded)

    def _movement(self, out: Families) -> None:
        node, stats = self.node, self.node.store.stats
        backlog_files, backlog_bytes = node.store.offload_backlog()
        out.counter("evicted_files", "files evicted from this node to make room", node.evicted_files)
        out.counter("offloaded_files", "files copied from DRAM to SSD", stats.offloaded_files)
        out.counter("offloaded_bytes", "bytes copied from DRAM to SSD", stats.offloaded_bytes)
        out.counter("promoted_files", "files brought back from SSD into DRAM on reuse", stats.promoted_files)
        out.counter("demoted_files", "DRAM copies dropped because the file is safe on SSD", stats.demoted_files)
        out.gauge("offload_backlog_files", "files waiting to be copied to SSD", backlog_files)
        out.gauge("offload_backlog_bytes", "bytes waiting to be copied to SSD", backlog_bytes)
        out.counter("ssd_reads", "files read from SSD (not promoted)", stats.ssd_reads)
        out.counter("backpressure_waits", "writes that waited for the offloader to free DRAM",
                    stats.backpressure_waits)
        out.counter("backpressure_wait_seconds", "time writers spent waiting for the offloader",
                    stats.backpressure_seconds)
        checksum_failures = {("ssd",): stats.checksum_failures}
        if node.transport is not None:
            checksum_failures[("peer",)] = node.transport.checksum_failures
        out.counters("checksum_failures", "chunks that failed their checksum, by where they came from",
                     ("source",), checksum_failures)
        failed_files, failed_bytes = node.store.offload_failed()  # (0 without an SSD tier, as the backlog)
        out.counters("storage_errors", "failures of the SSD tier by operation (offload, index, read) and cause "
                     "(an errno name such as ENOSPC or EIO, or lmdb's error)", ("operation", "cause"),
                     {key: count for key, count in node.store.faults.counts.items()})
        out.gauge("offload_failed_files", "files a storage failure kept from SSD (in DRAM, retried)", failed_files)
        out.gauge("offload_failed_bytes", "bytes a storage failure kept from SSD (in DRAM, retried)", failed_bytes)
        out.counter("quarantined_files", "files removed for good because a chunk failed its checksum on SSD",
                    stats.quarantined_files)
        out.counter("read_buffer_misses", "reads that found no free read buffer", node.store.read_buffers.misses)

    def _transports(self, out: Families, transport: object) -> None:
        rdma = transport if isinstance(transport, RdmaTransport) else None
        tcp = rdma.tcp if rdma is not None else transport
        assert isinstance(tcp, TcpTransport)
        moved = {("tcp",): tcp.fetched_bytes}
        operations = {("tcp",): sum(tcp.fetches.counts.values())}
        if rdma is not None:
            moved[("rdma",)], operations[("rdma",)] = rdma.rdma_bytes, rdma.rdma_reads
            out.counters("rdma_errors", "RDMA failures by type (a completion status, timeout, control)",
                         ("type",), {(kind,): count for kind, count in rdma.errors.items()})
            out.counters("rdma_fallbacks", "fetches moved to TCP, by reason", ("reason",),
                         {(reason,): count for reason, count in rdma.fallbacks.items()})
        out.counters("transport_bytes", "bytes fetched from other nodes by transport", ("transport",), moved)
        out.counters("transport_operations", "fetches by transport (RDMA: one READ per chunk; TCP: one "
                     "request per chunk run)", ("transport",), operations)
        exporter = self.peer_server.rdma if self.peer_server is not None else None
        if isinstance(exporter, RdmaExporter):
            out.counter("rdma_windows_granted", "chunks granted to peers as memory windows", exporter.granted)
            out.counter("rdma_windows_revoked", "memory windows invalidated", exporter.revoked)

    def _cluster(self, out: Families) -> None:
        node = self.node
        calls = getattr(node.master, "calls", None)
        if isinstance(calls, OperationStats):
            out.operations("master_rpc", "requests to the master", "request", calls)
        up = getattr(node.master, "connected", True)
        out.gauge("master_connected", "1 while this node is connected and registered to the master", int(up))
        transport = node.transport
        if transport is not None:
            out.counter("peer_fetched_bytes", "bytes fetched from other nodes", transport.fetched_bytes)
            out.operations("peer_fetches", "chunk runs fetched from other nodes", "operation", transport.fetches)
            out.counter("remote_reads", "reader opens of files stored on another node", node.remote_reads)
            self._transports(out, transport)
        if self.peer_server is not None:
            out.counter("peer_served_bytes", "bytes sent to other nodes", self.peer_server.served_bytes)
            out.counter("peer_connections_refused", "peer connections that failed authentication",
                        self.peer_server.refused)
            out.counter("peer_connections_plaintext", "peer connections served in the clear after their TLS setup "
                        "(peer encryption off on both nodes)", self.peer_server.plaintext_connections)
        if node.prefetches is not None:
            prefetches = node.prefetches
            out.counters("prefetches", "remote files fetched at lookup, by outcome", ("outcome",),
                         {("started",): prefetches.started, ("claimed",): prefetches.claimed,
                          ("wasted",): prefetches.wasted})
        if node.batcher is not None:
            out.counter("prefetch_batches", "requests that carried several prefetches to their owner at once",
                        node.batcher.batches)
            out.counter("prefetch_batched_runs", "prefetch chunk runs those requests carried",
                        node.batcher.batched_runs)
        out.counter("degraded_reads", "opens served while the master was unreachable", node.degraded_reads)
