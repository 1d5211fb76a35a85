"""Live replay (for scripts/replay_trace.py): a KV-cache trace played through a kvfs
mount, as vLLM's fs tier plays it.

Each block id becomes a file `<root>/<id % 256 as 2 hex digits>/<id>.bin` of
`block_bytes` bytes, whose first 8 bytes are the id (so that a load checks it
got the right block). Per request, like vLLM: the lookup thread checks the
request's block files with `access()` in order and stops at the first miss
(the hit prefix); the loaders open, read and close each hit; then every block
after the prefix is stored unless it exists (`access()` first, then create
O_EXCL, one write, close, rename). A hit whose load fails (the file was evicted
between the lookup and the open) counts as a miss, as vLLM counts it. The kernel
drops its entry of an evicted file asynchronously (kvfs notifies it from another
thread, never inside the evicting request), so access() may still find a file that
an earlier store just evicted: such a load is checked to be of a file that is really
gone (a second open, which the daemon answers), and a load that fails while its file
exists stops the replay as a bug.

The hit ratio is what the mount delivered; `kvfs.policy.replay.replay` is the
same model offline. They differ only where the mount does: a file becomes
evictable when the kernel's RELEASE seals it (possibly after the next request's
first calls), capacity is bytes (the model counts blocks), and a block found
after the first miss is not used live (vLLM's store only checks that it
exists), where the model counts a use.
"""

from __future__ import annotations

import os
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from kvfs.policy.replay import Request  # noqa: E402

FANOUT = 256


@dataclass
class LiveResult:
    hits: int = 0
    blocks: int = 0
    failed_loads: int = 0  # hits whose file was gone (evicted) by the time it was opened
    stored: int = 0
    seconds: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0


def block_path(root: Path, block: int) -> Path:
    return root / f"{block % FANOUT:02x}" / f"{block}.bin"


def prepare(root: Path) -> None:
    for bucket in range(FANOUT):
        (root / f"{bucket:02x}").mkdir(exist_ok=True)


def replay_live(root: Path, requests: Iterable[Request], block_bytes: int,
                progress: Callable[[int, LiveResult], None] = lambda done, result: None) -> LiveResult:
    """Plays `requests` through the mount at `root`; returns what it delivered."""
    prepare(root)
    payload = bytearray(block_bytes)
    buffer = bytearray(block_bytes)
    result = LiveResult()
    started = time.perf_counter()
    for number, request in enumerate(requests, 1):
        blocks = request.blocks
        result.blocks += len(blocks)
        prefix = 0
        while prefix < len(blocks) and os.access(block_path(root, blocks[prefix]), os.F_OK):
            prefix += 1
        served = 0
        for block in blocks[:prefix]:
            if not _load(block_path(root, block), block, buffer):
                if _present(block_path(root, block)):
                    raise AssertionError(f"{block_path(root, block)}: a load found no file, but it exists")
                result.failed_loads += 1
                break
            served += 1
        result.hits += served
        for block in blocks[served:]:
            if _store(block_path(root, block), block, payload):
                result.stored += 1
        if number % 500 == 0:
            progress(number, result)
    result.seconds = time.perf_counter() - started
    return result


def _load(path: Path, block: int, buffer: bytearray) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        got = os.readv(fd, [buffer])
    finally:
        os.close(fd)
    if got != len(buffer) or struct.unpack_from("<Q", buffer)[0] != block:
        raise AssertionError(f"{path}: read {got} bytes of block {struct.unpack_from('<Q', buffer)[0]}")
    return True


def _present(path: Path) -> bool:
    """Whether the daemon has the file (an open asks it, whatever entry the kernel keeps)."""
    try:
        os.close(os.open(path, os.O_RDONLY))
    except FileNotFoundError:
        return False
    return True


def _store(path: Path, block: int, payload: bytearray) -> bool:
    if os.access(path, os.F_OK):
        return False
    struct.pack_into("<Q", payload, 0, block)
    temp = path.with_name(path.name + ".tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_TRUNC, 0o644)
    try:
        os.write(fd, payload)
    finally:
        os.close(fd)
    os.rename(temp, path)
    return True
