"""`mount -t fuse.kvfs SOURCE MOUNTPOINT -o OPTIONS` and /etc/fstab lines.

mount(8) hands a `fuse.kvfs` mount to mount.fuse3, which runs
`kvfs SOURCE MOUNTPOINT -o OPTIONS`; this module turns that into the command
line of `kvfs mount` (SOURCE `kvfs`: a single node) or `kvfs node` (SOURCE
`HOST:PORT`: the master's address). OPTIONS are kvfs's long options without
dashes (`dram=16G,disk=/nvme/kvfs,no-metrics`); the generic mount options that
mount(8) and systemd pass along are accepted and have no effect.

    kvfs          /mnt/kvfs  fuse.kvfs  dram=16G,disk=/nvme/kvfs              0 0
    10.0.0.1:7400 /mnt/kvfs  fuse.kvfs  dram=64G,listen=10.0.0.5:7401,_netdev 0 0
"""

from __future__ import annotations

from kvfs.errors import ConfigError

# Generic options: kvfs always mounts nodev,nosuid (FUSE does) and noatime, read-write.
IGNORED = {"defaults", "rw", "dev", "nodev", "suid", "nosuid", "exec", "noexec", "auto", "noauto", "user",
           "nouser", "users", "async", "atime", "noatime", "relatime", "strictatime", "nodiratime", "_netdev",
           "nofail", "loud", "silent"}
IGNORED_PREFIXES = ("x-", "comment=", "fsname=", "subtype=")


def mount_helper_argv(argv: list[str]) -> list[str] | None:
    """The `kvfs` command line for mount.fuse3's `SOURCE MOUNTPOINT [-o OPTIONS]`; None when
    argv is not of that form (a mistyped command, which argparse then names)."""
    positional, options = [], []
    args = iter(argv)
    for arg in args:
        if arg == "-o":
            options.extend(next(args, "").split(","))
        elif arg.startswith("-o"):
            options.extend(arg[2:].split(","))
        elif arg in ("-n", "-v", "-f", "-s"):  # mount(8)'s no-mtab, verbose, fake, sloppy
            continue
        else:
            positional.append(arg)
    if len(positional) != 2:
        return None
    source, mountpoint = positional
    if ":" in source:
        command = ["node", "--master", source, "--mount", mountpoint]
    elif source == "kvfs":
        command = ["mount", mountpoint]
    else:
        raise ConfigError(f"mount helper: source {source!r} is neither 'kvfs' (single node) nor the master's HOST:PORT")
    for option in filter(None, (o.strip() for o in options)):
        if option == "ro":
            raise ConfigError("mount option ro: kvfs mounts are read-write (consumers store blocks in them)")
        if option in IGNORED or option.startswith(IGNORED_PREFIXES):
            continue
        key, equals, value = option.partition("=")
        command += [f"--{key.replace('_', '-')}"] + ([value] if equals else [])
    return command
