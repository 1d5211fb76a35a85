"""Misses the master answered a moment ago, to answer the store's next lookups in that directory (pure).

vLLM's store in its hashed layout looks up the final name (`access()`), creates
`<name>_<random>.tmp` beside it and renames that to the final name, in one of ~1M leaf
directories this node mostly never looked at before. The kernel looks up the temp name
before the exclusive create and the final name again before the rename (it never trusts
a negative entry for those), and each lookup asked the master (the second copied the
directory): three round trips for one miss. Now the master's answer to the first miss
also says whether the directory, if small, holds any name ending in the temp suffix
(`Entry.no_temps`, false too for a file hidden while its node is down); where it holds
none, for `WINDOW_S` after the miss was asked, the node answers without asking:

- the same name again: absent (what the kernel's own negative entry would answer for a
  second; the create or rename that follows goes to the master, which decides);
- any temp name: absent. The temp file itself is this node's own (kvfs.node.private)
  and never meets another node's of the same name.

A directory this node just made is marked the same way (it holds nothing yet).

The window is the staleness of a kernel's negative entry (1 s, `--negative-timeout`):
a name made on another node within that second is missed here as it is by a kernel that
looked it up. This node's own changes in the directory drop the mark first, and an
answer that may predate one of them marks nothing. A node that makes a temp name known
to the master (a temp file handed over by a chmod, say: rare, docs/semantics.md) returns
only once every mark taken before the master applied it has expired (`adds_temp_name`),
so the name is found on every node when the call returns, as before. The kernel does
not cache an absence answered from a mark (entry timeout 0): a mark outlives neither its
window nor a change of this node (an exclusive create or mkdir the master refused with
EEXIST: the walk on through the name asks again and finds it).
"""

from __future__ import annotations

from kvfs.wire import messages as m

WINDOW_S = 1.0  # as long as kernels cache a negative entry (MountConfig.negative_timeout_s)
KEPT = 4096  # directories marked at once (a mark lives a second: a store's access-to-rename)


class RecentMisses:
    def __init__(self, temp_suffix: bytes, window_s: float = WINDOW_S) -> None:
        self.temp_suffix = temp_suffix
        self.window_s = window_s
        # directory ino -> (when the miss was asked, the name missed), for one without temp names
        self._marks: dict[int, tuple[float, bytes]] = {}
        self.seq = 0  # changes of this node begun or answered so far
        self._changed_at: dict[int, int] = {}  # directory ino -> `seq` of its last change
        self._floor = 0  # tokens older than this are refused (_changed_at was cleared)
        self.answered = 0  # lookups answered absent from a mark
        self._uncached: tuple[int, bytes] | None = None  # the last of them, for the kernel's entry

    def token(self) -> int:
        """Taken before a Lookup is sent: its answer marks only if no change of this node
        named the directory since (the master may have answered before that change)."""
        return self.seq

    def missed(self, parent: int, name: bytes, asked: float, token: int) -> None:
        """The master answered a Lookup of `name` sent at `asked`: absent, and no temp name
        in the directory."""
        if token < self._floor or self._changed_at.get(parent, 0) > token:
            return
        marks = self._marks
        marks.pop(parent, None)  # (re-inserted last: the dict stays in time order)
        marks[parent] = (asked, name)
        if len(marks) > KEPT:
            for ino in list(marks)[:len(marks) - KEPT // 2]:  # the oldest half goes
                del marks[ino]

    def absent(self, parent: int, name: bytes, now: float) -> bool:
        """True if `name` (no private file of this node) is known absent from `parent`."""
        mark = self._marks.get(parent)
        if mark is None:
            return False
        asked, missed = mark
        if now - asked >= self.window_s:
            del self._marks[parent]
            return False
        if name == missed or (self.temp_suffix and name.endswith(self.temp_suffix)):
            self.answered += 1
            self._uncached = (parent, name)
            return True
        return False

    def uncached(self, parent: int, name: bytes) -> bool:
        """True once if the last absence answered from a mark was this name's: the kernel's
        negative entry for it must not outlive the mark (entry timeout 0). Asked as the
        lookup returns, with no wait between: another lookup's answer cannot come first."""
        if self._uncached != (parent, name):
            return False
        self._uncached = None
        return True

    def forget(self, parent: int) -> None:
        """The directory was listed: what the listing showed stands, not an older miss."""
        self._marks.pop(parent, None)

    def changed(self, parent: int) -> None:
        """A change of this node in directory `parent` begins or was answered."""
        self._marks.pop(parent, None)
        self.seq += 1
        if len(self._changed_at) >= 4 * KEPT:
            self._changed_at.clear()
            self._floor = self.seq
        self._changed_at[parent] = self.seq

    def changed_request(self, request: m.Request) -> None:
        for field in ("parent", "parent_new"):  # where a change adds or replaces a name
            parent = getattr(request, field, None)
            if isinstance(parent, int):
                self.changed(parent)


def adds_temp_name(request: m.Request, temp_suffix: bytes) -> bool:
    """A change that makes a name ending in the temp suffix known to the master."""
    if not temp_suffix:
        return False
    added = m.added_name(request)
    return added is not None and added[1].endswith(temp_suffix)
