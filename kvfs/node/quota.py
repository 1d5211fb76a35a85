"""Per-user bytes of files being written (unsealed): a cap so that no user pins the DRAM tier.

An unsealed file cannot be evicted or offloaded: a user who writes many files and keeps them
open holds their bytes in DRAM for as long as they like, and everyone else's files are evicted
to make room (then root gets ENOSPC). Each user's unsealed bytes are therefore capped; a write
past the cap fails with EDQUOT, which names the cause, while other users go on. Root (uid 0) is
not capped: it already controls the machine.

Pure bookkeeping: the file service charges growth before it writes and credits a file's bytes
when it seals, shrinks or abandons it.
"""

from __future__ import annotations

import errno

from kvfs.config import format_size
from kvfs.errors import StorageError

ROOT_UID = 0


class UnsealedBytes:
    def __init__(self, limit: int) -> None:
        self.limit = limit  # bytes per uid; 0: no cap
        self.by_uid: dict[int, int] = {}
        self.refusals = 0

    def charge(self, uid: int, nbytes: int, what: str, capped: bool = True) -> None:
        """Counts `nbytes` more for `uid`, or raises EDQUOT (nothing counted) past the cap."""
        if nbytes <= 0:
            return
        held = self.by_uid.get(uid, 0)
        if capped and self.limit and uid != ROOT_UID and held + nbytes > self.limit:
            self.refusals += 1
            raise StorageError(errno.EDQUOT, f"{what}: uid {uid} already has {format_size(held)} in files open for "
                                             f"writing, the cap per user is {format_size(self.limit)} "
                                             f"(close or finish files first)")
        self.by_uid[uid] = held + nbytes

    def credit(self, uid: int, nbytes: int) -> None:
        held = self.by_uid.get(uid, 0) - nbytes
        if held > 0:
            self.by_uid[uid] = held
        else:
            self.by_uid.pop(uid, None)
