"""A forecaster that falls behind skips ahead to now instead of catching up tick by tick:
the schedule (pure), and the actor on a real nats-server at a time scale it cannot keep up
with, started 40 model seconds into a recorded log."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.base.clock import ScaledClock, wall_now_s
from actors.config import ForecasterSection
from actors.forecaster.actor import ForecasterActor, decode_cost, due_tick, prefill_cost
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.forecast import DemandForecast
from forecasting.synthetic import synthetic_events
from tests.actor_helpers import at_scale

TICK_S = 1.0
WATERMARK_S = 1.0


def test_due_tick_is_the_latest_whose_watermark_passed():
    assert due_tick(1, now_s=2.0, tick_s=1.0, watermark_s=1.0) == 1  # on time: no skip
    assert due_tick(1, now_s=2.99, tick_s=1.0, watermark_s=1.0) == 1
    assert due_tick(1, now_s=41.5, tick_s=1.0, watermark_s=1.0) == 40  # 39 ticks late: skip to 40
    assert due_tick(7, now_s=3.0, tick_s=2.0, watermark_s=0.0) == 7  # never before the next one
    assert due_tick(1, now_s=30.0, tick_s=2.5, watermark_s=5.0) == 10  # 10 * 2.5 + 5 = 30


@pytest.mark.bus
async def test_a_forecaster_far_behind_stays_within_one_tick_of_the_clock_and_stops_promptly(bus, tiny_config):
    scale = 500.0  # 1 model s = 2 ms wall: a lifecycle tick takes longer than that
    forecaster_cfg = ForecasterSection(model="lifecycle", bin_s=1.0, tick_s=TICK_S, horizons_s=[1.0, 5.0], watermark_s=WATERMARK_S)
    config = at_scale(msgspec.structs.replace(tiny_config, forecaster=forecaster_cfg), scale)
    events = synthetic_events(30, seed=3, spread_s=20.0, max_turns=6, min_turns=2)
    js = bus.jetstream()
    acks = [await js.publish_async(subjects.lifecycle(e.kind.value), encode(e)) for e in events]
    await asyncio.gather(*acks)  # every event is in the LIFECYCLE stream
    clock = ScaledClock(scale, origin_wall_s=wall_now_s() - 40.0 / scale)  # 40 model s into the run
    published: list[DemandForecast] = []
    enough = asyncio.Event()

    async def on_forecast(msg) -> None:
        published.append(decode(DemandForecast, msg.data))
        if published[-1].events_total == len(events) and len(published) >= 15:  # all read, and ticking on
            enough.set()

    await bus.subscribe(subjects.forecast(), cb=on_forecast)
    await bus.flush()
    forecaster = ForecasterActor("fc", config, bus, clock)
    running = asyncio.create_task(forecaster.run())
    await asyncio.wait_for(enough.wait(), timeout=60)
    forecaster.request_stop("test over")
    ticks_at_stop = forecaster.ticks
    await asyncio.wait_for(running, timeout=30)
    assert forecaster.ticks <= ticks_at_stop + 1, "kept computing ticks after the stop request"
    assert forecaster.counters["slow_stops"] == 0
    await bus.flush()

    assert published[0].as_of_s >= 38.0, "the first tick did not skip ahead to now"
    assert published[-1].skipped_ticks == forecaster.skipped_ticks > 0
    for before, after in zip(published, published[1:]):
        # each tick is the latest one due when the previous one was done: within one tick of the clock
        assert after.as_of_s > before.computed_at_s - WATERMARK_S - TICK_S, (before, after)
        # and every tick time passed over is counted as skipped
        skipped = after.skipped_ticks - before.skipped_ticks
        assert after.as_of_s - before.as_of_s == pytest.approx(TICK_S * (1 + skipped))
    assert forecaster.max_lag_s < TICK_S
    # its prefill engine-seconds state what they are priced at: the prefill engines' costs
    cost = prefill_cost(config)
    assert cost.per_token_pair_s > 0
    assert (published[-1].prefill_cost_per_token_s, published[-1].prefill_cost_per_token_pair_s) == (
        cost.per_token_s,
        cost.per_token_pair_s,
    )
    # and its decode engine-seconds the decode engines'
    cost = decode_cost(config)
    assert cost.per_token_pair_s > 0
    assert (published[-1].decode_cost_per_token_s, published[-1].decode_cost_per_token_pair_s) == (cost.per_token_s, cost.per_token_pair_s)
