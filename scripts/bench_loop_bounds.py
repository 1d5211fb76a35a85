"""The longest the master's loop is blocked at scale: one request, or one slice of its
backlog, for registration, status, usage, a restart that lost files, and a dead node forgotten.

The pure `MetadataService` is loaded with N files (a saved state, as after a restart:
node "b" holds one in 1,000, "d" a fifth, "a" the rest, in a vLLM-like tree of models,
layers and blocks), then:

- `register_full`: node a registers again holding everything (Report pages of 2,000, Finish);
- `status` and `du`: a ClusterStatus and a DirUsage(files=True) request;
- `register_half`: a registers again with half its files (the rest was only in its DRAM):
  the longest Report, the FinishRegistration, and the longest slice of the removal after it;
- `reclaim_*`: Reclaim requests (16 files at most) for b's DRAM-only files and its files on
  SSD (spread through the policy's order among a's), a's DRAM-only files, and a node c that
  holds nothing (`nothing`: a walk of the whole order, before candidates were kept per node
  and tier);
- `remove_node`: RemoveNode of d (down since the restart), and the longest slice after it;
- `forget_dead`: a dies and stays silent past forget_dead_after_s: the expiry pass that
  forgets it, and the longest slice after it;
- `collect_orphans`: files/10 temp files being written (none an orphan), and CollectOrphans.

With --rename instead (`measure_rename`): a directory of N files on one node's SSD renamed,
the request's CPU ms and answer bytes, then the walk's steps and the heartbeats that hand
the versions to their node, and a registration's report of 2,000 stale records.

Slices of removal: `_slice_ms` is one step of the backlog; `_slice_save_ms` what the
daemon does between two turns for requests, the steps of its budget (kvfs.daemons.master's
SLICE_BUDGET_S) and the save of what they changed to lmdb, the state having been written
there first (`first_save_ms`; --no-save leaves the lmdb out), the two alternating.

Each figure is the longest single call in ms of CPU time (the thread's: a shared
machine's scheduler adds its waits to wall time). With --base DIR (a checkout of an older
commit, e.g. `git archive 0190e44 | tar -x -C DIR`), the same measurements run on that
tree too, rounds alternating between the two, and each line prints the ratio base/this.

Usage: python scripts/bench_loop_bounds.py [--files 1M] [--rounds 2] [--base DIR] [--rename | --growth]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PAGE = 2000  # versions per Report, as nodes send them
PASS_CPU_S = 0.25  # between two expiry passes in --growth (the daemon's come every 0.25 s)


def loaded_service(files: int, policy: str) -> tuple[Any, Any, int, float]:
    """The pure service of the tree under test loaded with N files, as after a restart (node
    "b" holds one in 1,000, "d" a fifth, "a" the rest): (service, its manual clock, the
    files, the load's CPU ms)."""
    import stat

    from kvfs.clock import ManualClock
    from kvfs.cluster.master import MasterSettings, MetadataService
    from kvfs.cluster.namespace import ROOT_INO, make_inode
    from kvfs.cluster.objects import FileVersion
    from kvfs.policy import make_policy

    clock = ManualClock()
    service = MetadataService(clock, make_policy(policy), MasterSettings(cluster=True, forget_dead_after_s=10.0))
    now = clock.wall_ns()
    inodes = [make_inode(ROOT_INO, stat.S_IFDIR | 0o755, 0, 0, now, now, now, children={})]
    versions = []
    ino = ROOT_INO + 1
    entry = 1

    def add(parent: int, name: bytes, directory: bool) -> int:
        nonlocal ino, entry
        inode = make_inode(ino, (stat.S_IFDIR | 0o755) if directory else (stat.S_IFREG | 0o644), 0, 0, now, now, now,
                           parent=parent, name=name, children={} if directory else None, entry_id=entry)
        inodes.append(inode)
        ino, entry = ino + 1, entry + 1
        return inode.ino

    per_dir = 1000
    made = 0
    for model in range(4):
        top = add(ROOT_INO, b"model-%d" % model, True)
        for layer in range(max(1, files // 4 // per_dir)):
            directory = add(top, b"layer-%04d" % layer, True)
            for block in range(per_dir):
                if made >= files:
                    break
                file_ino = add(directory, b"block-%06d.bin" % block, False)
                node = 2 if made % 1000 == 0 else 3 if made % 5 == 1 else 1  # b holds a few, d a fifth, a the rest
                version = FileVersion(made + 1, file_ino, node, 4096, sealed=True, checksums=[made],
                                      on_disk=made % 3 == 0)
                inodes[-1].version = version.version
                versions.append(version)
                made += 1
    started = time.thread_time()
    service.load(inodes, versions, ino, entry, made + 1, [(1, "a", "a:1"), (2, "b", "b:1"), (3, "d", "d:1")])
    loaded_ms = (time.thread_time() - started) * 1000  # (a restart's, before the master serves)
    return service, clock, made, loaded_ms


def measure(files: int, state_dir: str | None = None, policy: str = "reuse") -> dict[str, float]:
    """Runs in a child process whose kvfs is the tree under test. With `state_dir`, the
    state is written to lmdb there first, and each slice of removal is the daemon's (its
    budget's steps, then the save of what they changed, kvfs.daemons.master)."""
    from kvfs.cluster.namespace import ROOT_INO
    from kvfs.wire import messages as m

    service, clock, made, loaded_ms = loaded_service(files, policy)
    gc.freeze()  # as the master daemon does (kvfs.daemons.master): no full collection walks the namespace

    out: dict[str, float] = {"files": made, "load_ms": loaded_ms}
    state = None
    if state_dir is not None:
        from kvfs.cluster.persist import MasterState
        from kvfs.daemons.master import SLICE_BUDGET_S

        state = MasterState(Path(state_dir))
        service.ns.dirty.update(service.ns.inodes)  # (everything, as a master that served them wrote it)
        service.objects.dirty.update(service.objects.versions)
        service.registry.dirty = True
        started = time.thread_time()
        state.save(service)
        out["first_save_ms"] = (time.thread_time() - started) * 1000

    # The cyclic collector's passes land in whichever call allocates at the wrong moment: their
    # time is taken out of that call and listed on its own (the daemon freezes the heap as it
    # grows, kvfs.daemons.master; what a pass still walks is what was made since).
    collecting = {"since": 0.0, "in_calls": 0.0}

    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            collecting["since"] = time.thread_time()
        else:
            spent = time.thread_time() - collecting["since"]
            collecting["in_calls"] += spent
            key = f"gc_gen{info['generation']}_ms"
            out[key] = max(out.get(key, 0.0), spent * 1000)

    gc.callbacks.append(on_collection)

    def timed(key: str, call) -> object:
        # CPU time of this thread: what the call costs the loop, without the waits of a shared
        # machine's scheduler (which would make every "longest" a preemption).
        collecting["in_calls"] = 0.0
        started = time.thread_time()
        result = call()
        spent = time.thread_time() - started - collecting["in_calls"]
        out[key] = max(out.get(key, 0.0), spent * 1000)
        return result

    def held_of(node: int) -> list[int]:
        return [v.version for v in service.objects.of_node(node)]

    def page(ids: list[int]) -> list:  # (made per page, as a node sends them: no million objects alive)
        versions = service.objects.versions
        return [m.Held(v.version, v.size, True, v.on_disk, 0, v.checksums) for v in map(versions.__getitem__, ids)]

    def save() -> None:
        if state is not None:
            state.save(service)

    def slices(key: str) -> None:
        """The backlog's work: one step per call (`_slice_ms`); with a state, the daemon's
        slices too (`_slice_save_ms`: its budget's steps, then the save), alternately."""
        daemon = False
        while True:
            if daemon:
                left = timed(f"{key}_slice_save_ms", lambda: (service.pending_work(SLICE_BUDGET_S), save())[0])
            else:
                left = timed(f"{key}_slice_ms", lambda: service.pending_work(0.0))
                save()
            if not left:
                break
            daemon = state is not None and not daemon

    def register(name: str, held: list[int], key: str) -> int:
        node = service.handle(m.Register(name, f"{name}:1"), 0).node
        save()
        for start in range(0, len(held), PAGE):
            report = m.Report(page(held[start:start + PAGE]))
            timed(f"{key}_report_ms", lambda: service.handle(report, node))
            save()
        timed(f"{key}_finish_ms", lambda: service.handle(m.FinishRegistration(), node))
        save()
        slices(key)
        return node

    b_node = register("b", held_of(2), "register_b")
    a_held = held_of(1)
    a_node = register("a", a_held, "register_full")
    for _ in range(3):
        timed("status_ms", lambda: service.handle(m.ClusterStatus(), 0))
        timed("du_ms", lambda: service.handle(m.DirUsage(files=True), 0))
    # Reclaims (16 files at most each): b's DRAM-only files, spread through the order among a's;
    # b's on SSD; a's DRAM-only; and c, a node holding nothing evictable (the worst case of a
    # walk through the whole order).
    c_node = register("c", [], "register_c")
    for node, tier, key in [(b_node, "dram", "b_dram"), (b_node, "disk", "b_disk"), (a_node, "dram", "a_dram"),
                            (c_node, "dram", "nothing")]:
        timed(f"reclaim_{key}_ms", lambda: service.handle(m.Reclaim(node, 16 * 4096, tier), node))
        save()
    a_held = held_of(1)  # (less what a's reclaim took)
    register("a", a_held[::2], "register_half")
    del a_held
    for _ in range(3):
        timed("status_after_ms", lambda: service.handle(m.ClusterStatus(), 0))
        timed("du_after_ms", lambda: service.handle(m.DirUsage(files=True), 0))

    # d (down since the restart) is removed by an operator.
    timed("remove_node_ms", lambda: service.handle(m.RemoveNode("d"), 0))
    save()
    slices("remove_node")

    # a falls silent for good; b heartbeats; the expiry passes run every 0.25 s.
    forgotten = False
    for _ in range(200):
        clock.advance(0.25)
        service.handle(m.Heartbeat(0, 0), b_node)
        timed("forget_dead_pass_ms", service.expire_nodes)
        if "a" not in service.registry.by_name:
            forgotten = True
            break
        save()
    assert forgotten and a_node not in service.registry.nodes
    timed("forget_dead_pass_save_ms", save)
    slices("forget_dead")
    # A writer that never renames: temp files, being written (none an orphan); b asks for orphans.
    temp_dir = service.handle(m.MkDir(ROOT_INO, b"temp", 0o755, 0, 0), b_node).ino
    for i in range(max(1, files // 10)):
        service.handle(m.Create(temp_dir, b"k%07d.tmp" % i, 0o644, 0, 0, b_node, True), b_node)
    save()
    for _ in range(3):
        timed("collect_orphans_ms", lambda: service.handle(m.CollectOrphans(), b_node))
    out["files_left"] = service.ns.files
    if state is not None:
        state.close()
    return out


def measure_rename(files: int, policy: str = "reuse") -> dict[str, float]:
    """A directory holding N files, sealed and on node a's SSD, renamed (`--rename`): the
    Rename's CPU ms and its answer's bytes (the old answer listed every version); then what
    follows it in a tree that walks the subtree in the backlog (kvfs.cluster.relocations):
    the longest step and all steps, and the heartbeats that hand the versions to the node
    (the longest, its answer's bytes, how many); and a registration's Report page of 2,000
    files whose records name the old path (the check that finds them stale), then the new."""
    import stat

    import msgspec

    from kvfs.clock import ManualClock
    from kvfs.cluster.master import MasterSettings, MetadataService
    from kvfs.cluster.namespace import ROOT_INO, make_inode
    from kvfs.cluster.objects import FileVersion
    from kvfs.policy import make_policy
    from kvfs.wire import messages as m

    clock = ManualClock()
    service = MetadataService(clock, make_policy(policy), MasterSettings(cluster=True))
    now = clock.wall_ns()
    top = ROOT_INO + 1
    inodes = [make_inode(ROOT_INO, stat.S_IFDIR | 0o755, 0, 0, now, now, now, children={}),
              make_inode(top, stat.S_IFDIR | 0o755, 0, 0, now, now, now, parent=ROOT_INO, name=b"model",
                         children={}, entry_id=1)]
    versions = []
    for i in range(files):
        inode = make_inode(top + 1 + i, stat.S_IFREG | 0o644, 0, 0, now, now, now, parent=top,
                           name=b"block-%07d.bin" % i, children=None, entry_id=2 + i)
        inode.version = i + 1
        inodes.append(inode)
        versions.append(FileVersion(i + 1, inode.ino, 1, 4096, sealed=True, checksums=[i], on_disk=True))
    service.load(inodes, versions, top + 1 + files, 2 + files, files + 1, [(1, "a", "a:1")])
    del inodes, versions
    node = service.handle(m.Register("a", "a:1"), 0).node
    for start in range(0, files, PAGE):
        service.handle(m.Report([m.Held(v, 4096, True, True, 0, [v - 1]) for v in range(start + 1,
                                                                                       min(files, start + PAGE) + 1)]),
                       node)
    service.handle(m.FinishRegistration(), node)
    service.pending_work(60.0)
    gc.freeze()
    out: dict[str, float] = {"files": files}
    steps = service.backlog.steps
    started = time.thread_time()
    done = service.handle(m.Rename(ROOT_INO, b"model", ROOT_INO, b"moved", False), node)
    out["rename_ms"] = (time.thread_time() - started) * 1000
    out["rename_answer_bytes"] = len(msgspec.msgpack.encode(done))
    out["rename_relocated_in_answer"] = len(done.relocated)
    longest = total = 0.0
    while True:
        started = time.thread_time()
        left = service.pending_work(0.0)
        spent = time.thread_time() - started
        longest, total = max(longest, spent), total + spent
        if not left:
            break
    out["walk_steps"] = service.backlog.steps - steps
    out["walk_longest_step_ms"] = longest * 1000
    out["walk_total_ms"] = total * 1000
    beats = 0
    longest = 0.0
    largest = 0
    while True:
        started = time.thread_time()
        beat = service.handle(m.Heartbeat(1 << 30, 0), node)
        longest = max(longest, time.thread_time() - started)
        largest = max(largest, len(msgspec.msgpack.encode(beat)))
        if not getattr(beat, "relocated", None):
            break
        beats += 1
    out["beats_carrying"] = beats
    out["beat_longest_ms"] = longest * 1000
    out["beat_largest_bytes"] = largest
    # A registration reporting records under the old path (as after a restart before the rewrite).
    service.handle(m.Register("a", "a:1"), 0)
    report = m.Report([m.Held(v, 4096, True, True, 0, [v - 1],
                              m.FileRecord([b"model", b"block-%07d.bin" % (v - 1)], 4096, 0o100644, 0, 0, now, {}))
                       for v in range(1, min(files, PAGE) + 1)])
    started = time.thread_time()
    service.handle(report, node)
    out["report_stale_page_ms"] = (time.thread_time() - started) * 1000
    for held in report.held:  # the same page once the records were rewritten (the common case)
        held.record.path[0] = b"moved"
    service.handle(m.Register("a", "a:1"), 0)
    started = time.thread_time()
    service.handle(report, node)
    out["report_current_page_ms"] = (time.thread_time() - started) * 1000
    return out


def measure_growth(files: int, policy: str = "reuse") -> dict[str, float]:
    """The cyclic collector's passes while the namespace grows and churns (`--growth`), in a
    child process whose kvfs is the tree under test. Loaded with N files and frozen as the
    daemon does at its first expiry pass, node a registers holding them all (`register`),
    then writes N*3/10 new files (`grow`), then N*3/10 more while it reclaims as many
    (`churn`: the same count of files, every new one made since the load). An expiry pass,
    where the daemon decides whether to freeze the heap (`keep_heap_out_of_full_collections`),
    comes after each 0.25 s of CPU. Figures: each phase's longest full pass and their
    number, the longest young pass, the longest request with the passes in it (CPU ms), the
    longest expiry pass, the freezes, and the objects of reference cycles that died frozen
    (a leak: found by a collection after `gc.unfreeze()`, once a collection of what was not
    frozen took the rest)."""
    from kvfs.cluster.namespace import ROOT_INO
    from kvfs.daemons.master import keep_heap_out_of_full_collections
    from kvfs.wire import messages as m

    service, clock, made, loaded_ms = loaded_service(files, policy)
    frozen = keep_heap_out_of_full_collections(service, -1)  # (the collector's state as the load left it)
    out: dict[str, float] = {"files": made, "load_ms": loaded_ms, "freezes": 0}
    phase = "register"
    passes: list[tuple[str, int, float]] = []
    started_pass = [0.0]

    def on_collection(stage: str, info: dict) -> None:
        if stage == "start":
            started_pass[0] = time.thread_time()
        else:
            passes.append((phase, info["generation"], (time.thread_time() - started_pass[0]) * 1000))

    last_pass = time.thread_time()

    def call(request: Any, node: int) -> Any:
        nonlocal frozen, last_pass
        started = time.thread_time()
        result = service.handle(request, node)
        out["request_with_gc_ms"] = max(out.get("request_with_gc_ms", 0.0), (time.thread_time() - started) * 1000)
        if time.thread_time() - last_pass >= PASS_CPU_S:
            before = frozen
            last_pass = time.thread_time()
            frozen = keep_heap_out_of_full_collections(service, frozen)
            out["expiry_pass_ms"] = max(out.get("expiry_pass_ms", 0.0), (time.thread_time() - last_pass) * 1000)
            out["freezes"] += frozen != before
        return result

    gc.callbacks.append(on_collection)
    node = call(m.Register("a", "a:1"), 0).node
    held = [v.version for v in service.objects.of_node(1)]
    versions = service.objects.versions
    for start in range(0, len(held), PAGE):
        page = [m.Held(v.version, v.size, True, v.on_disk, 0, v.checksums)
                for v in map(versions.__getitem__, held[start:start + PAGE])]
        call(m.Report(page), node)
    del held, page
    call(m.FinishRegistration(), node)
    while service.pending_work(0.0):
        pass
    count = files * 3 // 10
    directory = 0
    for i in range(2 * count):
        phase = "grow" if i < count else "churn"
        if i % 1000 == 0:
            directory = call(m.MkDir(ROOT_INO, b"new-%04d" % (i // 1000), 0o755, 0, 0), node).ino
        opened = call(m.Create(directory, b"block-%06d.bin" % (i % 1000), 0o644, 0, 0, node, True), node)
        call(m.Seal(opened.version, 4096, clock.wall_ns(), [i], release=True), node)
        if i >= count and i % 16 == 15:  # churn: as many files evicted as written
            call(m.Reclaim(node, 16 * 4096, "dram"), node)
    gc.callbacks.remove(on_collection)
    out["files_left"] = service.ns.files
    for name in ("register", "grow", "churn"):
        full = [ms for where, generation, ms in passes if where == name and generation == 2]
        out[f"{name}_gc_full_passes"] = len(full)
        out[f"{name}_gc_full_ms"] = max(full, default=0.0)
    out["gc_young_ms"] = max((ms for _, generation, ms in passes if generation < 2), default=0.0)
    gc.collect()
    out["frozen_objects"] = gc.get_freeze_count()
    gc.unfreeze()
    out["leaked_cycle_objects"] = gc.collect()
    return out


def child(tree: Path, files: int, save: bool, policy: str, growth: bool = False, rename: bool = False
          ) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    with tempfile.TemporaryDirectory(prefix="bench-loop-bounds-") as scratch:
        state = repr(scratch) if save else "None"
        code = (f"import sys, json; sys.path.insert(0, {str(tree)!r}); "
                f"sys.path.insert(1, {str(REPO / 'scripts')!r}); "
                f"import bench_loop_bounds as b; print(json.dumps("
                + (f"b.measure_growth({files}, {policy!r})" if growth else
                   f"b.measure_rename({files}, {policy!r})" if rename else f"b.measure({files}, {state}, {policy!r})")
                + "))")
        done = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tree), check=True, capture_output=True,
                              text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": 1000, "M": 1000_000}.get(text[-1:], 1)
    return int(float(text.rstrip("KM")) * scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default="1M")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--base", type=Path, help="an older tree to compare with, in alternating rounds")
    parser.add_argument("--no-save", action="store_true", help="no lmdb state: steps only, no daemon slices")
    parser.add_argument("--policy", default="reuse", help="the master's eviction policy (its default: reuse)")
    parser.add_argument("--growth", action="store_true", help="the collector's passes as the namespace grows and "
                        "churns (measure_growth), instead of the loop's longest calls")
    parser.add_argument("--rename", action="store_true", help="a directory of N files on SSD renamed: the request, "
                        "its answer, and the walk and heartbeats after it (measure_rename)")
    args = parser.parse_args()
    files = parse_count(args.files)
    trees = {"this": REPO} if args.base is None else {"base": args.base.resolve(), "this": REPO}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for round_ in range(args.rounds):
        order = list(trees.items()) if round_ % 2 == 0 else list(reversed(trees.items()))
        for name, tree in order:
            results[name].append(child(tree, files, not args.no_save, args.policy, args.growth, args.rename))
            print(f"round {round_ + 1}: {name} done", file=sys.stderr)
    keys = list(dict.fromkeys(key for r in results["this"] for key in r
                              if key.endswith("_ms") or args.growth or args.rename))
    print(f"files: {int(results['this'][0]['files'])}; longest single call (CPU ms), median of {args.rounds} rounds")
    for key in keys:
        this = statistics.median(r.get(key, 0.0) for r in results["this"])
        line = f"{key:<28} this {this:10.2f}"
        if "base" in results:
            base = statistics.median(r.get(key, 0.0) for r in results["base"])
            line += f"   base {base:10.2f}   base/this {base / this if this else float('inf'):8.1f}"
        if args.rename:  # (every round's range: a shared machine's figures vary)
            line += "   range " + "  ".join(f"{name} {min(r.get(key, 0.0) for r in rounds):.2f}-"
                                            f"{max(r.get(key, 0.0) for r in rounds):.2f}"
                                            for name, rounds in results.items())
        print(line)


if __name__ == "__main__":
    main()
