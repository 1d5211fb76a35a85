"""Network namespaces for partition tests: nodes with addresses of their own on one bridge.

The test's root namespace holds a bridge with the first address of a private /24 (the master
listens there); each `Host` is a network namespace with a veth on that bridge and an address
of its own. A process joins a host with `host.prefix` (`nsenter --net`: only the network
namespace changes, so its FUSE mount is visible to the test). `host.cut()` drops every packet
on the host's link in both directions, silently (no reset, no unreachable), as a pulled cable
or a dead switch port does; `host.heal()` lets them through again.

Needs root, iproute2 and iptables (scripts/install.sh --test installs them).
"""

from __future__ import annotations

import os
import secrets
import subprocess
from pathlib import Path


def _run(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {done.stderr.strip()}")


class Host:
    def __init__(self, network: Network, index: int) -> None:
        self.name = f"{network.name}-h{index}"
        self.link = f"{network.name}h{index}"  # the bridge side; the namespace side is "eth0"
        self.address = f"{network.prefix}.{index + 1}"
        _run("ip", "netns", "add", self.name)
        _run("ip", "link", "add", self.link, "type", "veth", "peer", "name", "eth0", "netns", self.name)
        _run("ip", "link", "set", self.link, "master", network.bridge, "up")
        _run("ip", "-n", self.name, "addr", "add", f"{self.address}/24", "dev", "eth0")
        _run("ip", "-n", self.name, "link", "set", "eth0", "up")
        _run("ip", "-n", self.name, "link", "set", "lo", "up")
        self.prefix = ["nsenter", f"--net={Path('/run/netns') / self.name}"]
        self.is_cut = False

    def _iptables(self, action: str) -> None:
        for chain, direction in (("INPUT", "-i"), ("OUTPUT", "-o")):
            _run("ip", "netns", "exec", self.name, "iptables", action, chain, direction, "eth0", "-j", "DROP")

    def cut(self) -> None:
        if not self.is_cut:
            self._iptables("-I")
            self.is_cut = True

    def heal(self) -> None:
        if self.is_cut:
            self._iptables("-D")
            self.is_cut = False

    def close(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)  # takes the veth


class Network:
    """A bridge in the root namespace (address `.1`, where the master listens) and hosts on it."""

    def __init__(self) -> None:
        self.name = f"kv{secrets.token_hex(3)}"
        self.bridge = f"{self.name}br"
        # 10.200-249.x.0/24: private, and unlikely to be a route of the machine running the tests.
        self.prefix = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(256)}"
        self.address = f"{self.prefix}.1"
        self.hosts: list[Host] = []
        # A bridge takes the lowest MAC address of its ports unless given one: a host added later
        # with a lower one would change the master's MAC under the hosts' ARP caches, and cut
        # them off for seconds. A fixed, locally administered address of its own.
        mac = "02:" + ":".join(f"{byte:02x}" for byte in secrets.token_bytes(5))
        _run("ip", "link", "add", self.bridge, "address", mac, "type", "bridge")
        _run("ip", "addr", "add", f"{self.address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")

    def add_host(self) -> Host:
        host = Host(self, len(self.hosts) + 1)
        self.hosts.append(host)
        return host

    def close(self) -> None:
        for host in self.hosts:
            host.close()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


def available() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if os.geteuid() != 0:
        return "needs root"
    for tool in ("ip", "iptables", "nsenter"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            return f"{tool} is not installed (scripts/install.sh --test)"
    return None
