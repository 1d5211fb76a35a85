"""Directory attributes the kernel holds, to answer its getattr after a private change (pure).

The kernel drops its copy of a directory's attributes after every create, rename or
unlink in it, and asks again at the next path walk's permission check. For a node's
private temp file (kvfs.node.private) the master's directory did not change: what the
kernel held before is still what the master would answer, so the node answers with it,
valid only until the kernel's copy would have expired anyway (the answer's
attr_timeout is what was left). In vLLM's hashed layout, where each file is stored in
another directory, that is one master round trip less per file: the getattr between
the temp file's create and its rename.

The same holds after a change of this node that the master answered with the directory's
attributes after it (a mkdir's parent, a publish's directory): the kernel dropped its copy
for that change, and those attributes are what it would have got by asking at once. They
answer its next getattr, however late, for what is left of its timeout counted from the
master's answer: no attributes are shown longer after the master gave them than the
kernel's own cache would show them (in vLLM's hashed layout, the `<hhh>` directory whose
leaf a store made earlier is not asked for again on the next walk through it).

A copy is kept only while no change of this node can have moved the directory since
the kernel got it: a change sent to the master that names the directory drops it, one
whose effect on directories is not named by the request (a rename, an rmdir) drops all,
and so do names removed behind the kernel's back (eviction, another node's change).
"""

from __future__ import annotations

import copy

from kvfs.wire import messages as m

KEPT = 65536  # directories whose attributes as handed to the kernel are remembered


class KernelDirAttrs:
    def __init__(self) -> None:
        self._handed: dict[int, tuple[m.Attr, float]] = {}  # ino -> (attributes, when handed to the kernel)
        self._armed: dict[int, tuple[m.Attr, float]] = {}  # dropped by the kernel after a private change only
        self.answered = 0

    def handed(self, attr: m.Attr, now: float) -> None:
        """The kernel was given these directory attributes now (valid for its attr timeout)."""
        if len(self._handed) >= KEPT and attr.ino not in self._handed:
            oldest = next(iter(self._handed))
            self._handed.pop(oldest)
            self._armed.pop(oldest, None)
        self._handed[attr.ino] = (copy.copy(attr), now)

    def change_answered(self, attrs: list[m.Attr], now: float) -> None:
        """A change of this node was answered now with these directories' attributes after it,
        and no other change of the node can have moved them (kvfs.node.dircache.OwnChanges'
        rule): the kernel dropped its copies for the change and would get these by asking."""
        for attr in attrs:
            self.handed(attr, now)
            self._armed[attr.ino] = self._handed[attr.ino]

    def private_change(self, ino: int) -> None:
        """A private temp file was created, renamed or unlinked in directory `ino`: the
        kernel drops its attributes, the master's are unchanged."""
        kept = self._handed.get(ino)
        if kept is not None:
            self._armed[ino] = kept

    def changed(self, ino: int) -> None:
        """A change of the directory (or in it) went to the master."""
        self._handed.pop(ino, None)
        self._armed.pop(ino, None)

    def changed_request(self, request: m.Request) -> None:
        if isinstance(request, (m.Rename, m.RmDir)):  # a moved or removed directory's own attributes change
            self.clear()
            return
        for field in ("parent", "ino"):
            ino = getattr(request, field, None)
            if isinstance(ino, int):
                self.changed(ino)

    def clear(self) -> None:
        self._handed.clear()
        self._armed.clear()

    def answer(self, ino: int, now: float, timeout_s: float) -> tuple[m.Attr, float] | None:
        """(attributes, seconds the kernel may still keep them) for a getattr after a private
        change or an answered change, once; None: ask as usual."""
        kept = self._armed.pop(ino, None)
        if kept is None:
            return None
        attr, when = kept
        left = timeout_s - (now - when)
        if left <= 0.001:
            return None
        self.answered += 1
        return copy.copy(attr), left
