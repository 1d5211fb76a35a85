"""Authority follows identity: the rules (pure), then each attack of a key holder against a
live master, refused while the legitimate nodes and commands keep working."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time

import pytest
import trio

from conftest import Cluster, load_tls, tls_dir, wait_until
from kvfs.cluster.authority import Caller, Refused, check_register, check_request
from kvfs.cluster.namespace import ROOT_INO
from kvfs.config import split_address
from kvfs.errors import MetadataError
from kvfs.net.rpc import RemoteMaster
from kvfs.wire import messages as m

NODE_A = Caller("nodeA", "node", ("127.0.0.1", "10.0.0.5"), node=3)
OWNERS = {7: 3, 8: 4}  # version -> node storing it


def owner_of(version: int) -> int | None:
    return OWNERS.get(version)


# The rules -------------------------------------------------------------------------------


def test_a_node_registers_as_itself_at_an_address_of_its_certificate() -> None:
    check_register(NODE_A, m.Register("nodeA", "10.0.0.5:7401"))
    check_register(NODE_A, m.Register("nodeA", "127.0.0.1:0"))
    with pytest.raises(Refused, match="may not register as node 'nodeB'"):
        check_register(NODE_A, m.Register("nodeB", "10.0.0.5:7401"))
    with pytest.raises(Refused, match="advertises 10.0.0.6, which its certificate does not allow"):
        check_register(NODE_A, m.Register("nodeA", "10.0.0.6:7401"))
    with pytest.raises(Refused, match="not an IP address"):
        check_register(NODE_A, m.Register("nodeA", "evil.example:7401"))
    with pytest.raises(Refused, match="--address IP"):
        check_register(Caller("nodeA", "node"), m.Register("nodeA", "10.0.0.5:7401"))
    check_register(Caller("v6", "node", ("fd00::5",)), m.Register("v6", "[fd00::5]:7401"))


def test_a_node_acts_only_for_itself() -> None:
    for request in (m.Reclaim(4, 1 << 40), m.Create(ROOT_INO, b"x", 0o644, 0, 0, 4, True), m.OpenWrite(2, 4, False),
                    m.Restore(9, 4, m.FileRecord(b"/x", 1, 0o644, 0, 0, 0, {}), [])):
        with pytest.raises(Refused) as refused:
            check_request(NODE_A, request, owner_of)
        assert refused.value.errno == errno.EPERM and "for node 4" in str(refused.value)
    for request in (m.Seal(8, 1, 1, [1]), m.Lost(8), m.Offloaded([7, 8])):
        with pytest.raises(Refused, match="of node 4"):
            check_request(NODE_A, request, owner_of)
    for request in (m.Reclaim(3, 1 << 20), m.Seal(7, 1, 1, [1]), m.Offloaded([7]), m.Lost(99),  # 99: unknown here
                    m.Heartbeat(1, 0), m.Report([]), m.Lookup(ROOT_INO, b"x"), m.Unlink(ROOT_INO, b"x")):
        check_request(NODE_A, request, owner_of)
    with pytest.raises(Refused, match="needs an admin certificate"):
        check_request(NODE_A, m.RemoveNode("nodeB"), owner_of)
    unregistered = Caller("nodeA", "node", ("127.0.0.1",))
    with pytest.raises(Refused, match="for node 3"):  # no node id until it registers
        check_request(unregistered, m.Reclaim(3, 1), owner_of)


def test_clients_read_and_admins_may_also_remove_nodes() -> None:
    client, admin = Caller("ops", "client"), Caller("root", "admin")
    for request in (m.ClusterStatus(), m.DirUsage(files=True), m.Stats()):
        check_request(client, request, owner_of)
        check_request(admin, request, owner_of)
    check_request(admin, m.RemoveNode("nodeB"), owner_of)
    with pytest.raises(Refused, match="may only read the cluster's state, not send RemoveNode"):
        check_request(client, m.RemoveNode("nodeB"), owner_of)
    for request in (m.MkDir(ROOT_INO, b"d", 0o755, 0, 0), m.Unlink(ROOT_INO, b"x"), m.ReadDir(ROOT_INO, 0, 10),
                    m.Register("root", "127.0.0.1:1"), m.Reclaim(3, 1)):
        with pytest.raises(Refused):
            check_request(client, request, owner_of)
        with pytest.raises(Refused):
            check_request(admin, request, owner_of)
    with pytest.raises(Refused, match="may not send requests to the master"):
        check_request(Caller("master", "master"), m.Stats(), owner_of)


# The attacks, against a live master ---------------------------------------------------------


def _status(cluster: Cluster) -> dict:
    result = subprocess.run([sys.executable, "-m", "kvfs", "status", "--master", cluster.master.address, "--json"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


async def _refused(master: RemoteMaster, request: m.Request) -> str:
    with pytest.raises(MetadataError) as raised:
        await master.call(request)
    assert raised.value.errno == errno.EPERM, raised.value
    return str(raised.value)


def test_a_node_certificate_cannot_act_for_another_node(cluster: Cluster) -> None:
    """Mallory holds a valid node certificate of the cluster, for her own name: she can neither
    register as node A nor point A's address elsewhere, nor evict A's files, seal or lose
    its versions. Node A keeps every file and keeps serving."""
    a = cluster.add_node("64M", name="nodeA")
    reader = cluster.add_node("64M")
    data = b"kv" * 50_000
    (a.path / "block.bin").write_bytes(data)
    node_a = next(n for n in _status(cluster)["nodes"] if n["name"] == "nodeA")
    version = json.loads(subprocess.run([sys.executable, "-m", "kvfs", "inspect", "--json", str(a.path / "block.bin")],
                                        capture_output=True, text=True, timeout=30).stdout)["version"]
    host, port = split_address(cluster.master.address)
    mallory = load_tls("mallory")
    messages: list[str] = []

    async def attack() -> None:
        async with trio.open_nursery() as nursery:
            master = await RemoteMaster.connect(host, port, mallory, nursery)
            messages.append(await _refused(master, m.Register("nodeA", "127.0.0.1:9")))
            messages.append(await _refused(master, m.Register("mallory", "10.66.6.6:9")))
            mine = (await master.call(m.Register("mallory", "127.0.0.1:9"))).node
            await master.call(m.Report([]))
            await master.call(m.FinishRegistration())
            messages.append(await _refused(master, m.Reclaim(node_a["node"], 1 << 40)))
            messages.append(await _refused(master, m.Seal(version, 1, 1, [1])))
            messages.append(await _refused(master, m.Lost(version)))
            messages.append(await _refused(master, m.Create(ROOT_INO, b"planted", 0o644, 0, 0, node_a["node"], True)))
            assert (await master.call(m.Reclaim(mine, 1 << 40))).freed_bytes == 0  # as herself: allowed
            await master.aclose()

    trio.run(attack)
    assert "may not register as node 'nodeA'" in messages[0]
    assert "advertises 10.66.6.6, which its certificate does not allow (127.0.0.1)" in messages[1]
    assert all("node 'mallory'" in message for message in messages)
    after = next(n for n in _status(cluster)["nodes"] if n["name"] == "nodeA")
    assert after["address"] == node_a["address"] and after["live"] and after["files"] == node_a["files"]
    assert (reader.path / "block.bin").read_bytes() == data  # fetched from A, at its own address
    assert not (a.path / "planted").exists()
    log = cluster.master.log_text()
    assert log.count("refused a request from node 'mallory'") == 6


def test_a_client_certificate_is_read_only_and_an_admin_may_remove_a_node(cluster: Cluster) -> None:
    node = cluster.add_node("64M", name="doomed")
    (node.path / "f").write_bytes(b"x" * 1000)
    # The seal comes with the kernel's RELEASE, after close() returned: stopping the daemon
    # while that request is answered races the unmount (not what this test is about).
    wait_until(lambda: os.getxattr(node.path / "f", "user.kvfs.sealed") == b"yes", "f to be sealed")
    node.stop()
    client = tls_dir("viewer", "client")

    def kvfs(*args: str, tls: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvfs", *args, "--master", cluster.master.address,
                               "--tls-dir", tls], capture_output=True, text=True, timeout=60)

    status = kvfs("status", "--json", tls=client)
    assert status.returncode == 0 and "doomed" in status.stdout, status.stderr
    assert kvfs("du", "--interval", "0", tls=client).returncode == 0
    deadline = time.monotonic() + 30  # the master declares the stopped node dead within dead_after
    while next(n for n in json.loads(kvfs("status", "--json", tls=client).stdout)["nodes"]
               if n["name"] == "doomed")["live"]:
        assert time.monotonic() < deadline, "the stopped node was never declared dead"
        time.sleep(0.1)
    refused = kvfs("remove-node", "doomed", tls=client)
    assert refused.returncode == 1
    assert refused.stderr.startswith("kvfs: error: client 'viewer' may only read the cluster's state, not send "
                                     "RemoveNode (an admin certificate may change the cluster): Operation not "
                                     "permitted")
    assert "doomed" in kvfs("status", tls=client).stdout  # still there
    removed = kvfs("remove-node", "doomed", tls=tls_dir("operator", "admin"))
    assert removed.returncode == 0 and "removed node doomed" in removed.stdout, removed.stderr
    assert "doomed" not in kvfs("status", tls=client).stdout


def test_a_node_whose_certificate_does_not_allow_its_address_says_so_and_exits(cluster: Cluster) -> None:
    """Issued without --address, or advertising another: the master refuses the registration,
    and the node exits with the reason and the command that fixes it instead of retrying."""
    node = cluster.root / "unaddressed"
    result = subprocess.run([sys.executable, "-m", "kvfs", "node", "--master", cluster.master.address,
                             "--mount", str(node / "mnt"), "--dram", "64M", "--foreground",
                             "--tls-dir", tls_dir("unaddressed", "node", ())],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"kvfs: error: master {cluster.master.address} refused this node: node 'unaddressed'")
    assert "issue it again with `kvfs ca issue unaddressed --role node --address IP`" in line
    assert "refused a request from node 'unaddressed'" in cluster.master.log_text()
