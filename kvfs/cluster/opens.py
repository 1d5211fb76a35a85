"""Open handles the master counts per node (pure): node -> (version, writer) -> handles.

A node that goes down or registers again gives all of its handles back at once, so
they are kept by node, not only as counts on the versions.
"""

from __future__ import annotations

Key = tuple[int, bool]  # (version, writer)


class OpenHandles:
    def __init__(self) -> None:
        self._by_node: dict[int, dict[Key, int]] = {}

    def count(self, node: int, version: int, writer: bool, delta: int) -> None:
        opens = self._by_node.setdefault(node, {})
        key = (version, writer)
        count = opens.get(key, 0) + delta
        if count > 0:
            opens[key] = count
        else:
            opens.pop(key, None)

    def holds(self, node: int, version: int, writer: bool) -> bool:
        return bool(self._by_node.get(node, {}).get((version, writer)))

    def take(self, node: int) -> dict[Key, int]:
        """Every handle of the node, which now holds none."""
        return self._by_node.pop(node, {})
