"""Offline replay of KV-cache traces against eviction policies (pure).

A trace is a list of requests, each the chain of its prefix block ids (full
blocks only, as vLLM stores them). A request hits on its longest cached prefix;
then every block of its chain is used (hits are touched, misses inserted), and
the cache evicts down to its capacity. The hit ratio is hit blocks over all
blocks. Belady's MIN (evict the block whose next use is farthest) is the
offline optimum for block-level caching and the ceiling policies are measured
against.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from kvfs.policy.base import EvictionPolicy

BLOCK_TOKENS = 512  # the traces' block size


@dataclass(frozen=True)
class Request:
    time_s: float
    blocks: tuple[int, ...]


def load_trace(path: Path) -> list[Request]:
    """Requests of a Mooncake-format trace, keeping only full blocks."""
    requests = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
                full = record["input_length"] // BLOCK_TOKENS
                requests.append(Request(record["timestamp"] / 1000, tuple(record["hash_ids"][:full])))
            except (ValueError, KeyError, TypeError) as error:
                raise ValueError(f"{path}:{number}: not a trace record ({error})") from None
    return requests


def unique_blocks(requests: Iterable[Request]) -> int:
    return len({block for request in requests for block in request.blocks})


def replay(requests: Iterable[Request], capacity: int, policy: EvictionPolicy) -> float:
    """The block-level prefix hit ratio of `policy` with room for `capacity` blocks."""
    cached: set[int] = set()
    hits = total = 0
    for request in requests:
        total += len(request.blocks)
        prefix = 0
        while prefix < len(request.blocks) and request.blocks[prefix] in cached:
            prefix += 1
        hits += prefix
        for block in request.blocks:
            if block in cached:
                policy.touch(block, request.time_s)
            else:
                policy.insert(block, 1, request.time_s)
                cached.add(block)
        if len(cached) > capacity:
            victims = []
            for block in policy.candidates():
                victims.append(block)
                if len(cached) - len(victims) <= capacity:
                    break
            for block in victims:
                policy.remove(block)
                cached.discard(block)
        assert len(cached) <= capacity
    return hits / total if total else 0.0


def belady(requests: list[Request], capacity: int) -> float:
    """Belady's MIN: the offline optimum of block-level eviction."""
    sequence = [block for request in requests for block in request.blocks]
    next_use = [0] * len(sequence)
    seen: dict[int, int] = {}
    for position in range(len(sequence) - 1, -1, -1):
        next_use[position] = seen.get(sequence[position], len(sequence) + position)
        seen[sequence[position]] = position
    cached: dict[int, int] = {}  # block -> its next use
    heap: list[tuple[int, int]] = []
    hits = position = 0
    for request in requests:
        prefix = 0
        while prefix < len(request.blocks) and request.blocks[prefix] in cached:
            prefix += 1
        hits += prefix
        for block in request.blocks:
            cached[block] = next_use[position]
            heapq.heappush(heap, (-next_use[position], block))
            position += 1
        while len(cached) > capacity:
            negated, block = heapq.heappop(heap)
            if cached.get(block) == -negated:
                del cached[block]
    return hits / len(sequence) if sequence else 0.0


def capacities(requests: list[Request], fractions: Iterable[float]) -> Iterator[tuple[float, int]]:
    unique = unique_blocks(requests)
    for fraction in fractions:
        yield fraction, max(1, int(unique * fraction))
