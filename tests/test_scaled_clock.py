"""A live clock counts what a real-time check needs to tell a slow machine from a wrong result."""

from __future__ import annotations

import asyncio
import time

from actors.base.clock import PROBE_WALL_S, STALL_WALL_S, ScaledClock

BLOCK_WALL_S = 0.5  # a blocked loop: far past a probe's period and the stall threshold, and past any scheduler hiccup


async def test_a_blocked_event_loop_counts_as_a_stall_in_model_seconds():
    """A loaded machine may add stalls of its own, so the test counts what the block adds: at
    least one stall, as long in model seconds as the block (less a probe period) and no
    longer than the block plus a generous margin."""
    clock = ScaledClock(time_scale=5.0)
    watch = asyncio.create_task(clock.watch_loop())
    try:
        await asyncio.sleep(2 * PROBE_WALL_S)  # barrier-ok: wall time is what the probe measures; the probe is running
        stalls, stall_s = clock.loop_stalls, clock.loop_stall_s
        time.sleep(BLOCK_WALL_S)  # barrier-ok: the stimulus, a loop that does not run (a CPU hog, a blocking call)
        await asyncio.sleep(2 * PROBE_WALL_S)  # barrier-ok: one probe period past the block; it wakes late
        assert clock.loop_stalls - stalls >= 1
        added_s = clock.loop_stall_s - stall_s
        assert 5.0 * (BLOCK_WALL_S - PROBE_WALL_S - STALL_WALL_S) <= added_s <= 5.0 * (BLOCK_WALL_S + 1.0)
    finally:
        watch.cancel()


async def test_a_timed_wait_that_wakes_late_is_counted():
    clock = ScaledClock(time_scale=10.0)
    wait = asyncio.create_task(clock.sleep(0.1))  # barrier-ok: the timed wait under test, 10 ms of wall time
    await asyncio.sleep(0)  # barrier-ok: one yield, so the wait arms its timer before the loop is blocked (no event marks that)
    time.sleep(0.05)  # barrier-ok: the stimulus, the loop blocked past the wait's wake-up
    await wait
    assert clock.late_wakeups == 1 and clock.late_s > 10.0 * 0.03
