"""Who may do what: authority follows the identity in a connection's certificate (pure).

A connection's identity is the name and role its certificate says (never what the peer
claims). The rules:

- Who may connect: the master serves nodes, admins and clients; a node's peer server
  serves nodes only. A client requires the master to be role `master`, a node requires a
  peer to be role `node`.
- A node registers under its certificate's name only, advertising an address whose host is
  one of its certificate's IP addresses; every later request on that connection acts for
  that node only (a request naming another node id, or a version stored on another node,
  is refused).
- A `client` may only read the cluster's state (status, du); an `admin` may also change
  the cluster (remove a node). Neither touches the namespace: that is what nodes do for
  their users.

`check_request` raises `Refused` (EPERM) with the reason; the server logs it and answers
the errno. The I/O side (kvfs.net.rpc) supplies the connection's identity and node id.
"""

from __future__ import annotations

import errno
import ipaddress
from dataclasses import dataclass
from typing import Callable

from kvfs.errors import KvfsError
from kvfs.wire import messages as m

# Who may connect to whom.
MASTER_CLIENTS = frozenset({"node", "admin", "client"})
PEER_CLIENTS = frozenset({"node"})
MASTER_ROLE = "master"  # what a node or a status client requires of the master
PEER_ROLE = "node"  # what a node requires of a peer it fetches from

READ_ONLY: frozenset[type[m.Request]] = frozenset({m.ClusterStatus, m.DirUsage, m.Stats})
ADMIN: frozenset[type[m.Request]] = READ_ONLY | {m.RemoveNode}
NODE_ONLY: frozenset[type[m.Request]] = frozenset({m.RemoveNode})  # what a node may not do

# Requests that name the node they act for, and those that name versions the caller must store.
_NODE_FIELD = (m.Create, m.OpenWrite, m.Reclaim, m.Restore, m.Publish)


@dataclass(frozen=True)
class Caller:
    """The identity on a connection, as its certificate says, and the node id it registered
    as (0 before it registers, and always for clients)."""

    name: str
    role: str
    addresses: tuple[str, ...] = ()
    node: int = 0

    def __str__(self) -> str:
        return f"{self.role} {self.name!r}" + (f" (node {self.node})" if self.node else "")


class Refused(KvfsError):
    """The caller's identity does not allow this request."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EPERM, message)


def may_connect(role: str, allowed: frozenset[str]) -> bool:
    return role in allowed


def address_host(address: str) -> str:
    """The host of HOST:PORT or [IPv6]:PORT."""
    host, _, _ = address.rpartition(":")
    return host.strip("[]")


def check_register(caller: Caller, request: m.Register) -> None:
    """A node registers as itself, at an address its certificate allows."""
    if request.name != caller.name:
        raise Refused(f"{caller} may not register as node {request.name[:64]!r}")
    if not caller.addresses:
        raise Refused(f"{caller}: its certificate lists no IP address; issue it again with "
                      f"`kvfs ca issue {caller.name} --role node --address IP`")
    host = address_host(request.address)
    try:
        advertised = ipaddress.ip_address(host)
    except ValueError:
        raise Refused(f"{caller} advertises {request.address[:80]!r}, not an IP address "
                      f"(its certificate allows {', '.join(caller.addresses)}; set --advertise)") from None
    if all(ipaddress.ip_address(allowed) != advertised for allowed in caller.addresses):
        raise Refused(f"{caller} advertises {host}, which its certificate does not allow "
                      f"({', '.join(caller.addresses)})")


def check_request(caller: Caller, request: m.Request, owner_of: Callable[[int], int | None]) -> None:
    """Raises Refused unless CALLER may send REQUEST. `owner_of(version)` is the node storing
    a version (None if the master does not know it: the service answers that itself)."""
    kind = type(request)
    if caller.role == "client":
        if kind not in READ_ONLY:
            raise Refused(f"{caller} may only read the cluster's state, not send {kind.__name__} "
                          f"(an admin certificate may change the cluster)")
        return
    if caller.role == "admin":
        if kind not in ADMIN:
            raise Refused(f"{caller} may not send {kind.__name__} (it is a node's request)")
        return
    if caller.role != "node":
        raise Refused(f"{caller} may not send requests to the master")
    if kind in NODE_ONLY:
        raise Refused(f"{caller} may not send {kind.__name__} (it needs an admin certificate)")
    if isinstance(request, m.Register):
        check_register(caller, request)
        return
    if isinstance(request, _NODE_FIELD) and request.node != caller.node:
        raise Refused(f"{caller} may not send {kind.__name__} for node {request.node}")
    versions: list[int] = []
    if isinstance(request, (m.Seal, m.Lost)):
        versions = [request.version]
    elif isinstance(request, m.Offloaded):
        versions = request.versions
    for version in versions:
        owner = owner_of(version)
        if owner is not None and owner != caller.node:
            raise Refused(f"{caller} may not send {kind.__name__} for version {version} of node {owner}")
