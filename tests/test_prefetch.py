"""Prefetch at lookup: the gate that stops it when lookups are not followed by opens, and its bounds."""

from __future__ import annotations

from kvfs.node.prefetch import PrefetchGate


def test_the_gate_shuts_when_half_of_the_recent_prefetches_go_unclaimed_and_reopens_later() -> None:
    gate = PrefetchGate(window=8, pause_s=5.0)
    for _ in range(20):  # a loader claims what the lookups fetched
        gate.record(True, now=1.0)
    assert gate.allows(1.0) and gate.pauses == 0
    for claimed in [True, False] * 3 + [True]:  # 3 of the last 8 wasted: still open
        gate.record(claimed, now=2.0)
    assert gate.allows(2.0)
    gate.record(False, now=2.0)  # 4 of 8: `ls -l` or `find` looking names up without opening them
    assert not gate.allows(2.0) and not gate.allows(6.9) and gate.pauses == 1
    assert gate.allows(7.0)  # tried again after the pause, with a fresh window
    for _ in range(7):
        gate.record(False, now=7.0)
    assert gate.allows(7.0)  # a window must fill before the gate judges
    gate.record(False, now=7.0)
    assert not gate.allows(7.0) and gate.pauses == 2


def test_prefetches_are_bounded_claimed_once_and_dropped_when_stale() -> None:
    """The bookkeeping on a real store: a budget of chunk buffers, one claim per
    prefetch, unclaimed ones closed after the TTL (their buffers back in the pool)."""
    import trio
    import trio.testing

    from kvfs.clock import ManualClock
    from kvfs.node.prefetch import MAX_CHUNKS_HELD, TTL_S, Prefetches
    from kvfs.store.buffers import ReadBufferPool
    from kvfs.store.dram import DramTier
    from kvfs.store.tiered import TieredStore

    chunk = 1 << 20

    async def main() -> None:
        store = TieredStore(DramTier(16 * chunk, chunk_size=chunk), None, read_buffers=ReadBufferPool(64, chunk))
        clock = ManualClock()
        prefetches = Prefetches(store, clock.monotonic)
        owner_answers = trio.Event()

        async def slow_owner(source, start: int, stop: int) -> None:  # a transfer still on its way
            await owner_answers.wait()
            source.answered.set()
            for index in range(start, stop):
                source.ready[index].set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.run)
            await trio.testing.wait_all_tasks_blocked()
            started = []
            for version in range(1, 40):  # 2-chunk files: the budget holds MAX_CHUNKS_HELD / 2
                if prefetches.wanted(version, 2 * chunk):
                    prefetches.add(store.start_remote(version, 2 * chunk, slow_owner, 1))
                    started.append(version)
            assert started == list(range(1, MAX_CHUNKS_HELD // 2 + 1))
            assert not prefetches.wanted(1, 2 * chunk)  # already on its way
            source = prefetches.claim(3)
            assert source is not None and prefetches.claim(3) is None
            owner_answers.set()
            assert await store.remote_answered(source) is source
            store.close_read(source)
            clock.advance(TTL_S + 0.1)
            assert prefetches.wanted(100, 2 * chunk)  # the stale ones were dropped to make this check
            assert prefetches.wasted == len(started) - 1 and prefetches.claimed == 1
            await trio.testing.wait_all_tasks_blocked()  # their streams end and give the buffers back
            assert store.read_buffers.available == 64
            nursery.cancel_scope.cancel()

    trio.run(main)
