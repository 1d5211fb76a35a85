"""Eviction policies: pure components that order files for eviction.

The master asks a policy for candidates and skips those it may not evict
(unsealed, open, on another node), so a policy only ranks files by value.
"""

from kvfs.policy.base import EvictionPolicy
from kvfs.policy.lru import LruPolicy
from kvfs.policy.reuse import ReusePolicy

POLICIES: dict[str, type] = {"lru": LruPolicy, "reuse": ReusePolicy}
DEFAULT_POLICY = "reuse"  # the winner on the traces (docs/eviction.md)


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r} (choose from {', '.join(POLICIES)})") from None


__all__ = ["DEFAULT_POLICY", "EvictionPolicy", "LruPolicy", "ReusePolicy", "POLICIES", "make_policy"]
