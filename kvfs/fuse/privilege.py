"""Who may use the mount's control attribute: a caller holding CAP_SYS_ADMIN, whatever the modes.

The kernel checks `user.*` attributes against the inode's modes, and the mount's root is
often world-writable (many inference servers, one mount): without this check any local user
could drop every DRAM copy or force a full flush. The capability is read from the caller's
/proc/PID/status (the FUSE request carries its pid); a caller that exited is refused.
"""

from __future__ import annotations

CAP_SYS_ADMIN = 21


def effective_capabilities(status_text: str) -> int:
    """The CapEff bit mask of a /proc/PID/status text (0 if absent)."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def has_cap_sys_admin(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        with open(f"/proc/{pid}/status") as status:
            return bool(effective_capabilities(status.read()) >> CAP_SYS_ADMIN & 1)
    except OSError:  # the caller is gone
        return False
