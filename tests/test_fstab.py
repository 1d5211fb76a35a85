"""`mount -t fuse.kvfs` and fstab lines, through mount(8) and the mount.fuse3 helper."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvfs.errors import ConfigError
from kvfs.fstab import mount_helper_argv
from kvfs.fuse.mount import find_mount

REPO = Path(__file__).resolve().parent.parent


def test_helper_arguments_become_kvfs_commands() -> None:
    assert mount_helper_argv(["kvfs", "/mnt/kvfs", "-o", "rw,dram=16G,disk=/nvme/kvfs,_netdev,noatime,no-metrics"]) == \
        ["mount", "/mnt/kvfs", "--dram", "16G", "--disk", "/nvme/kvfs", "--no-metrics"]
    assert mount_helper_argv(["10.0.0.1:7400", "/mnt/kvfs", "-o", "dram=64G,listen=10.0.0.5:7401,x-systemd.after=x"]) == \
        ["node", "--master", "10.0.0.1:7400", "--mount", "/mnt/kvfs", "--dram", "64G", "--listen", "10.0.0.5:7401"]
    assert mount_helper_argv(["kvfs", "/m", "-oeviction_policy=lru", "-n"]) == ["mount", "/m", "--eviction-policy", "lru"]
    assert mount_helper_argv(["stauts", "--master", "x"]) is None  # a mistyped command: argparse names it
    with pytest.raises(ConfigError, match="neither 'kvfs'"):
        mount_helper_argv(["nfs-server", "/m"])
    with pytest.raises(ConfigError, match="read-write"):
        mount_helper_argv(["kvfs", "/m", "-o", "ro"])


def installed_kvfs_is_this_checkout() -> bool:
    """mount(8) runs helpers with a clean environment: the `kvfs` it finds is /usr/local/bin's."""
    result = subprocess.run(["/usr/local/bin/kvfs", "--version"], capture_output=True, text=True)
    if result.returncode != 0:
        return False
    installed = Path(os.path.realpath("/usr/local/bin/kvfs")).parent.parent
    sources = list(installed.glob("lib/python3*/site-packages/kvfs"))
    return bool(sources) and all((sources[0] / name).exists()
                                 and (sources[0] / name).read_bytes() == (REPO / "kvfs" / name).read_bytes()
                                 for name in ("fstab.py", "cli.py", "config_sources.py"))


def test_mount_fuse3_and_an_fstab_line_through_mount(tmp_path: Path) -> None:
    assert installed_kvfs_is_this_checkout(), "/usr/local/bin/kvfs is not this checkout: run scripts/install.sh"
    # mount.fuse3 runs `kvfs` from its PATH: this checkout's, when it is called directly.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "kvfs"
    wrapper.write_text(f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m kvfs "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    log = tmp_path / "kvfs.log"
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    options = f"dram=64M,log-file={log},metrics-listen=127.0.0.1:0,eviction-policy=lru,_netdev,nofail,noatime"
    fstab = tmp_path / "fstab"
    fstab.write_text(f"kvfs {mountpoint} fuse.kvfs {options} 0 0\n")
    for command in (["mount.fuse3", "kvfs", str(mountpoint), "-t", "fuse.kvfs", "-o", options],
                    ["mount", "-T", str(fstab), str(mountpoint)]):
        started = len(log.read_text()) if log.exists() else 0
        # From a directory without a "kvfs" entry: mount(8) would take the source for that path.
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
        try:
            assert result.returncode == 0, result.stderr
            info = find_mount(str(mountpoint))
            assert info is not None and info.fstype == "fuse.kvfs"
            (mountpoint / "block.bin").write_bytes(b"kv" * 4096)
            assert (mountpoint / "block.bin").read_bytes() == b"kv" * 4096
            st = os.statvfs(mountpoint)
            assert st.f_blocks * st.f_frsize == 64 << 20  # dram=64M reached the daemon
            assert "eviction lru" in log.read_text()[started:]
        finally:
            subprocess.run(["umount", str(mountpoint)], capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while "unmounted" not in log.read_text()[started:]:  # the daemon has finished
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert find_mount(str(mountpoint)) is None
    assert " ERROR " not in log.read_text() and "Traceback" not in log.read_text()
