#!/usr/bin/env python3
"""A Debian VM with Soft-RoCE (rdma_rxe) under qemu, for testing kvfs's RDMA transport for real
(and, booted with systemd as PID 1, kvfs's systemd units).

    python scripts/rdma_vm.py build              # once: debootstrap an image (about 2 min), cached
    python scripts/rdma_vm.py run SCRIPT [ARGS]  # boot it, run SCRIPT as root inside, power off
    python scripts/rdma_vm.py run --systemd SCRIPT  # the same, under systemd

The host kernel has no RDMA; a guest kernel can load rdma_rxe and run real RDMA
over a dummy network device. The guest sees this checkout and the host's kvfs
virtual environment (Debian's Python 3.11, the same as the guest's) read-only
under /share and /venv through 9p, and writes results to /out (a host
directory, `--out`). The image is booted with `snapshot=on`, so it stays
pristine. Emulation (TCG) is slow: correctness only, never performance.
Needs root and the packages qemu-system-x86, debootstrap, e2fsprogs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("KVFS_RDMA_VM_CACHE", "/var/cache/kvfs/rdma-vm"))
# An AVX2 server CPU without AVX-512, as many kvfs nodes have: native code that needs more dies here.
GUEST_CPU = "EPYC-Rome"
IMAGE_VERSION = "2"  # bump when the package list or the init scripts change
PACKAGES = ["linux-image-amd64", "rdma-core", "ibverbs-utils", "python3-pyverbs", "iproute2", "kmod", "procps",
            "fuse3", "python3", "attr", "systemd", "systemd-sysv", "util-linux"]
INITRAMFS_MODULES = ["virtio_pci", "virtio_blk", "ext4"]

# The guest's PID 1: mounts what a test needs, runs the host's script, powers off.
GUEST_INIT = """#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm /tmp /run && mount -t devpts devpts /dev/pts && mount -t tmpfs tmpfs /tmp
mount -t tmpfs tmpfs /run && mount -t tmpfs tmpfs /dev/shm
modprobe virtio_net; modprobe 9p; modprobe 9pnet_virtio; modprobe fuse
mkdir -p /share /venv /out
mount -t 9p -o trans=virtio,version=9p2000.L,ro host0 /share
mount -t 9p -o trans=virtio,version=9p2000.L,ro venv0 /venv
mount -t 9p -o trans=virtio,version=9p2000.L out0 /out
ip link set lo up
hostname kvfs-rdma-vm
cd /share
sh /out/guest.sh > /out/guest.log 2>&1
echo "exit=$?" >> /out/guest.log
sync
echo o > /proc/sysrq-trigger
sleep 10
"""


# Under systemd the same steps run as a service, which powers the VM off when done.
SYSTEMD_TEST_UNIT = """[Unit]
Description=kvfs test run
After=local-fs.target systemd-journald.service
[Service]
Type=oneshot
ExecStart=/kvfs-systemd-test
StandardOutput=journal+console
[Install]
WantedBy=multi-user.target
"""
SYSTEMD_TEST_SCRIPT = """#!/bin/sh
modprobe 9p; modprobe 9pnet_virtio; modprobe fuse
mkdir -p /share /venv /out
mount -t 9p -o trans=virtio,version=9p2000.L,ro host0 /share
mount -t 9p -o trans=virtio,version=9p2000.L,ro venv0 /venv
mount -t 9p -o trans=virtio,version=9p2000.L out0 /out
cd /share
sh /out/guest.sh > /out/guest.log 2>&1
echo "exit=$?" >> /out/guest.log
sync
systemctl poweroff --no-block
"""


def mirror() -> str:
    """The Debian mirror apt already uses (the image must come from where packages work)."""
    for sources in Path("/etc/apt/sources.list.d").glob("*.sources"):
        for line in sources.read_text().splitlines():
            if line.startswith("URIs:") and "security" not in line:
                return line.split()[1]
    return "http://deb.debian.org/debian"


def image_paths() -> dict[str, Path]:
    base = CACHE / f"v{IMAGE_VERSION}"
    return {"dir": base, "image": base / "root.img", "kernel": base / "vmlinuz", "initrd": base / "initrd.img"}


def build(force: bool = False) -> dict[str, Path]:
    paths = image_paths()
    if paths["image"].exists() and not force:
        return paths
    started = time.monotonic()
    paths["dir"].mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=paths["dir"]) as work:
        root = Path(work) / "root"
        print(f"rdma-vm: debootstrap bookworm from {mirror()} (about 3 minutes)", file=sys.stderr, flush=True)
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", "bookworm", str(root),
                        mirror()], check=True, stdout=subprocess.DEVNULL)
        (root / "etc/initramfs-tools/modules").write_text("\n".join(INITRAMFS_MODULES) + "\n")
        conf = root / "etc/initramfs-tools/initramfs.conf"
        conf.write_text(conf.read_text().replace("MODULES=most", "MODULES=list"))
        print("rdma-vm: initramfs", file=sys.stderr, flush=True)
        subprocess.run(["chroot", str(root), "update-initramfs", "-u", "-k", "all"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name, text in (("kvfs-init", GUEST_INIT), ("kvfs-systemd-test", SYSTEMD_TEST_SCRIPT)):
            (root / name).write_text(text)
            (root / name).chmod(0o755)
        (root / "etc/systemd/system/kvfs-test-run.service").write_text(SYSTEMD_TEST_UNIT)
        (root / "etc/systemd/system/multi-user.target.wants").mkdir(parents=True, exist_ok=True)
        (root / "etc/systemd/system/multi-user.target.wants/kvfs-test-run.service").symlink_to(
            "/etc/systemd/system/kvfs-test-run.service")
        (root / "etc/hostname").write_text("kvfs-vm\n")
        (root / "etc/machine-id").write_text("")  # systemd makes one at boot
        shutil.copy(sorted((root / "boot").glob("vmlinuz-*"))[-1], paths["kernel"])
        shutil.copy(sorted((root / "boot").glob("initrd.img-*"))[-1], paths["initrd"])
        print("rdma-vm: filesystem image", file=sys.stderr, flush=True)
        partial = paths["image"].with_suffix(".partial")
        subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(root), str(partial), "1500M"], check=True)
        partial.rename(paths["image"])
    print(f"rdma-vm: built {paths['image']} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return paths


def run(script: Path, out: Path, args: list[str], timeout_s: float, memory_mb: int = 3072,
        systemd: bool = False) -> int:
    """Boots the image, runs `script ARGS` inside (as /out/guest.sh), returns its exit status;
    with `systemd`, under systemd as PID 1 (the script runs as a service)."""
    paths = build()
    out.mkdir(parents=True, exist_ok=True)
    guest = out / "guest.sh"
    quoted = " ".join("'" + arg.replace("'", "'\\''") + "'" for arg in args)
    guest.write_text(f"#!/bin/sh\nexec sh /share/{script.resolve().relative_to(REPO)} {quoted}\n")
    for stale in ("guest.log", "console.log"):
        (out / stale).unlink(missing_ok=True)
    venv = Path(os.environ.get("KVFS_PREFIX", "/opt/kvfs"))
    site = next((venv / "lib").glob("python3*/site-packages"))
    command = [
        "qemu-system-x86_64", "-accel", "tcg", "-cpu", GUEST_CPU, "-m", str(memory_mb), "-smp", "2", "-nographic", "-no-reboot",
        "-kernel", str(paths["kernel"]), "-initrd", str(paths["initrd"]),
        "-append", "root=/dev/vda rw console=ttyS0 panic=-1 quiet "
                   + ("init=/lib/systemd/systemd systemd.show_status=0" if systemd else "init=/kvfs-init"),
        "-drive", f"file={paths['image']},format=raw,if=virtio,snapshot=on",
        "-virtfs", f"local,path={REPO},mount_tag=host0,security_model=none,readonly=on",
        "-virtfs", f"local,path={site},mount_tag=venv0,security_model=none,readonly=on",
        "-virtfs", f"local,path={out},mount_tag=out0,security_model=none",
    ]
    started = time.monotonic()
    with open(out / "console.log", "wb") as console:
        try:
            subprocess.run(command, stdout=console, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                           timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            print(f"rdma-vm: the VM did not finish within {timeout_s:.0f} s", file=sys.stderr)
            return 124
    log = (out / "guest.log").read_text(errors="replace") if (out / "guest.log").exists() else ""
    status = next((line.split("=", 1)[1] for line in reversed(log.splitlines()) if line.startswith("exit=")), "")
    print(f"rdma-vm: ran {script.name} in {time.monotonic() - started:.0f} s (boot included), exit {status or '?'}",
          file=sys.stderr)
    return int(status) if status.isdigit() else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build_command = commands.add_parser("build", help="build the cached image")
    build_command.add_argument("--force", action="store_true", help="build again even if cached")
    run_command = commands.add_parser("run", help="boot the image and run a script of this checkout inside")
    run_command.add_argument("script", type=Path)
    run_command.add_argument("args", nargs="*")
    run_command.add_argument("--out", type=Path, default=Path("/tmp/kvfs-rdma-vm-out"))
    run_command.add_argument("--timeout", type=float, default=900)
    run_command.add_argument("--systemd", action="store_true", help="boot with systemd as PID 1")
    args = parser.parse_args()
    if os.getuid() != 0:
        print("rdma_vm.py: run as root (debootstrap, chroot, qemu with 9p)", file=sys.stderr)
        return 1
    if args.command == "build":
        build(args.force)
        return 0
    return run(args.script, args.out, args.args, args.timeout, systemd=args.systemd)


if __name__ == "__main__":
    sys.exit(main())
