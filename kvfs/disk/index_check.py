"""Checks the SSD tier's index in a child process before the daemon opens it.

lmdb maps its file into memory and trusts it: a truncated index kills the
process that reads it with SIGBUS, and garbled pages raise lmdb errors at any
later access. So the index is first opened, read in full (every entry decoded,
every extent checked against the tier's range and against the others) and
written once, in a child process; whatever goes wrong there, including a fatal
signal or a hang, only marks the index as damaged, and the tier rebuilds it
from the segments.

Run as `python -m kvfs.disk.index_check INDEX_DIR CAPACITY CHUNK_SIZE MAP_SIZE`; prints
one JSON object (an IndexState).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import lmdb
import msgspec

from kvfs.disk.records import LAYOUT_VERSION, IndexEntry, LayoutMeta
from kvfs.disk.segments import SEGMENT_SIZE
from kvfs.buddy import BuddyAllocator

PAGE = 4096


@dataclass(frozen=True)
class IndexState:
    # "ok", "absent" (no index yet, or an empty one), "layout" (another layout: `layout`
    # names it; 0 if the chunk or segment size differ), or "damaged" (`detail` says how).
    kind: str
    detail: str = ""
    records: int = 0
    layout: int = LAYOUT_VERSION


def _rounded(length: int) -> int:
    return -(-length // PAGE) * PAGE


def check_entries(raw_entries, capacity: int, chunk_size: int) -> tuple[int, str | None]:
    """(entries, why the index is damaged or None): each entry decodes, and its header and
    chunks lie inside the tier without overlapping any other's."""
    decode = msgspec.msgpack.Decoder(IndexEntry).decode
    allocator = BuddyAllocator(capacity, PAGE, chunk_size)
    count = 0
    for key, value in raw_entries:
        try:
            entry = decode(value)
        except msgspec.DecodeError as error:
            return count, f"entry {bytes(key).hex()} does not decode ({error})"
        blocks = [(entry.header, entry.header_length)]
        blocks += [(offset, _rounded(length)) for offset, length, _ in entry.record.chunks]
        for offset, length in blocks:
            if not allocator.reserve(offset, length):
                return count, f"entry of version {entry.record.version} points at invalid or overlapping space"
        count += 1
    return count, None


# Entries without the layout record: a rebuild's index (its layout record goes last) that a
# crash cut short; every index kvfs makes otherwise has the record before any entry.
CUT_SHORT = "it has no layout record (a rebuild cut short)"


def examine(path: Path, capacity: int, chunk_size: int, map_size: int) -> IndexState:
    """The state of the index at `path` (runs in the child: may die on a damaged file)."""
    data = path / "data.mdb"
    if not data.exists():
        return IndexState("absent")
    if data.stat().st_size == 0:
        return IndexState("damaged", "its data file is empty")
    try:
        env = lmdb.open(str(path), map_size=map_size, max_dbs=2)
        try:
            meta_db = env.open_db(b"meta")
            files_db = env.open_db(b"files")
            with env.begin(db=meta_db) as txn:
                raw = txn.get(b"layout")
            with env.begin(db=files_db) as txn:
                count, problem = check_entries(txn.cursor(), capacity, chunk_size)
            if raw is None:
                return IndexState("absent") if count == 0 and problem is None else IndexState(
                    "damaged", CUT_SHORT)
            meta = msgspec.msgpack.decode(raw, type=LayoutMeta)
            if meta.layout != LAYOUT_VERSION:
                return IndexState("layout", f"layout {meta.layout}", layout=meta.layout)
            if meta != LayoutMeta(LAYOUT_VERSION, chunk_size, SEGMENT_SIZE):
                return IndexState("layout", f"{meta}", layout=0)
            if problem is not None:
                return IndexState("damaged", problem)
            try:  # a write must work too (it reads the free-page list)
                with env.begin(db=meta_db, write=True) as txn:
                    txn.put(b"layout", raw)
            except lmdb.Error as error:  # e.g. a full file system: not damage, the store handles it
                return IndexState("ok", f"it cannot be written now ({error})", records=count)
            return IndexState("ok", records=count)
        finally:
            env.close()
    except (lmdb.Error, msgspec.DecodeError) as error:
        return IndexState("damaged", f"{type(error).__name__}: {error}")


def check_index(path: Path, capacity: int, chunk_size: int, map_size: int, timeout_s: float = 600) -> IndexState:
    """`examine` in a child process: a crash or a hang there reads as damage."""
    if not (path / "data.mdb").exists():
        return IndexState("absent")
    root = str(Path(__file__).resolve().parents[2])  # the child imports this same kvfs
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "kvfs.disk.index_check", str(path), str(capacity), str(chunk_size),
               str(map_size)]
    try:
        child = subprocess.run(command, capture_output=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return IndexState("damaged", f"reading it did not finish in {timeout_s:.0f} s")
    if child.returncode < 0:
        return IndexState("damaged", f"reading it killed the reader with signal {-child.returncode}")
    try:
        return IndexState(**json.loads(child.stdout))
    except (ValueError, TypeError):
        error = child.stderr.decode(errors="replace").strip().splitlines()
        return IndexState("damaged", f"reading it failed ({error[-1] if error else f'exit {child.returncode}'})")


def main(argv: list[str]) -> int:
    path, capacity, chunk_size, map_size = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    print(json.dumps(asdict(examine(path, capacity, chunk_size, map_size))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
