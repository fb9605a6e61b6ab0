"""Stopping background tasks that swallow a cancellation (actors/base/tasks.py): Python 3.11's
wait_for, under every nats-py request, can lose a cancel that lands as the reply arrives."""

from __future__ import annotations

import asyncio
import logging

from actors.base.tasks import cancel_and_wait, stop_if_cancelled

LOG = logging.getLogger("test.tasks")
FOREVER_S = 3600.0


async def swallows(times: int, polls: bool = False) -> None:
    """Waits for ever; the first `times` cancellations are swallowed, as the race does."""
    swallowed = 0
    while True:
        try:
            await asyncio.sleep(FOREVER_S)  # barrier-ok: a wait that only a cancel ends
        except asyncio.CancelledError:
            if swallowed == times:
                raise
            swallowed += 1
            if polls:
                stop_if_cancelled()


async def test_a_task_that_swallows_one_cancel_is_cancelled_again_and_stops():
    task = asyncio.create_task(swallows(1), name="swallows-once")
    await asyncio.sleep(0)  # barrier-ok: a yield, so the task starts before it is cancelled
    assert await cancel_and_wait([task], LOG) == []
    assert task.cancelled()


async def test_a_task_that_never_stops_is_named_not_waited_for(caplog):
    stubborn = asyncio.create_task(swallows(10), name="stubborn")
    quiet = asyncio.create_task(swallows(0), name="quiet")
    await asyncio.sleep(0)  # barrier-ok: a yield, so the task starts before it is cancelled
    assert await cancel_and_wait([stubborn, quiet], LOG, timeout_s=0.2) == ["stubborn"]
    assert quiet.cancelled() and not stubborn.done()
    assert "task stubborn did not stop when cancelled (twice)" in caplog.text
    stubborn.cancel()  # its last swallow: tidy up
    while not stubborn.done():
        stubborn.cancel()
        await asyncio.sleep(0)  # barrier-ok: a yield, so the cancel is delivered


async def test_a_polling_loop_stops_on_a_cancel_its_call_swallowed():
    task = asyncio.create_task(swallows(10, polls=True), name="polls")
    await asyncio.sleep(0)  # barrier-ok: a yield, so the task starts before it is cancelled
    task.cancel()  # swallowed by the "request", then seen by stop_if_cancelled
    done, _ = await asyncio.wait([task], timeout=5.0)
    assert task in done and task.cancelled()
