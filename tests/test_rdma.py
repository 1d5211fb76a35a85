"""The RDMA transport: its choice on this host (no RDMA here), the protocol a node without RDMA
speaks, and the real thing in a soft-RoCE VM (`-m rdma`)."""

from __future__ import annotations

import errno
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from conftest import Cluster, load_tls, tls_dir
from kvfs.wire.protocol import ErrorReply, FrameKind, HeaderDecoder
from kvfs.wire.rdma_messages import Locate, RdmaConnect
from kvfs.net.handshake import connect
from kvfs.config import split_address

REPO = Path(__file__).resolve().parent.parent


def test_auto_uses_tcp_here_and_says_why(cluster: Cluster) -> None:
    writer, reader = cluster.add_node("64M"), cluster.add_node("64M", "--transport", "auto")
    (writer.path / "f").write_bytes(b"x" * 100_000)
    assert (reader.path / "f").read_bytes() == b"x" * 100_000
    line = next(line for line in reader.log_text().splitlines() if "transport auto" in line)
    assert "using TCP, RDMA is unavailable here (" in line, line


def test_rdma_without_rdma_fails_at_start_with_the_reason(cluster: Cluster, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "kvfs", "node", "--master", cluster.master.address, "--mount",
                             str(tmp_path / "mnt"), "--transport", "rdma", "--foreground", "--dram", "64M",
                             "--tls-dir", tls_dir("rdma-less")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "transport rdma: RDMA is unavailable here" in result.stderr and "Traceback" not in result.stderr


def test_a_node_without_rdma_answers_the_rdma_handshake_with_enotsup(cluster: Cluster) -> None:
    node = cluster.add_node("64M", "--transport", "tcp")
    status = subprocess.run([sys.executable, "-m", "kvfs", "status", "--master", cluster.master.address, "--json"],
                            capture_output=True, text=True, timeout=30)
    address = next(n["address"] for n in json.loads(status.stdout)["nodes"] if n["live"])
    errors = HeaderDecoder(ErrorReply)

    async def ask() -> list[tuple[FrameKind, int]]:
        host, port = split_address(address)
        frames = await connect(host, port, load_tls("asker"), "node")
        answers = []
        for request_id, request in ((1, RdmaConnect(1, 2, "fe80::1")), (2, Locate(1, 0, 1))):
            await frames.send(FrameKind.REQUEST, request_id, request)
            frame = await frames.receive()
            answers.append((frame.prefix.kind, errors.decode(frame.header).errno))
        await frames.aclose()
        return answers

    assert trio.run(ask) == [(FrameKind.ERROR, errno.ENOTSUP), (FrameKind.ERROR, errno.ENOTSUP)]
    assert "transport tcp: chunks move over TCP" in node.log_text()


@pytest.mark.vm
@pytest.mark.rdma
def test_rdma_transport_in_a_soft_roce_vm(tmp_path: Path) -> None:
    """Boots the cached VM (built on first use), runs tests/rdma/vm_checks.py inside: master and
    nodes with transport rdma/auto through FUSE mounts, concurrent READs, a revoked rkey with
    its fallback, a version only on SSD, a peer killed mid-transfer."""
    out = tmp_path / "vm"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "rdma_vm.py"), "run", "tests/rdma/guest.sh",
                             "/share/tests/rdma/vm_checks.py", "--out", str(out), "--timeout", "900"],
                            capture_output=True, text=True, timeout=1800)
    log = (out / "guest.log").read_text(errors="replace") if (out / "guest.log").exists() else ""
    summary = re.search(r"RDMA-VM-SUMMARY passed=(\d+) failed=(\d+) checks=(\d+)", log)
    assert summary, f"no summary from the VM:\n{result.stderr[-2000:]}\n{log[-4000:]}"
    passed, failed, checks = map(int, summary.groups())
    assert failed == 0 and passed == checks == 7, log[-6000:]
    assert result.returncode == 0, result.stderr[-2000:]
