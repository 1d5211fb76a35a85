"""The RDMA transport's control messages, on the peer server's TCP connections.

Every node's peer server understands them (a node without RDMA answers
`RdmaConnect` with ENOTSUP, so that its peers fetch from it over TCP); the
transport itself is `kvfs.net.rdma`.
"""

from __future__ import annotations

import errno

import msgspec

class RdmaConnect(msgspec.Struct, tag=True):
    qp_num: int
    psn: int
    gid: str


class RdmaAccepted(msgspec.Struct, tag=True):
    qp_num: int
    psn: int
    gid: str
    probe_address: int
    probe_rkey: int
    probe_checksum: int


class Locate(msgspec.Struct, tag=True):
    version: int
    first: int
    count: int


class Located(msgspec.Struct, tag=True):
    lease: int
    addresses: list[int]  # -1: a hole (zeros, nothing to read)
    rkeys: list[int]
    lengths: list[int]


class Unlease(msgspec.Struct, tag=True):
    lease: int


class RevokeForTest(msgspec.Struct, tag=True):
    """Invalidates every window of this connection now (the revocation test's hook)."""


NOT_IN_DRAM = errno.ENODATA  # Locate's answer when the version is only on the owner's SSD


RDMA_REQUESTS = (RdmaConnect, Locate, Unlease, RevokeForTest)
