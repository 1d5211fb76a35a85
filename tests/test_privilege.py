"""The control attribute needs CAP_SYS_ADMIN, whatever the root's modes: any local user may
store and read blocks on a shared mount, only an administrator may drop or flush its tiers."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from kvfs.fuse.privilege import CAP_SYS_ADMIN, effective_capabilities, has_cap_sys_admin


def set_xattr(path: Path, name: str, value: str, *setpriv: str) -> subprocess.CompletedProcess[str]:
    """fsetxattr on a descriptor opened here and inherited by a child run through setpriv (the
    test's temporary directories are not searchable by other users, the mount itself is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        code = f"import os; os.setxattr({fd}, {name!r}, {value.encode()!r})"
        return subprocess.run(["setpriv", *setpriv, "/usr/bin/python3", "-c", code] if setpriv
                              else ["/usr/bin/python3", "-c", code], capture_output=True, text=True, timeout=30,
                              pass_fds=(fd,))
    finally:
        os.close(fd)


def set_control(mountpoint: Path, value: str, *setpriv: str) -> subprocess.CompletedProcess[str]:
    return set_xattr(mountpoint, "user.kvfs.control", value, *setpriv)


def test_control_is_refused_to_callers_without_cap_sys_admin(make_mount) -> None:
    mount = make_mount("64M")
    os.chmod(mount.path, 0o777)  # a shared mount: every user may write here
    (mount.path / "block.bin").write_bytes(b"k" * 8192)
    nobody = set_control(mount.path, "drop-dram", "--reuid=65534", "--regid=65534", "--clear-groups")
    assert nobody.returncode != 0 and "PermissionError: [Errno 1]" in nobody.stderr, nobody
    # Root itself, once it gave the capability up, is refused too: the check is the capability.
    capless_root = set_control(mount.path, "drop-dram", "--inh-caps=-sys_admin", "--bounding-set=-sys_admin")
    assert capless_root.returncode != 0 and "PermissionError: [Errno 1]" in capless_root.stderr, capless_root
    # Ordinary attributes follow the modes, as before: a user may set them on the shared root.
    note = set_xattr(mount.path, "user.note", "x", "--reuid=65534", "--regid=65534", "--clear-groups")
    assert note.returncode == 0, note.stderr
    admin = set_control(mount.path, "drop-dram")
    assert admin.returncode == 0, admin.stderr
    assert (mount.path / "block.bin").read_bytes() == b"k" * 8192


def test_the_capability_is_read_from_the_callers_status() -> None:
    assert effective_capabilities("Name:\tx\nCapEff:\t000001ffffffffff\n") >> CAP_SYS_ADMIN & 1
    assert not effective_capabilities("CapEff:\t0000000000000000\n")
    assert effective_capabilities("Name:\tx\n") == 0
    assert has_cap_sys_admin(os.getpid())  # the suite runs as root
    assert not has_cap_sys_admin(0) and not has_cap_sys_admin(2**22 + 7)  # no such process
