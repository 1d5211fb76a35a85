"""A node cut off by a silent partition (its network namespace drops every packet, as a pulled
cable does): its own operations fail within --master-wait and never hang, the other nodes keep
working, and after the heal the cluster converges with no file lost and none owned twice.

Every operation on a mount runs in a child process under a hard timeout (tests/bounded.py),
and the fixture heals the link before it stops the daemons, so a failure cannot wedge the
machine in a FUSE wait.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time

import bounded
from conftest import Cluster, KvfsMount
from conftest import wait_until as _wait_until

MASTER_WAIT_S = 3.0  # the nodes' --master-wait
MARGIN_S = 2.0  # a child's start and a loaded machine, on top of the bound
HUNG_S = 20.0  # a child still waiting this long is reported hung (and the test stops there)
FILES = 8  # per node before the cut, DRAM only (no --disk): what a wrong judgement would lose
SETTLE_S = 30.0
wait_until = functools.partial(_wait_until, timeout=SETTLE_S)


def content(writer: str, i: int) -> bytes:
    return f"{writer} block {i};".encode() * (500 + 97 * i)


def cluster_status(cluster: Cluster) -> dict:
    done = subprocess.run([sys.executable, "-m", "kvfs", "status", "--master", cluster.master.address, "--json"],
                          capture_output=True, text=True, timeout=30)  # the admin bundle: KVFS_TLS_DIR
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def live(cluster: Cluster) -> dict[str, bool]:
    return {node["name"]: node["live"] for node in cluster_status(cluster)["nodes"]}



def wait_readable(nodes: list[KvfsMount], expected: dict[str, bytes], what: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while (bad := unreadable(nodes, expected)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not bad, f"{what}: {len(bad)} reads still fail after {SETTLE_S:.0f} s: {bad[:12]}"


def unreadable(nodes: list[KvfsMount], expected: dict[str, bytes]) -> list[str]:
    """node:file (why) for each expected file a node cannot read with the right bytes."""
    bad = []
    for node in nodes:
        for name, data in expected.items():
            try:
                if (node.path / "blocks" / name).read_bytes() != data:
                    bad.append(f"{node.root.name}:{name} (wrong bytes)")
            except OSError as error:
                bad.append(f"{node.root.name}:{name} ({os.strerror(error.errno or 0)})")
    return bad


def test_a_cut_off_node_fails_within_the_master_wait_and_the_cluster_converges_after_the_heal(
        netns_cluster: Cluster) -> None:
    cluster = netns_cluster
    a, b, c = (cluster.add_node("128M", "--master-wait", f"{MASTER_WAIT_S:g}", name=name) for name in "abc")
    nodes = [a, b, c]
    (a.path / "blocks").mkdir()
    expected: dict[str, bytes] = {}
    owner: dict[str, str] = {}
    for node in nodes:
        for i in range(FILES):
            name = f"{node.root.name}-{i}.bin"
            expected[name] = content(node.root.name, i)
            owner[name] = node.root.name
            (node.path / "blocks" / name).write_bytes(expected[name])
    for name in ("shared.bin", "shared2.bin"):  # names of c's that a takes over during the cut
        expected[name], owner[name] = content("c", 99), "c"
        (c.path / "blocks" / name).write_bytes(expected[name])
    wait_readable(nodes, expected, "before the cut")

    cluster.hosts["c"].cut()
    # The cut-off node's own operations: the first waits out --master-wait on a connection that
    # went silent (and gives it up); the others fail at once, the master unheard for that long.
    on_c: list[bounded.Outcome] = []
    for operation, path in [("mkdir", c.path / "made-during-the-cut"),
                            ("create", c.path / "blocks" / "c-new.bin"),
                            ("overwrite", c.path / "blocks" / "c-0.bin"),
                            ("read", c.path / "blocks" / "a-1.bin"),
                            ("read", c.path / "blocks" / "c-1.bin"),
                            ("stat", c.path / "blocks" / "absent.bin"),
                            ("listdir", c.path / "blocks")]:
        on_c.append(bounded.run(operation, path, HUNG_S))
        assert on_c[-1].result != "hung", f"an operation on the cut-off node hung: {list(map(str, on_c))}"
    print("\non the cut-off node:\n  " + "\n  ".join(map(str, on_c)))
    slow = [str(outcome) for outcome in on_c if outcome.seconds > MASTER_WAIT_S + MARGIN_S]
    assert not slow, f"operations on the cut-off node took longer than --master-wait ({MASTER_WAIT_S:g} s): {slow}"
    made = [str(outcome) for outcome in on_c if outcome.operation in ("mkdir", "create", "overwrite")
            and outcome.result != "EIO"]
    assert not made, f"changes on the cut-off node did not fail with EIO: {made}"

    # The others keep working, and learn that c is gone (its files hidden, not forgotten).
    wait_until(lambda: live(cluster).get("c") is False, "the master to declare the cut-off node dead", timeout=15)
    on_others = []
    for node, other in ((a, b), (b, a)):
        name = f"{node.root.name}-during.bin"
        on_others += [bounded.run("create", node.path / "blocks" / name, HUNG_S),
                      bounded.run("read", node.path / "blocks" / f"{other.root.name}-2.bin", HUNG_S),
                      bounded.run("mkdir", node.path / f"{node.root.name}-dir", HUNG_S)]
        expected[name], owner[name] = b"x" * 4096, node.root.name
    on_others.append(bounded.run("publish", a.path / "blocks" / "shared.bin", HUNG_S))  # over c's names
    on_others.append(bounded.run("overwrite", a.path / "blocks" / "shared2.bin", HUNG_S))
    expected["shared.bin"], owner["shared.bin"] = b"z" * 4096, "a"
    expected["shared2.bin"], owner["shared2.bin"] = b"y" * 4096, "a"
    print("on the other nodes:\n  " + "\n  ".join(map(str, on_others)))
    failed = [str(outcome) for outcome in on_others
              if outcome.result != "ok" or outcome.seconds > MASTER_WAIT_S + MARGIN_S]
    assert not failed, f"the other nodes did not keep working: {failed}"

    cluster.hosts["c"].heal()
    healed = time.monotonic()
    back = wait_until(lambda: live(cluster).get("c") is True, "the cut-off node to register again")
    wait_readable(nodes, expected, "after the heal")
    print(f"after the heal: c registered again in {back:.1f} s, every file readable everywhere "
          f"{time.monotonic() - healed:.1f} s after it")
    assert "files kept" in c.log_text()
    (c.path / "blocks" / "c-after.bin").write_bytes(b"after the heal")  # c writes again, and a reads it
    expected["c-after.bin"], owner["c-after.bin"] = b"after the heal", "c"
    wait_readable([a], {"c-after.bin": b"after the heal"}, "c's new file on a")

    # No file lost, none made by the failed operations, none owned twice.
    for node in nodes:
        assert sorted(os.listdir(node.path / "blocks")) == sorted(expected), node.root.name
        assert not (node.path / "made-during-the-cut").exists()
    owners = {name: os.getxattr(a.path / "blocks" / name, "user.kvfs.node_name").decode() for name in expected}
    assert owners == owner
    status = cluster_status(cluster)
    held = {node["name"]: node["files"] for node in status["nodes"]}
    assert held == {name: sorted(owner.values()).count(name) for name in "abc"}, held
    assert status["files"] == len(expected), status
