"""The cyclic garbage collector kept off the master's request loop.

A full pass of the collector walks every tracked object that is not frozen: 0.9 s of CPU
at 1M files, on the loop that answers every node. The master's objects (inodes, versions,
names, a registering node's reported set) hold no reference cycles, so they need no pass:
`gc.freeze()` (O(1)) moves every object alive out of the passes' reach, and what a pass
walks is what was made since. The expiry pass (every 0.25 s) freezes when either

- FREEZE_EVERY inode and version numbers were handed out since the last freeze (creates,
  rewrites, publishes, granted blocks: files written and evicted at a steady count make
  new objects all the same), or
- a full pass took SLOW_FULL_PASS_S or more since (what grew without new numbers: a
  registration's set of reported versions, outboxes, long work's copies).

The young generations are collected first (a few ms at most), so that the cycles of
requests in flight die instead of being frozen. A cycle that dies after it was frozen is
never collected (docs/cluster.md, "What this scale still costs", counts them).
"""

from __future__ import annotations

import gc
import time
from typing import Any

from kvfs.cluster.master import MetadataService

# Numbers handed out between two freezes: a full pass then walks ~10K files' objects at most,
# a few ms (about 1 µs of CPU per file's objects at 1M files).
FREEZE_EVERY = 10_000
SLOW_FULL_PASS_S = 0.005  # a full pass this long: the next expiry pass freezes


class FullPasses:
    """Times the collector's full passes (a `gc.callbacks` entry): whether one was slow
    since the last freeze."""

    def __init__(self) -> None:
        self.slow = False
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            self._started = time.thread_time()  # (CPU: a busy machine's waits are not the pass)
            return
        self.slow = self.slow or time.thread_time() - self._started >= SLOW_FULL_PASS_S


_passes: FullPasses | None = None


def full_passes() -> FullPasses:
    """The process's one watcher of full passes, installed on first use."""
    global _passes
    if _passes is None:
        _passes = FullPasses()
        gc.callbacks.append(_passes)
    return _passes


def freeze_due(made: int, frozen_at: int, slow_pass: bool) -> bool:
    """Whether the heap is frozen now: never yet (-1), FREEZE_EVERY numbers made since, or a
    full pass was slow since."""
    return frozen_at < 0 or made - frozen_at >= FREEZE_EVERY or slow_pass


def keep_heap_out_of_full_collections(service: MetadataService, frozen_at: int) -> int:
    """Freezes the heap when due (`freeze_due`); returns the numbers handed out at the last
    freeze (the next call's `frozen_at`; -1 freezes now)."""
    passes = full_passes()
    made = service.ns.next_ino + service.objects.next_version
    if not freeze_due(made, frozen_at, passes.slow):
        return frozen_at
    gc.collect(1)
    gc.freeze()
    passes.slow = False
    return made
