"""Live equals replay: a real run on the bus with the forecaster actor listening; the
forecasts it published equal, tick by tick, what the replay runner computes from the
exported log."""

from __future__ import annotations

import asyncio
import time

import msgspec
import numpy as np
import pytest

from actors.config import ForecasterSection
from actors.engine.actor import EngineActor
from actors.environment.actor import EnvironmentActor
from actors.forecaster.actor import ForecasterActor, decode_cost, prefill_cost
from actors.trainer.actor import TrainerActor
from bus_schemas import streams, subjects
from bus_schemas.codec import decode
from bus_schemas.control import Role
from bus_schemas.forecast import DemandForecast
from bus_schemas.lifecycle import LifecycleEvent
from forecasting.core import CoreConfig
from ops.export import check_events, events_frame, read_stream
from runners.replay import replay
from tests.actor_helpers import at_scale, clock_for
from tests.realtime import KEPT_UP_SHARE

pytestmark = pytest.mark.bus

TIME_SCALE = 20.0


async def test_forecasts_published_live_equal_the_replay_of_the_exported_log(bus, tiny_config):
    forecaster_cfg = ForecasterSection(model="hybrid", bin_s=1.0, tick_s=2.0, horizons_s=[2.0, 6.0, 10.0], watermark_s=10.0)
    config = at_scale(msgspec.structs.replace(tiny_config, forecaster=forecaster_cfg), TIME_SCALE)
    clock = clock_for(config)
    published: list[DemandForecast] = []

    async def on_forecast(msg) -> None:
        published.append(decode(DemandForecast, msg.data))

    await bus.subscribe(subjects.forecast(), cb=on_forecast)
    await bus.flush()
    forecaster = ForecasterActor("fc", config, bus, clock)
    engines = [EngineActor(e, config, bus, clock, Role.COLOCATED) for e in config.engine_ids()]
    others = [*engines, EnvironmentActor("env0", config, bus, clock)]
    trainer = TrainerActor("trainer", config, bus, clock)
    running = [asyncio.create_task(a.run()) for a in (forecaster, *others)]
    await asyncio.wait_for(trainer.run(), timeout=120)  # the run: every step done
    for actor in others:
        actor.request_stop("run over")
    await asyncio.wait_for(asyncio.gather(*running[1:]), timeout=30)
    events = check_events(events_frame(await read_stream(bus.jetstream(), streams.LIFECYCLE, subjects.lifecycle_all(), LifecycleEvent)))
    last_tick_s = (int(events["at_s"].max() // 2.0) + 1) * 2.0
    give_up = time.monotonic() + 60.0
    while forecaster.core.end_s < last_tick_s:  # the forecaster's ticks catch up with the log's end
        assert time.monotonic() < give_up, f"forecaster stuck at {forecaster.core.end_s} s of {last_tick_s} s after 60 s wall"
        await asyncio.sleep(0.1)  # barrier-ok: polls the forecaster's progress; it has no per-tick event to await
    forecaster.request_stop("test over")
    await asyncio.wait_for(running[0], timeout=30)
    await bus.flush()

    core_config = CoreConfig(
        models=("hybrid",), bin_s=1.0, horizons_s=(2.0, 6.0, 10.0), prefill_cost=prefill_cost(config), decode_cost=decode_cost(config)
    )
    results, _ = replay(events, core_config, tick_s=2.0)
    live = {f.as_of_s: f for f in published}
    if published[-1].skipped_ticks:  # the forecaster fell a whole tick behind the clock and skipped ahead
        lost_s = clock.late_s + clock.loop_stall_s + sum(e.counters["lag_ms"] for e in engines) / 1e3  # as tests/realtime.py counts it
        pytest.xfail(
            f"machine too loaded: the forecaster skipped {published[-1].skipped_ticks} ticks ({lost_s:.2f} model s lost to lateness)"
        )
    assert [r.as_of_s for r in results] == sorted(live)[: len(results)], "a tick was not published"
    late = published[-1].late_events
    if late:  # an event came in after its tick's watermark (10 model s = 0.5 s wall): did the machine keep up?
        lost_s = clock.late_s + clock.loop_stall_s + sum(e.counters["lag_ms"] for e in engines) / 1e3  # as tests/realtime.py counts it
        if lost_s > KEPT_UP_SHARE * float(events["at_s"].max()):
            pytest.xfail(f"machine too loaded: {late} late events; actors lost {lost_s:.2f} model s to lateness")
        raise AssertionError(f"{late} events arrived after their tick's watermark while the machine kept up ({lost_s:.2f} model s lost)")
    assert sum(not live[r.as_of_s].fallback for r in results) > len(results) // 2  # the model itself, mostly
    index = [1, 5, 9]  # horizons 2, 6, 10 s in 1 s bins
    for r in results:
        message = live[r.as_of_s]
        outcome = r.outcomes["hybrid"]
        assert message.fallback == bool(outcome.fallback_reason) and message.fallbacks_total == outcome.fallbacks_total
        assert message.live_trajectories == r.live_trajectories and message.events_total == r.events_total
        for target in message.targets:
            replayed = outcome.prediction.mean[target.target][index]
            assert np.allclose(target.mean, replayed, rtol=1e-9, atol=1e-9), (r.as_of_s, target.target)
            assert np.allclose(target.quantiles, outcome.prediction.quantiles[target.target][:, index], rtol=1e-9, atol=1e-9)
            # the window: every bin up to each horizon (a prefill's compute as asked for)
            every_bin = outcome.prediction.asked.get(target.target, outcome.prediction.mean[target.target])
            windows = [float(np.mean(every_bin[: i + 1])) for i in index]
            assert np.allclose(target.window_mean, windows, rtol=1e-9, atol=1e-9), (r.as_of_s, target.target)
