"""The cluster CA: `kvfs ca init/issue`, identity bundles, and mutual TLS 1.3 built from them."""

from __future__ import annotations

import os
import ssl
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from kvfs.errors import ConfigError
from kvfs.security import ca
from kvfs.security.credentials import Credentials, Identity, identity_of_peer

REPO = Path(__file__).resolve().parent.parent


def kvfs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvfs", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


@pytest.fixture
def cluster_ca(tmp_path: Path) -> Path:
    ca.init_ca(tmp_path / "ca")
    return tmp_path / "ca"


def test_cli_creates_a_ca_and_issues_bundles_with_private_keys(tmp_path: Path) -> None:
    made = kvfs("ca", "init", "--dir", str(tmp_path / "ca"))
    assert made.returncode == 0, made.stderr
    issued = kvfs("ca", "issue", "nodeA", "--role", "node", "--address", "127.0.0.1",
                  "--ca-dir", str(tmp_path / "ca"), "--out", str(tmp_path / "nodeA"))
    assert issued.returncode == 0, issued.stderr
    assert sorted(os.listdir(tmp_path / "nodeA")) == ["ca.crt", "identity.crt", "identity.key"]
    for key in (tmp_path / "ca" / "ca.key", tmp_path / "nodeA" / "identity.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    identity = Credentials.from_directory(tmp_path / "nodeA").identity()
    assert identity == Identity("nodeA", "node", ("127.0.0.1",))
    # A second init would orphan every identity issued: refused unless forced.
    again = kvfs("ca", "init", "--dir", str(tmp_path / "ca"))
    assert again.returncode != 0 and "exists" in again.stderr
    bad_role = kvfs("ca", "issue", "x", "--role", "root", "--ca-dir", str(tmp_path / "ca"), "--out", str(tmp_path / "x"))
    assert bad_role.returncode == 2 and "invalid choice" in bad_role.stderr


@pytest.mark.parametrize("name", ["", "a/b", "x" * 256, "line\nbreak"])
def test_identity_names_the_protocol_cannot_carry_are_refused(cluster_ca: Path, tmp_path: Path, name: str) -> None:
    with pytest.raises(ConfigError):
        ca.issue(cluster_ca, name, "node", tmp_path / "out")


def test_a_key_readable_by_others_refuses_to_load(cluster_ca: Path, tmp_path: Path) -> None:
    ca.issue(cluster_ca, "nodeA", "node", tmp_path / "nodeA")
    (tmp_path / "nodeA" / "identity.key").chmod(0o644)
    with pytest.raises(ConfigError, match="wider than 0600.*chmod 600"):
        Credentials.from_directory(tmp_path / "nodeA")
    with pytest.raises(ConfigError, match="no such file"):
        Credentials.from_directory(tmp_path / "missing")


async def _handshake(server: Credentials, client: Credentials) -> dict[str, object]:
    """A real TLS handshake over a loopback TCP connection: each side's view of the other
    ("server", "client") or why that side gave up ("server error", "client error")."""
    seen: dict[str, object] = {}
    served = trio.Event()

    async def serve(stream: trio.SocketStream) -> None:
        tls = trio.SSLStream(stream, server.server_context(), server_side=True)
        try:
            await tls.do_handshake()
            assert tls.version() == "TLSv1.3"
            seen["client"] = identity_of_peer(tls.getpeercert())
            await tls.send_all(await tls.receive_some(5))
            await tls.aclose()
        except (ssl.SSLError, trio.BrokenResourceError) as error:
            seen["server error"] = error
        finally:
            served.set()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, serve, 0)
        port = listeners[0].socket.getsockname()[1]
        tls = trio.SSLStream(await trio.open_tcp_stream("127.0.0.1", port), client.client_context(),
                             server_hostname="kvfs")
        try:
            await tls.send_all(b"hello")
            if await tls.receive_some(5) == b"hello":
                seen["server"] = identity_of_peer(tls.getpeercert())
            else:  # TLS 1.3: the client may finish first; the server's refusal then closes the connection
                seen["client error"] = EOFError("the server closed the connection")
            await tls.aclose()
        except (ssl.SSLError, trio.BrokenResourceError) as error:
            seen["client error"] = error
            await tls.transport_stream.aclose()
        with trio.fail_after(10):
            await served.wait()
        nursery.cancel_scope.cancel()
    return seen


def test_mutual_tls_13_shows_each_side_the_others_identity(cluster_ca: Path, tmp_path: Path) -> None:
    ca.issue(cluster_ca, "master", "master", tmp_path / "master")
    ca.issue(cluster_ca, "nodeA", "node", tmp_path / "nodeA", ["127.0.0.1"])
    seen = trio.run(_handshake, Credentials.from_directory(tmp_path / "master"),
                    Credentials.from_directory(tmp_path / "nodeA"))
    assert seen == {"server": Identity("master", "master"), "client": Identity("nodeA", "node", ("127.0.0.1",))}


def test_a_certificate_of_another_ca_is_refused(cluster_ca: Path, tmp_path: Path) -> None:
    ca.issue(cluster_ca, "master", "master", tmp_path / "master")
    ca.init_ca(tmp_path / "rogue-ca")
    ca.issue(tmp_path / "rogue-ca", "nodeA", "node", tmp_path / "rogue")
    seen = trio.run(_handshake, Credentials.from_directory(tmp_path / "master"),
                    Credentials.from_directory(tmp_path / "rogue"))
    # Each side checks the other against its own CA: the rogue client already refuses the master.
    assert "certificate verify failed" in str(seen["client error"].__context__)
    assert "server error" in seen and "client" not in seen and "server" not in seen
    # And the master refuses a rogue client that trusts it (it has the real CA but a rogue identity).
    (tmp_path / "rogue" / "ca.crt").write_bytes((cluster_ca / "ca.crt").read_bytes())
    seen = trio.run(_handshake, Credentials.from_directory(tmp_path / "master"),
                    Credentials.from_directory(tmp_path / "rogue"))
    assert "certificate verify failed" in str(seen["server error"].__context__)
    assert "client" not in seen and "server" not in seen


def test_a_peer_certificate_without_a_kvfs_role_is_no_identity() -> None:
    with pytest.raises(ssl.SSLError, match="no kvfs identity"):
        identity_of_peer({"subject": ((("commonName", "x"),),)})
    with pytest.raises(ssl.SSLError):
        identity_of_peer(None)
