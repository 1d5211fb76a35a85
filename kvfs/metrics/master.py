"""What the master exports: its requests, the namespace, and every node's liveness and use;
with --etcd also whether it leads, its epoch, and its standby copy of the state."""

from __future__ import annotations

from dataclasses import dataclass

from kvfs import __version__
from kvfs.cluster.master import MetadataService
from kvfs.net.follow import Follower
from kvfs.net.rpc import MetadataServer
from kvfs.metrics.families import Families
from kvfs.histogram import OperationStats


def describe_namespace(out: Families, service: MetadataService) -> None:
    """The namespace and eviction figures, for the master process and the embedded master."""
    out.gauge("files", "files in the namespace", service.ns.files)
    out.gauge("inodes", "inodes (files and directories)", len(service.ns.inodes))
    out.gauge("sealed_bytes", "bytes of sealed (complete) file versions", service.objects.sealed_bytes)
    out.counter("evictions", "files evicted to make room, as decided by the master", service.evicted_files)
    out.counter("evicted_bytes", "bytes freed by evictions", service.evicted_bytes)


@dataclass
class MasterMetrics:
    service: MetadataService
    requests: OperationStats
    server: MetadataServer
    saves: OperationStats | None = None  # the lmdb master's transactions (an elected master commits to etcd)

    def describe(self, out: Families) -> None:
        out.gauges("master_info", "this master (value 1)", ("version",), {(__version__,): 1})
        describe_namespace(out, self.service)
        out.operations("master_requests", "requests handled by the master", "request", self.requests)
        if self.saves is not None:
            out.operations("master_saves", "saves of the master's state, each for the requests handled together",
                           "store", self.saves)
        out.counter("master_connections_refused", "connections that failed authentication", self.server.refused)
        nodes = list(self.service.registry.nodes.values())
        out.gauges("node_up", "1 while a node heartbeats, 0 once it is declared dead", ("node",),
                   {(node.name,): int(node.live) for node in nodes})
        out.gauges("node_capacity_bytes", "capacity of each node's tiers, from its heartbeats", ("node", "tier"),
                   {**{(n.name, "dram"): n.usage.dram_capacity for n in nodes},
                    **{(n.name, "ssd"): n.usage.ssd_capacity for n in nodes if n.usage.ssd_capacity}})
        out.gauges("node_used_bytes", "bytes in use in each node's tiers, from its heartbeats", ("node", "tier"),
                   {**{(n.name, "dram"): n.usage.dram_used for n in nodes},
                    **{(n.name, "ssd"): n.usage.ssd_used for n in nodes if n.usage.ssd_capacity}})
        out.gauges("node_offload_backlog_bytes", "bytes each node has yet to copy to SSD", ("node",),
                   {(n.name,): n.activity.offload_backlog_bytes for n in nodes})


def describe_election(out: Families, epoch: int, follower: Follower | None, caught_up: int,
                      paused: bool = False) -> None:
    """An elected master's (--etcd) role: EPOCH is its leadership's, 0 while it stands by;
    FOLLOWER its copy of the state while it stands by; CAUGHT_UP the records that copy
    applied at its election (-1: it loaded the state instead, or never led); PAUSED while
    it leads but answers nothing, its lease's renewals unanswered."""
    out.gauge("master_leader", "1 while this master leads, 0 while it stands by", int(epoch > 0))
    out.gauge("master_paused", "1 while this leader is paused: no lease renewal answered by its deadline (etcd "
              "electing a leader, or unreachable); it answers nothing until one is, or steps down", int(paused))
    out.gauge("master_epoch", "the epoch (the leader key's etcd revision) this master leads in; 0: standing by",
              epoch)
    out.gauge("master_takeover_records", "records of the leader's commits the standby copy applied at this "
              "master's latest election (-1: it loaded the whole state instead)", caught_up)
    if follower is not None:
        out.gauge("master_standby_loaded", "1 once the standby copy of the state is loaded and following",
                  int(follower.service is not None))
        out.gauge("master_standby_files", "files in the standby copy of the state",
                  follower.service.ns.files if follower.service is not None else 0)
        out.gauge("master_standby_revision", "the etcd revision the standby copy has seen", follower.revision)
        out.counter("master_standby_records_applied", "records of the leader's commits applied to the standby "
                    "copy since it last loaded", follower.applied)
        out.counter("master_standby_loads", "loads of the whole state by this standby", follower.loads)
