"""The command line and the mount lifecycle: background mount, umount, signals, stale mounts."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfs import __version__
from kvfs.fuse.mount import find_mount

KVFS = [sys.executable, "-m", "kvfs"]


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*KVFS, *args], capture_output=True, text=True, timeout=timeout)


def test_version() -> None:
    result = run("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"kvfs {__version__}"


def test_background_mount_and_umount(tmp_path: Path) -> None:
    mountpoint, log = tmp_path / "mnt", tmp_path / "kvfs.log"
    result = run("mount", str(mountpoint), "--dram", "64M", "--log-file", str(log))
    try:
        assert result.returncode == 0, result.stderr
        assert f"kvfs mounted on {mountpoint}" in result.stdout
        info = find_mount(str(mountpoint))
        assert info is not None and info.fstype == "fuse.kvfs"
        (mountpoint / "f").write_bytes(b"hello")
        assert (mountpoint / "f").read_bytes() == b"hello"
        assert os.statvfs(mountpoint).f_blocks * 4096 == 64 << 20
        again = run("mount", str(mountpoint), "--dram", "64M", "--log-file", str(tmp_path / "second.log"))
        assert again.returncode == 1 and "already mounted" in again.stderr
    finally:
        unmounted = run("umount", str(mountpoint))
    assert unmounted.returncode == 0, unmounted.stderr
    assert find_mount(str(mountpoint)) is None
    deadline = time.monotonic() + 30
    while "unmounted" not in log.read_text():  # the daemon finishes after the mount is gone
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    assert "is ready" in log.read_text()
    assert re.search(r"faulted in the 64\.0 MiB DRAM tier in \d+\.\d s", log.read_text())


def test_sigint_unmounts_cleanly(make_mount) -> None:
    mount = make_mount("64M")
    (mount.path / "f").write_bytes(b"x")
    mount.process.send_signal(signal.SIGINT)
    assert mount.process.wait(timeout=30) == 0
    assert find_mount(str(mount.path)) is None
    assert "received SIGINT, unmounting" in mount.log_text()


def test_stale_mount_is_cleaned_on_next_mount(make_mount) -> None:
    mount = make_mount("64M")
    mount.kill()
    with pytest.raises(OSError) as raised:
        os.statvfs(mount.path)
    assert raised.value.errno == errno.ENOTCONN
    mount.start()  # the same mount point again
    assert "stale mount" in mount.log_text()
    (mount.path / "g").write_bytes(b"fresh")
    assert os.listdir(mount.path) == ["g"]


def test_invalid_arguments_give_clear_errors(tmp_path: Path) -> None:
    result = run("mount", str(tmp_path / "m"), "--dram", "lots", "-f")
    assert result.returncode == 1 and "--dram: cannot parse size 'lots'" in result.stderr
    result = run("mount", str(tmp_path / "m"), "--dram", "1M", "-f")
    assert result.returncode == 1 and "below the 16 MiB minimum" in result.stderr
    result = run("umount", str(tmp_path))
    assert result.returncode == 1 and "is not a kvfs mount" in result.stderr
    (tmp_path / "file").write_bytes(b"")
    result = run("mount", str(tmp_path / "file"), "--dram", "64M", "--log-file", str(tmp_path / "l.log"))
    assert result.returncode == 1 and "not a directory" in result.stderr


def test_logs_to_journald_carry_priorities_and_no_timestamps() -> None:
    read_end, write_end = os.pipe()
    st = os.fstat(write_end)
    try:
        result = subprocess.run([*KVFS, "status"], stderr=write_end, stdout=subprocess.DEVNULL, timeout=60,
                                env={**os.environ, "JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
    finally:
        os.close(write_end)
    with os.fdopen(read_end) as output:
        lines = output.read().splitlines()
    assert result.returncode == 1
    assert lines == ["<3>kvfs: error: name a mount (kvfs status /mnt/kvfs) or the master (--master HOST:PORT)"]
    plain = run("status")  # not journald: the error alone
    assert plain.stderr == "kvfs: error: name a mount (kvfs status /mnt/kvfs) or the master (--master HOST:PORT)\n"


def test_settings_from_file_environment_and_flags(tmp_path: Path) -> None:
    from kvfs.cli import build_parser
    from kvfs.config_sources import parse_with_sources
    from kvfs.errors import ConfigError

    config = tmp_path / "kvfs.toml"
    config.write_text('[node]\nmaster = "10.0.0.1:7400"\ndram = "1G"\nmetrics = false\neviction-policy = "lru"\n'
                      'entry_timeout = 5\n')
    parse = lambda argv, **env: parse_with_sources(build_parser(), argv, {"KVFS_CONFIG": str(config), **env})
    args = parse(["node", "--mount", "/m"])
    assert (args.master, args.dram, args.metrics, args.eviction_policy, args.entry_timeout) == \
        ("10.0.0.1:7400", "1G", False, "lru", 5.0)
    args = parse(["node", "--mount", "/m"], KVFS_DRAM="2G", KVFS_METRICS="yes", KVFS_ENTRY_TIMEOUT="7.5")
    assert (args.dram, args.metrics, args.entry_timeout) == ("2G", True, 7.5)  # the environment beats the file
    assert parse(["node", "--mount", "/m", "--dram", "3G"], KVFS_DRAM="2G").dram == "3G"  # flags beat both
    # The identity bundle's directory, like any setting: default, file, environment, flag.
    assert parse(["status"]).tls_dir == "/etc/kvfs/tls"
    config.write_text('[status]\ntls_dir = "/etc/kvfs/ops"\n')
    assert parse(["status"]).tls_dir == "/etc/kvfs/ops"
    assert parse(["status"], KVFS_TLS_DIR="/run/tls").tls_dir == "/run/tls"
    assert parse(["status", "--tls-dir", "/x"], KVFS_TLS_DIR="/run/tls").tls_dir == "/x"
    config.write_text('[node]\nmaster = "10.0.0.1:7400"\ndram = "1G"\nmetrics = false\neviction-policy = "lru"\n'
                      'entry_timeout = 5\n')
    for env, message in ((dict(KVFS_EVICTION_POLICY="fifo"), "KVFS_EVICTION_POLICY: 'fifo' is not one of lru, reuse"),
                         (dict(KVFS_ENTRY_TIMEOUT="soon"), "KVFS_ENTRY_TIMEOUT: 'soon' is not valid"),
                         (dict(KVFS_METRICS="maybe"), "KVFS_METRICS: 'maybe' is not true or false")):
        with pytest.raises(ConfigError, match=message):
            parse(["node", "--mount", "/m"], **env)
    config.write_text('[node]\ndram = ["1G"]\n')
    with pytest.raises(ConfigError, match=r"\[node\] dram: \['1G'\] is not a single value"):
        parse(["node", "--mount", "/m", "--master", "h:1"])
    with pytest.raises(ConfigError, match="does not exist"):
        parse_with_sources(build_parser(), ["mount", "/m"], {"KVFS_CONFIG": str(tmp_path / "missing.toml")})
    # Without --config or KVFS_CONFIG, a missing /etc/kvfs/kvfs.toml is fine.
    if not Path("/etc/kvfs/kvfs.toml").exists():
        assert parse_with_sources(build_parser(), ["mount", "/m"], {}).dram is None


def test_the_example_configuration_lists_real_settings_with_their_defaults(tmp_path: Path) -> None:
    """Uncommented, scripts/kvfs.toml.example parses; values not marked as examples are the defaults."""
    import re
    import tomllib

    from kvfs.cli import build_parser
    from kvfs.config_sources import parse_with_sources

    text = (Path(__file__).resolve().parent.parent / "scripts" / "kvfs.toml.example").read_text()
    setting = re.compile(r'^# (\w+) = ("[^"]*"|\S+)(.*)$')
    uncommented, defaults = [], {}
    table = ""
    for line in text.splitlines():
        found = setting.match(line)
        if line.startswith("["):
            table = line.split("]")[0][1:]
        if found:
            uncommented.append(f"{found.group(1)} = {found.group(2)}")
            if "default" not in found.group(3):
                defaults[(table, found.group(1))] = tomllib.loads(f"v = {found.group(2)}")["v"]
        else:
            uncommented.append(line)
    path = tmp_path / "example.toml"
    path.write_text("\n".join(uncommented))
    positional = {"master": [], "node": ["--mount", "/m", "--master", "h:1"], "mount": ["/m"]}
    for command, extra in positional.items():
        parse_with_sources(build_parser(), [command, "--config", str(path), *extra], {})  # every key is a setting
        built_in = parse_with_sources(build_parser(), [command, *extra], {"KVFS_CONFIG": os.devnull})
        for (section, key), value in defaults.items():
            if section == command:
                assert getattr(built_in, key) == value, f"[{command}] {key}: the example says {value!r}"
    assert len(defaults) > 20
