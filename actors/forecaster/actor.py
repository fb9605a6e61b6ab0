"""The forecaster actor: the lifecycle stream in, a DemandForecast out every tick.

    LIFECYCLE stream ──(own ephemeral consumer, from the start)──▶ buffer of events
    every tick_s:  wait until now >= tick + watermark_s, take the buffered events before
                   the tick ──▶ forecasting.core.ForecastCore.tick ──▶ prorsa.forecast

The tick is the same code the replay runner drives (runners.replay), so on the same log
the forecasts are the same numbers. An event that arrives after its tick was computed
(later than the watermark) is counted as late and goes into the next tick.
"""

from __future__ import annotations

import asyncio

from nats.js import api

from actors.base import Actor
from bus_schemas import streams, subjects
from bus_schemas.codec import encode
from bus_schemas.forecast import DemandForecast, TargetForecast
from bus_schemas.lifecycle import LifecycleEvent
from forecasting.core import CoreConfig, ForecastCore, TickResult
from forecasting.models import QUANTILES, TARGETS
from bus_schemas.eventlog import events_frame

FETCH_BATCH = 2000
FETCH_WAIT_WALL_S = 0.1


class ForecasterActor(Actor):
    kind = "forecaster"

    def __init__(self, actor_id, config, nc, clock) -> None:
        super().__init__(actor_id, config, nc, clock)
        fc = config.forecaster
        self.core = ForecastCore(CoreConfig(models=(fc.model,), bin_s=fc.bin_s, horizons_s=tuple(fc.horizons_s)))
        self.buffer: list[LifecycleEvent] = []
        self.ticks = 0
        self.late_events = 0
        self.last_event_s = 0.0
        self._drained = asyncio.Event()  # the consumer had nothing pending at the last fetch

    async def setup(self) -> None:
        config = api.ConsumerConfig(
            ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL, inactive_threshold=60.0
        )
        self._sub = await self.js.pull_subscribe(subjects.lifecycle_all(), stream=streams.LIFECYCLE.name, config=config)

    async def serve(self, burst: bool) -> None:
        self.spawn(self._consume(), "consume")
        fc = self.config.forecaster
        while not self.stopping.is_set():
            until_s = fc.tick_s * (self.ticks + 1)
            if burst:
                await self._drained.wait()
                if until_s > self.last_event_s + fc.tick_s:
                    return
            else:
                await self.clock.sleep_until(until_s + fc.watermark_s)
            await self._tick(until_s)
            await asyncio.sleep(0)  # let the consumer run between catch-up ticks

    async def _consume(self) -> None:
        while True:
            try:
                msgs = await self._sub.fetch(FETCH_BATCH, timeout=FETCH_WAIT_WALL_S)
            except TimeoutError:
                self._drained.set()
                continue
            self._drained.clear()
            for msg in msgs:
                event = self.decode_or_count(LifecycleEvent, msg)
                if event is not None:
                    self._take(event)

    def _take(self, event: LifecycleEvent) -> None:
        if event.at_s < self.core.end_s:
            self.late_events += 1
            self.counters["late_events"] += 1
        self.buffer.append(event)
        self.last_event_s = max(self.last_event_s, event.at_s)

    async def _tick(self, until_s: float) -> None:
        due = [e for e in self.buffer if e.at_s < until_s]
        self.buffer = [e for e in self.buffer if e.at_s >= until_s]
        result = self.core.tick(events_frame(due), until_s)
        self.ticks += 1
        self.counters["ticks"] += 1
        message = self._message(result)
        if message.fallback:
            self.counters["fallbacks"] += 1
        if message.fallback and (message.fallbacks_total in (1, 10, 100) or message.fallbacks_total % 1000 == 0):
            self.log.warning("tick %.1f s: %s fell back to naive (%d ticks so far): %s", until_s, message.model, message.fallbacks_total, message.fallback_reason)
        await self.nc.publish(subjects.forecast(), encode(message))

    def _message(self, result: TickResult) -> DemandForecast:
        fc = self.config.forecaster
        outcome = result.outcomes[fc.model]
        index = self.core.config.horizon_index()
        p = outcome.prediction
        targets = [
            TargetForecast(
                target=t,
                mean=[float(p.mean[t][i]) for i in index],
                quantile_levels=list(QUANTILES),
                quantiles=[[float(p.quantiles[t][q, i]) for i in index] for q in range(len(QUANTILES))],
            )
            for t in TARGETS
        ]
        return DemandForecast(
            forecaster_id=self.actor_id,
            model=fc.model,
            tick=self.ticks,
            as_of_s=result.as_of_s,
            computed_at_s=self.clock.now_s(),
            bin_s=fc.bin_s,
            horizons_s=list(fc.horizons_s),
            targets=targets,
            live_trajectories=result.live_trajectories,
            events_total=result.events_total,
            fallback=bool(outcome.fallback_reason),
            fallback_reason=outcome.fallback_reason,
            fallbacks_total=outcome.fallbacks_total,
            late_events=self.late_events,
        )
