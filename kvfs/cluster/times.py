"""Times as a master keeps them: nanoseconds since BASE_NS, not since 1970.

A count of ns since 1970 needs 61 bits (an int of 3 digits: 36 B, 48 allocated); since
BASE_NS one of 2 digits (32 B) from 1987 to 2060, and a master keeps two or three per
file (docs/cluster.md, "Memory per file"). Every time read back is the same ns count.
"""

from __future__ import annotations

BASE_NS = 1_700_000_000 * 1_000_000_000  # 2023-11-14T22:13:20Z

