"""The forecaster actor: the lifecycle stream in, a DemandForecast out every tick.

    LIFECYCLE stream ──(own ephemeral consumer, from the start)──▶ buffer of events
    every tick_s:  wait until now >= tick + watermark_s, take the buffered events before
                   the tick ──▶ forecasting.core.ForecastCore.tick ──▶ prorsa.forecast

With `forecaster.prior_log`, the per-family statistics start from an earlier run's log
(`LiveState.learn_from`). The tick is the same code the replay runner drives (runners.replay), so on the same log
the forecasts are the same numbers. An event that arrives after its tick was computed
(later than the watermark) is counted as late and goes into the next tick.

A forecaster that falls behind (a tick that took longer than tick_s, a busy machine, a high
time scale) never catches up tick by tick: it skips ahead to the latest tick already due
(`due_tick`) and computes that one over all the bins since the last, counting the ticks it
skipped (`skipped_ticks` in the counters and in every DemandForecast). So it is always
within one tick of the clock, and a stop request is seen after at most one tick. While
behind it yields the loop as long as each tick took (at most half a core; the consumer
keeps reading the log).
"""

from __future__ import annotations

import asyncio

from nats.js import api

from actors.base import Actor
from bus_schemas import streams, subjects
from bus_schemas.codec import encode
from bus_schemas.control import Role
from bus_schemas.eventlog import events_frame, load_events
from bus_schemas.forecast import DemandForecast, TargetForecast
from bus_schemas.lifecycle import LifecycleEvent
from forecasting.core import CoreConfig, ForecastCore, TickResult
from forecasting.models import QUANTILES, TARGETS
from forecasting.series import TokenCost

FETCH_BATCH = 2000
FETCH_WAIT_WALL_S = 0.1


def prefill_cost(config) -> TokenCost:
    """The prefill engines' cost per token and per (token x context token): what the
    prefill_engine_s target weighs each cache-missed token by."""
    return TokenCost.prefill_of(config.engines.cost_preset(Role.PREFILL))


def decode_cost(config) -> TokenCost:
    """The decode engines' cost per generated token and per context token it reads: what the
    decode_engine_s target weighs each decode by."""
    return TokenCost.decode_of(config.engines.cost_preset(Role.DECODE))


def due_tick(next_index: int, now_s: float, tick_s: float, watermark_s: float) -> int:
    """The index k (tick at k * tick_s) to compute now: the latest whose watermark has passed
    (k * tick_s + watermark_s <= now_s), and never before `next_index`, the next not yet
    computed. Indices in between are skipped."""
    latest = int((now_s - watermark_s) // tick_s + 1e-9)
    return max(next_index, latest)


class ForecasterActor(Actor):
    kind = "forecaster"

    def __init__(self, actor_id, config, nc, clock) -> None:
        super().__init__(actor_id, config, nc, clock)
        fc = config.forecaster
        self.core = ForecastCore(
            CoreConfig(
                models=(fc.model,),
                bin_s=fc.bin_s,
                horizons_s=tuple(fc.horizons_s),
                prefill_cost=prefill_cost(config),
                decode_cost=decode_cost(config),
            )
        )
        if fc.prior_log:  # an earlier run's per-family statistics to start from (checked when the config loaded)
            self.core.live.learn_from(load_events(fc.prior_log))
        self.buffer: list[LifecycleEvent] = []
        self.ticks = 0  # ticks computed
        self.next_index = 1  # the next tick to compute is at next_index * tick_s
        self.skipped_ticks = 0  # ticks never computed: the forecaster was behind and skipped ahead
        self.max_lag_s = 0.0  # most model seconds a tick was computed after its due time (tick + watermark)
        self.late_events = 0
        self.last_event_s = 0.0
        self._drained = asyncio.Event()  # the consumer had nothing pending at the last fetch

    async def setup(self) -> None:
        config = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL, inactive_threshold=60.0)
        self._sub = await self.js.pull_subscribe(subjects.lifecycle_all(), stream=streams.LIFECYCLE.name, config=config)

    async def serve(self, burst: bool) -> None:
        self.spawn(self._consume(), "consume")
        fc = self.config.forecaster
        while not self.stopping.is_set():
            if burst:  # every tick, as fast as the log drains (no clock to keep up with)
                index = self.next_index
                await self._drained.wait()
                if fc.tick_s * index > self.last_event_s + fc.tick_s:
                    return
            else:
                await self.clock.sleep_until(fc.tick_s * self.next_index + fc.watermark_s)
                now_s = self.clock.now_s()
                index = due_tick(self.next_index, now_s, fc.tick_s, fc.watermark_s)
                self._skip(index - self.next_index, now_s - fc.tick_s * index - fc.watermark_s)
            self.next_index = index + 1
            began_s = self.clock.now_s()
            await self._tick(fc.tick_s * index)
            behind = not burst and self.clock.now_s() >= fc.tick_s * self.next_index + fc.watermark_s
            # behind (the next tick is due already): yield as long as the tick took, so the
            # forecaster takes at most half a core and the consumer keeps reading the log
            await self.clock.sleep_wall(self.clock.to_wall_s(self.clock.now_s() - began_s) if behind else 0.0)

    def _skip(self, skipped: int, lag_s: float) -> None:
        self.max_lag_s = max(self.max_lag_s, lag_s)
        self.counters["max_tick_lag_ms"] = max(self.counters["max_tick_lag_ms"], round(lag_s * 1e3))
        if skipped <= 0:
            return
        self.skipped_ticks += skipped
        self.counters["skipped_ticks"] += skipped
        if self.skipped_ticks == skipped or self.skipped_ticks // 100 > (self.skipped_ticks - skipped) // 100:
            self.log.warning(
                "behind the clock: skipped %d ticks to tick %d (%d skipped so far)", skipped, self.next_index + skipped, self.skipped_ticks
            )

    async def _consume(self) -> None:
        while not self.stopping.is_set():
            try:
                msgs = await self._sub.fetch(FETCH_BATCH, timeout=FETCH_WAIT_WALL_S)
            except TimeoutError:
                # asyncio.wait_for (3.11) inside fetch can turn our cancellation into a
                # TimeoutError: honour it, or shutdown waits on this loop for ever
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise asyncio.CancelledError from None
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
            self.log.warning(
                "tick %.1f s: %s fell back to naive (%d ticks so far): %s",
                until_s,
                message.model,
                message.fallbacks_total,
                message.fallback_reason,
            )
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
                window_mean=[p.window_mean(t, i) for i in index],
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
            live_context_tokens=result.live_context_tokens,
            remaining_turns=result.remaining.turns,
            remaining_s=result.remaining.mean_s,
            turn_prefill_s=result.remaining.stage_s[0],
            turn_decode_s=result.remaining.stage_s[1],
            turn_tool_s=result.remaining.stage_s[2],
            turn_prefill_tokens=result.remaining.prefill_tokens,
            prefill_cost_per_token_s=self.core.config.prefill_cost.per_token_s,
            prefill_cost_per_token_pair_s=self.core.config.prefill_cost.per_token_pair_s,
            decode_cost_per_token_s=self.core.config.decode_cost.per_token_s,
            decode_cost_per_token_pair_s=self.core.config.decode_cost.per_token_pair_s,
            events_total=result.events_total,
            fallback=bool(outcome.fallback_reason),
            fallback_reason=outcome.fallback_reason,
            fallbacks_total=outcome.fallbacks_total,
            late_events=self.late_events,
            skipped_ticks=self.skipped_ticks,
        )
