"""Where each version a node stores resides, and what the store decides from it (pure).

One `Entry` per sealed version says which tiers hold it (DRAM, SSD), where it stands on
its way to SSD (queued, parked after a failure, its record naming an older path) and
whether its bytes are still only in DRAM. One `Users` per version in use says who holds
its copies (readers pinning the DRAM copy, reads in flight from SSD, an offload, a
promotion); it outlives the file when the file goes while its copies are in use, so that
they are freed when the last user is done. `Residency` keeps both, moves versions from
state to state (refusing moves that make no sense), and makes the store's decisions:
what to offload next, what to demote, when to retry after a failure, whether a removal
must wait for readers. It does no I/O and reads time only through the injected clock;
`kvfs.store.tiered` is the shell that does the I/O and the waiting.
"""

from __future__ import annotations

import enum
import errno
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

from kvfs.chunks import chunk_count
from kvfs.errors import StorageError
from kvfs.policy.base import EvictionPolicy

# After a storage failure the offloader retries after RETRY_MIN_S, doubling up to
# RETRY_MAX_S while it keeps failing: resumption within seconds of the cause going away,
# without an attempt (and its I/O) per sealed file meanwhile.
RETRY_MIN_S = 0.25
RETRY_MAX_S = 5.0
# Offload yields to a burst of writes until they pause for OFFLOAD_QUIET_S.
OFFLOAD_QUIET_S = 0.02


class IllegalTransition(Exception):
    """A move the state machine refuses: a bug in the caller, never a storage failure."""


class State(enum.Enum):
    DRAM_ONLY = "dram-only"  # sealed; its only copy is in DRAM, not (yet) queued for SSD
    QUEUED = "queued"  # waiting for the offloader
    OFFLOADING = "offloading"  # being copied to SSD
    PARKED = "parked"  # a copy failed: retried after a delay
    UNSETTLED = "unsettled"  # on SSD, but its record names an older path (or is not yet checked)
    ON_SSD = "on-ssd"  # saved on SSD, with a DRAM copy (demotable)
    DEMOTED = "demoted"  # saved on SSD only
    PROMOTING = "promoting"  # being read from SSD back into DRAM
    GONE = "gone"  # no longer a file here (its copies may still be in use)


class Stage(enum.Enum):
    """A version's place in the offloader's lines (an offload in flight is a `Users` flag:
    it outlives the file)."""

    NONE = "none"
    QUEUED = "queued"
    PARKED = "parked"


@dataclass
class Entry:
    """A sealed version stored on this node."""

    size: int
    checksums: list[int]
    in_dram: bool
    on_ssd: bool = False
    stage: Stage = Stage.NONE
    unsettled: bool = False  # on SSD, but not under its current name: not saved yet
    resettle: bool | None = None  # its record to be rewritten (True: first offload, not yet reported)
    dram_only: bool = False  # counted in the DRAM-only bytes (sealed, not yet reported offloaded)
    touches: int = 0  # opens served from SSD (the second one promotes)

    def lengths(self, chunk_size: int) -> list[int]:
        return chunk_lengths(self.size, chunk_size)

    @property
    def saved(self) -> bool:
        """Its SSD copy would survive a crash under its current name."""
        return self.on_ssd and not self.unsettled


@dataclass
class Users:
    """Who is using a version's copies right now."""

    pins: int = 0  # readers and leases of the DRAM copy
    disk_readers: int = 0  # reads in flight from SSD: its extents are not freed meanwhile
    offloading: bool = False
    promoting: bool = False
    dropped: bool = False  # the file went while its DRAM copy was in use: freed when idle

    @property
    def idle(self) -> bool:
        return not (self.pins or self.disk_readers or self.offloading or self.promoting or self.dropped)


def chunk_lengths(size: int, chunk_size: int) -> list[int]:
    return [min(chunk_size, size - i * chunk_size) for i in range(chunk_count(size, chunk_size))]


@dataclass
class Backoff:
    """When the offloader may try again after a storage failure (a growing delay)."""

    minimum: float = RETRY_MIN_S
    maximum: float = RETRY_MAX_S
    retry_at: float = 0.0
    delay: float = field(default=-1.0)

    def __post_init__(self) -> None:
        if self.delay < 0:
            self.delay = self.minimum

    def failed(self, now: float) -> None:
        self.retry_at = now + self.delay
        self.delay = min(self.maximum, self.delay * 2)

    def succeeded(self) -> None:
        self.delay = self.minimum

    def due(self, now: float) -> bool:
        return now >= self.retry_at

    def wait_s(self, now: float) -> float:
        return max(0.0, self.retry_at - now)

    def now(self) -> None:
        """Retry at once (a stop, an fsync)."""
        self.retry_at = 0.0


class Residency:
    """Every stored version's residency, and the decisions over it."""

    def __init__(self, policy: EvictionPolicy, clock: Callable[[], float] = time.monotonic,
                 backoff: Backoff | None = None) -> None:
        self.clock = clock
        self.policy = policy  # sealed versions with a DRAM copy, least valuable first
        self.backoff = backoff or Backoff()
        self._files: dict[int, Entry] = {}
        self._users: dict[int, Users] = {}
        self._queue: OrderedDict[int, None] = OrderedDict()
        self._parked: OrderedDict[int, None] = OrderedDict()
        self._removals: list[int] = []  # SSD copies of versions that went, to delete
        self._quarantined: set[int] = set()
        self._dram_only_bytes = 0
        self._last_write = 0.0

    # Queries ----------------------------------------------------------------------------

    def __contains__(self, version: int) -> bool:
        return version in self._files

    def __iter__(self) -> Iterator[int]:
        return iter(self._files)

    def entry(self, version: int) -> Entry | None:
        return self._files.get(version)

    def stored(self, version: int) -> Entry:
        """A sealed version's entry; ENOENT when this node does not store it (a caller's
        request for a version that is gone fails like any missing file)."""
        entry = self._files.get(version)
        if entry is None:
            raise StorageError(errno.ENOENT, f"version {version} is not stored on this node")
        return entry

    def users(self, version: int) -> Users:
        """A version's users (a fresh, idle record when it has none)."""
        return self._users.get(version) or Users()

    def entries(self) -> dict[int, Entry]:
        return dict(self._files)

    def state(self, version: int) -> State:
        entry = self._files.get(version)
        users = self.users(version)
        if entry is None:
            return State.GONE
        if users.promoting:
            return State.PROMOTING
        if users.offloading:
            return State.OFFLOADING
        if entry.stage is Stage.PARKED:
            return State.PARKED
        if entry.stage is Stage.QUEUED:
            return State.QUEUED
        if entry.on_ssd:
            if entry.unsettled:
                return State.UNSETTLED
            return State.ON_SSD if entry.in_dram else State.DEMOTED
        return State.DRAM_ONLY

    def is_saved(self, version: int) -> bool:
        entry = self._files.get(version)
        return entry is not None and entry.saved

    def is_unsettled(self, version: int) -> bool:
        entry = self._files.get(version)
        return entry is not None and entry.unsettled

    def pinned(self, version: int) -> bool:
        return self.users(version).pins > 0

    def offloading(self, version: int) -> bool:
        return self.users(version).offloading

    def promoting(self, version: int) -> bool:
        return self.users(version).promoting

    def busy_versions(self) -> dict[int, Users]:
        return dict(self._users)

    @property
    def dram_only_bytes(self) -> int:
        """Sealed bytes whose only copy is in DRAM (not yet reported offloaded)."""
        return self._dram_only_bytes

    def queued(self) -> list[int]:
        return list(self._queue)

    def parked(self) -> list[int]:
        return list(self._parked)

    def removals(self) -> list[int]:
        return list(self._removals)

    def resettles(self) -> dict[int, bool]:
        """Versions whose record is to be rewritten (True: a first offload, not yet reported)."""
        return {v: e.resettle for v, e in self._files.items() if e.resettle is not None}

    def quarantined(self, version: int) -> bool:
        return version in self._quarantined

    def holdings(self) -> list[tuple[int, int, list[int], bool]]:
        """(version, size, checksums, saved on SSD) of every sealed version."""
        return [(version, e.size, e.checksums, e.saved) for version, e in self._files.items()]

    def unsaved(self) -> tuple[int, int]:
        """Files (and bytes) with no copy on SSD under their current name."""
        sizes = [e.size for e in self._files.values() if not e.saved]
        return len(sizes), sum(sizes)

    def parked_totals(self) -> tuple[int, int]:
        """Files (and bytes) waiting for a retry after a storage failure."""
        return len(self._parked), sum(self._files[v].size for v in self._parked)

    def backlog(self) -> tuple[int, int]:
        """Files (and bytes) queued for, being copied to, or waiting to retry the copy to SSD."""
        waiting = set(self._queue) | set(self._parked) | {v for v, u in self._users.items() if u.offloading}
        return len(waiting), sum(self._files[v].size for v in waiting if v in self._files)

    def offload_pending(self) -> bool:
        """Something is queued or being copied."""
        return bool(self._queue) or any(u.offloading for u in self._users.values())

    def retry_pending(self, index_failing: bool) -> bool:
        """Work waits for the retry: parked files, records to rewrite, or removals the index refused."""
        return bool(self._parked) or any(e.resettle is not None for e in self._files.values()) \
            or (bool(self._removals) and index_failing)

    # Sealing, recovery ---------------------------------------------------------------------

    def seal(self, version: int, size: int, checksums: list[int]) -> None:
        """A version written here became immutable: DRAM-only."""
        if version in self._files:
            raise IllegalTransition(f"version {version} is sealed already")
        self._files[version] = Entry(size, checksums, in_dram=True, dram_only=True)
        self._dram_only_bytes += size
        self.policy.insert(version, size, self.clock())

    def adopt_recovered(self, version: int, size: int, checksums: list[int]) -> None:
        """A version found on SSD at start: demoted (no DRAM copy), saved."""
        self.drop_recovered(version)
        self._files[version] = Entry(size, checksums, in_dram=False, on_ssd=True)

    def drop_recovered(self, version: int) -> None:
        self.policy.remove(version)
        self._queue.pop(version, None)
        self._parked.pop(version, None)
        entry = self._files.pop(version, None)
        if entry is not None and entry.dram_only:
            self._dram_only_bytes -= entry.size

    def wrote(self) -> None:
        """A write arrived (the offloader yields to bursts of them)."""
        self._last_write = self.clock()

    def quiet_from(self) -> float:
        """When writes will have paused long enough for the offloader to go on (a time, not a
        delay: a delay recomputed from a clock that stood still could stay a hair above 0)."""
        return self._last_write + OFFLOAD_QUIET_S

    # The offloader's lines -------------------------------------------------------------------

    def _entry(self, version: int) -> Entry:
        entry = self._files.get(version)
        if entry is None:
            raise IllegalTransition(f"version {version} is not sealed here")
        return entry

    def _set_stage(self, version: int, entry: Entry, stage: Stage) -> None:
        if entry.stage is Stage.QUEUED and stage is not Stage.QUEUED:
            self._queue.pop(version, None)
        elif entry.stage is Stage.PARKED and stage is not Stage.PARKED:
            self._parked.pop(version, None)
        if stage is Stage.QUEUED:
            self._queue.setdefault(version, None)
        elif stage is Stage.PARKED:
            self._parked.setdefault(version, None)
        entry.stage = stage

    def queue(self, version: int) -> bool:
        """Asks for a copy to SSD (a parked version is taken off its wait); False while one is
        in flight. Whether it still needs one is checked when the offloader takes it."""
        entry = self._entry(version)
        if self.offloading(version):
            return False
        self._set_stage(version, entry, Stage.QUEUED)
        return True

    def _needs_copy(self, version: int, entry: Entry) -> bool:
        return not entry.on_ssd and entry.stage is not Stage.QUEUED and not self.offloading(version)

    def queue_for_watermark(self, used: int, capacity: int, high: float, low: float) -> int:
        """Past the high watermark: queues DRAM-only versions, least valuable first, until
        the DRAM-only bytes would be down to the low watermark. Returns how many."""
        if used <= high * capacity:
            return 0
        excess = self._dram_only_bytes - low * capacity
        queued = 0
        for version in list(self.policy.candidates()):
            if excess <= 0:
                break
            entry = self._files[version]
            if self._needs_copy(version, entry):
                self._set_stage(version, entry, Stage.QUEUED)
                queued += 1
                excess -= entry.size
        return queued

    def queue_all_dram_only(self) -> int:
        """Queues every sealed version whose only copy is in DRAM; returns how many."""
        queued = 0
        for version in list(self.policy.candidates()):
            entry = self._files[version]
            if self._needs_copy(version, entry):
                self._set_stage(version, entry, Stage.QUEUED)
                queued += 1
        return queued

    def take_batch(self, max_files: int, max_bytes: int) -> list[int]:
        """The next versions to copy, in queue order (those that no longer need it leave the line)."""
        batch: list[int] = []
        nbytes = 0
        while self._queue and len(batch) < max_files and nbytes < max_bytes:
            version = next(iter(self._queue))
            entry = self._files[version]
            self._set_stage(version, entry, Stage.NONE)
            if not entry.in_dram or entry.on_ssd:
                continue
            batch.append(version)
            nbytes += entry.size
        return batch

    def start_offload(self, version: int) -> None:
        self._entry(version)
        users = self._users.setdefault(version, Users())
        if users.offloading:
            raise IllegalTransition(f"version {version} is being copied already")
        users.offloading = True

    def finish_offload(self, version: int) -> bool:
        """An offload ended (copied or not); True if the file went meanwhile."""
        users = self._users.get(version)
        if users is None or not users.offloading:
            raise IllegalTransition(f"version {version} is not being copied")
        users.offloading = False
        gone = users.dropped or version not in self._files
        self._forget_idle(version)
        return gone

    def park(self, versions: list[int]) -> None:
        """Their copy failed (or waits for the retry): they stay in DRAM, undemotable."""
        for version in versions:
            entry = self._files.get(version)
            if entry is None:
                continue
            if entry.on_ssd:
                self._set_stage(version, entry, Stage.NONE)
            else:
                self._set_stage(version, entry, Stage.PARKED)

    def park_queue(self) -> None:
        self.park(list(self._queue))

    def requeue_parked(self) -> None:
        """Their retry is due: first in line, in their order."""
        for version in reversed(list(self._parked)):
            entry = self._files[version]
            self._set_stage(version, entry, Stage.QUEUED)
            self._queue.move_to_end(version, last=False)

    def retry_now(self) -> None:
        """Parked versions are queued at once and the backoff is cleared (a stop, an fsync)."""
        self.backoff.now()
        for version in list(self._parked):
            self._set_stage(version, self._files[version], Stage.QUEUED)

    def failed(self) -> None:
        """A storage failure: the next attempt waits for the backoff."""
        self.backoff.failed(self.clock())

    def retry_due(self) -> bool:
        return self.backoff.due(self.clock())

    def retry_wait_s(self) -> float:
        return self.backoff.wait_s(self.clock())

    # Copies on SSD -----------------------------------------------------------------------------

    def committed(self, version: int) -> None:
        """Its chunks and record are durable on SSD; saved once the record is checked."""
        entry = self._files.get(version)
        if entry is not None:
            entry.on_ssd = True
            entry.unsettled = True

    def saved(self, version: int) -> None:
        """Its record names the file as it is."""
        entry = self._files.get(version)
        if entry is not None:
            entry.unsettled = False

    def reported(self, version: int) -> None:
        """The master knows it is on SSD: its bytes no longer count as DRAM-only."""
        entry = self._files.get(version)
        if entry is not None and entry.dram_only:
            entry.dram_only = False
            self._dram_only_bytes -= entry.size

    def needs_resettle(self, version: int, first: bool) -> None:
        """Its record could not be rewritten: not saved until the offloader rewrites it."""
        entry = self._entry(version)
        entry.unsettled = True
        entry.resettle = first

    def resettled(self, version: int) -> None:
        entry = self._files.get(version)
        if entry is not None:
            entry.resettle = None

    def abandon_resettle(self, version: int) -> None:
        """The file is going (its drop removes the record): nothing to rewrite."""
        entry = self._files.get(version)
        if entry is not None:
            entry.resettle = None
            entry.unsettled = False

    def unsettle_dropped(self, version: int) -> bool:
        """A copy committed for a file that went: its SSD copy is removed; True if its DRAM
        copy is to be freed now."""
        entry = self._files.get(version)
        if entry is not None:
            entry.unsettled = False
        self._add_removal(version)
        return self.release_if_dropped(version)

    def removable(self) -> list[int]:
        """Removals that can go now: no read from SSD is in flight."""
        return [v for v in self._removals if not self.users(v).disk_readers]

    def take_removals(self) -> list[int]:
        """The removals to do now; those still being read wait for their readers."""
        versions = self.removable()
        self._removals = [v for v in self._removals if self.users(v).disk_readers]
        return versions

    def restore_removals(self, versions: list[int]) -> None:
        """The index refused them: tried again later."""
        self.remove_later(versions)

    def removed_from_ssd(self, versions: list[int]) -> None:
        for version in versions:
            entry = self._files.get(version)
            if entry is not None:
                entry.on_ssd = False
                entry.unsettled = False

    def remove_later(self, versions: list[int]) -> None:
        for version in versions:
            self._add_removal(version)

    def _add_removal(self, version: int) -> None:
        if version not in self._removals:
            self._removals.append(version)

    # DRAM copies ---------------------------------------------------------------------------------

    def demote_one(self) -> int | None:
        """Drops (from the books) the DRAM copy of the least valuable version saved on SSD and
        not in use; returns it (the caller frees its blocks), None if there is none."""
        for version in self.policy.candidates():
            entry = self._files[version]
            if entry.saved and not self.pinned(version):
                break
        else:
            return None
        self.policy.remove(version)
        entry.in_dram = False
        return version

    def pin(self, version: int) -> None:
        self._users.setdefault(version, Users()).pins += 1

    def touch(self, version: int) -> None:
        """A reader used its DRAM copy (the eviction order learns from every use)."""
        self.policy.touch(version, self.clock())

    def unpin(self, version: int) -> bool:
        """True if the DRAM copy is to be freed now (its file went while it was pinned)."""
        users = self._users.get(version)
        if users is None or users.pins <= 0:
            raise IllegalTransition(f"version {version} is not pinned")
        users.pins -= 1
        if users.pins:
            return False
        free = users.dropped and not users.offloading
        if free:
            users.dropped = False
        self._forget_idle(version)
        return free

    def release_if_dropped(self, version: int) -> bool:
        """True if the DRAM copy of a file that went is to be freed now (no one uses it)."""
        users = self._users.get(version)
        if users is None or not users.dropped or users.pins:
            return False
        users.dropped = False
        self._forget_idle(version)
        return True

    # Reading from SSD, promotion --------------------------------------------------------------------

    def touch_on_ssd(self, version: int) -> int:
        """An open served from SSD; returns how many there were (the second promotes)."""
        entry = self._entry(version)
        entry.touches += 1
        return entry.touches

    def hold_disk(self, version: int) -> None:
        self._users.setdefault(version, Users()).disk_readers += 1

    def release_disk(self, version: int) -> bool:
        """A read from SSD ended; True if a removal waited for it (the reaper can go now)."""
        users = self._users.get(version)
        if users is None or users.disk_readers <= 0:
            raise IllegalTransition(f"version {version} has no read from SSD in flight")
        users.disk_readers -= 1
        self._forget_idle(version)
        return not users.disk_readers and version in self._removals

    def begin_promote(self, version: int) -> None:
        """Its blocks were allocated in DRAM and are being filled: pinned for the caller,
        neither demotable nor freeable meanwhile."""
        entry = self._entry(version)
        users = self._users.setdefault(version, Users())
        if entry.in_dram or users.promoting:
            raise IllegalTransition(f"version {version} is in DRAM or being promoted already")
        users.promoting = True
        users.pins += 1
        entry.in_dram = True

    def end_promote(self, version: int) -> bool:
        """The read into DRAM ended; True if it is promoted (the file is still here), else
        the caller frees the blocks (and its pin is gone)."""
        users = self._users[version]
        users.promoting = False
        entry = self._files.get(version)
        if entry is not None:
            self.policy.insert(version, entry.size, self.clock())
            return True
        users.pins -= 1
        users.dropped = False
        self._forget_idle(version)
        return False

    def promote_failed(self, version: int) -> None:
        """The read into DRAM failed: the blocks are freed, readers go to the SSD."""
        users = self._users[version]
        users.promoting = False
        users.pins -= 1
        users.dropped = False
        entry = self._files.get(version)
        if entry is not None:
            entry.in_dram = False
        self._forget_idle(version)

    def quarantine(self, version: int) -> bool:
        """A chunk failed its checksum; True the first time (the file is then removed)."""
        if version in self._quarantined:
            return False
        self._quarantined.add(version)
        return True

    # Dropping ---------------------------------------------------------------------------------------

    def drop(self, version: int) -> tuple[bool, bool]:
        """The file is gone. Returns (free its DRAM copy now, remove its SSD copy): a DRAM copy
        in use is freed when its last user is done."""
        entry = self._files.pop(version, None)
        self.policy.remove(version)
        self._queue.pop(version, None)
        self._parked.pop(version, None)
        if entry is not None and entry.dram_only:
            self._dram_only_bytes -= entry.size
        users = self._users.get(version)
        free_now = users is None or not (users.pins or users.offloading)
        if not free_now:
            users.dropped = True  # type: ignore[union-attr]
        remove = entry is not None and entry.on_ssd
        if remove:
            self._add_removal(version)
        return free_now, remove

    def _forget_idle(self, version: int) -> None:
        users = self._users.get(version)
        if users is not None and users.idle:
            del self._users[version]

    # Consistency ------------------------------------------------------------------------------------

    def problems(self) -> list[str]:
        """What contradicts itself in the books (empty when consistent)."""
        found = []
        for version, entry in self._files.items():
            if (entry.stage is Stage.QUEUED) != (version in self._queue):
                found.append(f"version {version}: stage {entry.stage.value}, queued {version in self._queue}")
            if (entry.stage is Stage.PARKED) != (version in self._parked):
                found.append(f"version {version}: stage {entry.stage.value}, parked {version in self._parked}")
            if entry.dram_only and not entry.in_dram:
                found.append(f"version {version} counts as DRAM-only but has no DRAM copy")
            if entry.stage is Stage.PARKED and entry.on_ssd:
                found.append(f"version {version} is parked but on SSD")
        for version in list(self._queue) + list(self._parked):
            if version not in self._files:
                found.append(f"version {version} waits for the offloader but is not sealed here")
        counted = sum(e.size for e in self._files.values() if e.dram_only)
        if counted != self._dram_only_bytes:
            found.append(f"DRAM-only bytes {self._dram_only_bytes}, entries say {counted}")
        for version, users in self._users.items():
            if users.idle:
                found.append(f"version {version}: an idle users record is kept")
            if users.pins < 0 or users.disk_readers < 0:
                found.append(f"version {version}: negative use counts {users}")
            if users.dropped and version in self._files:
                found.append(f"version {version} is marked gone but is still sealed here")
        in_policy = set(self.policy.candidates())
        with_dram = {v for v, e in self._files.items() if e.in_dram and not self.promoting(v)}
        if in_policy != with_dram:
            found.append(f"eviction order holds {sorted(in_policy ^ with_dram)} wrongly")
        return found
