"""Where a policy's demand estimate comes from (pure): queues, forecasts, or a recorded log.

* `from_queues` (`reactive`): what waits now — prefill tokens to clear within the horizon,
  sequences decoding now;
* `from_forecast` (`prorsa`): the forecaster's expected demand over the horizon (its mean,
  or a calibrated quantile: `allocator.provision_quantile`), plus the backlog of now
  (forecast flows count work done, which under-states demand while a stage is the
  bottleneck);
* `RecordedDemand` (`oracle`): the true demand over the horizon, read from the lifecycle log
  of a recorded run of the same workload, plus the backlog of now. The log's stage times and
  work left were timed in the recorded run's arrangement, which its role switches tell
  (`Demand.stages_timed_in`), not in the oracle's own.

The forecast and the log also give the prefill engine-seconds of the cache-missed tokens
(`prefill_engine_s`: each prefill priced by its context); the demand carries them as the
mean context a missed token attends over (`Demand.prefill_attention_tokens`), which prices
the prefill tokens in the load model.
"""

from __future__ import annotations

import bisect
from collections import Counter

import numpy as np
import polars as pl

from actors.allocator.state import Demand, Fleet
from bus_schemas.forecast import DemandForecast, TargetForecast
from forecasting.series import UNIT_COST, TokenCost, bin_events, live_context_by_bin, missed_tokens, totals

ORACLE_BIN_S = 1.0
# the oracle's turn stages: those that start within this of now (a minute of the recorded run) [A]
ORACLE_STAGE_WINDOW_S = 60.0
# a turn's stages in the log: queued and prefilling, decoding, in its tool call
STAGE_BOUNDS = (("prefill_queued", "decode_started"), ("decode_started", "decode_done"), ("tool_started", "tool_done"))


def arrangements(events: pl.DataFrame, initial: dict[str, str]) -> tuple[list[float], list[int]]:
    """A run's arrangement over time from its role switches: (the model times it changed,
    the arrangement before the first and after each), an arrangement being its prefill
    engines, 0 where none prefills or decodes. Engines start in their `initial` role."""
    roles = dict(initial)
    switches = events.filter(pl.col("kind") == "role_switched").sort("at_s", "event_id")

    def arrangement() -> int:
        split = any(role != "colocated" for role in roles.values())
        return sum(role == "prefill" for role in roles.values()) if split else 0

    times, held = [], [arrangement()]
    for at_s, engine_id, role in switches.select("at_s", "actor_id", "role").iter_rows():
        roles[engine_id] = role
        times.append(at_s)
        held.append(arrangement())
    return times, held


def backlog_tokens_per_s(fleet: Fleet, horizon_s: float) -> float:
    """The prefill tokens queued now, to clear within the horizon."""
    return fleet.waiting_prefill_tokens / horizon_s


def from_queues(fleet: Fleet, horizon_s: float) -> Demand:
    backlog = backlog_tokens_per_s(fleet, horizon_s)
    return Demand(
        prefill_tokens_per_s=backlog,
        decode_seqs=float(fleet.running_decode),
        decode_context_tokens=fleet.mean_decode_context_tokens,
        source="queues",
        kv_working_set_tokens=float(fleet.kv_working_set_tokens),
        prefill_backlog_tokens_per_s=backlog,
    )


def forecast_values(target: TargetForecast, quantile: float = 0.0) -> list[float]:
    """Per horizon: the mean (quantile 0) or that quantile, interpolated between the
    published levels (clamped to the outermost ones)."""
    if quantile == 0.0:
        return list(target.mean)
    levels = np.asarray(target.quantile_levels)
    values = np.asarray(target.quantiles)  # [level][horizon]
    order = np.argsort(levels)
    return [float(np.interp(quantile, levels[order], values[order, i])) for i in range(values.shape[1])]


def from_forecast(forecast: DemandForecast, fleet: Fleet, horizon_s: float, quantile: float = 0.0) -> Demand:
    """Expected demand over the horizons up to `horizon_s` (at least the first one): the
    forecast's mean over every bin up to the furthest of them (quantile 0: its published
    window mean; a forecast without one, the mean of the published horizons), or the
    average of the published horizons' `quantile` (allocator.provision_quantile: per-bin
    upper quantiles, which provisions for a busy stretch)."""
    by_target = {t.target: forecast_values(t, quantile) for t in forecast.targets}
    within = [i for i, h in enumerate(forecast.horizons_s) if h <= horizon_s + 1e-9] or [0]
    windows = forecast.windows()
    furthest = max(within, key=lambda i: forecast.horizons_s[i])  # horizons need not be listed in order

    def mean(target: str) -> float:
        if quantile == 0.0 and target in windows:  # every bin up to the horizon, not the published ones only
            return max(0.0, float(windows[target][furthest]))
        return float(np.mean([max(0.0, by_target[target][i]) for i in within]))

    per_bin_tokens = max(mean("prefill_miss_tokens"), mean("prefill_new_tokens"))
    cost = TokenCost(forecast.prefill_cost_per_token_s, forecast.prefill_cost_per_token_pair_s)
    attention = cost.attention_tokens(mean("prefill_engine_s"), mean("prefill_miss_tokens")) if "prefill_engine_s" in by_target else 0.0
    backlog = backlog_tokens_per_s(fleet, horizon_s)
    return Demand(
        prefill_tokens_per_s=per_bin_tokens / forecast.bin_s + backlog,
        decode_seqs=max(mean("decode_active_seqs"), 0.0),
        decode_context_tokens=next_decode_context_tokens(fleet, forecast.live_trajectories, forecast.live_context_tokens),
        source=f"forecast@{forecast.as_of_s:.0f}s" + (f"/q{quantile:g}" if quantile else ""),
        prefill_new_tokens_per_s=mean("prefill_new_tokens") / forecast.bin_s,
        kv_working_set_tokens=float(fleet.kv_working_set_tokens),
        live_trajectories=float(forecast.live_trajectories),
        live_context_tokens=float(forecast.live_context_tokens),
        live_known=forecast.live_context_tokens > 0 or forecast.live_trajectories == 0,
        prefill_attention_tokens=attention,
        prefill_backlog_tokens_per_s=backlog,
        remaining_s=forecast.remaining_s,
        turn_stage_s=(forecast.turn_prefill_s, forecast.turn_decode_s, forecast.turn_tool_s),
        turn_prefill_tokens=forecast.turn_prefill_tokens,
    )


def next_decode_context_tokens(fleet: Fleet, live_trajectories: float, live_context_tokens: float) -> float:
    """The decoding sequences' mean context; while none decodes (a step's start, a tail), the
    live trajectories' mean KV, the context their next decodes start at; the typical context
    (`DEFAULT_CONTEXT_TOKENS`) where neither is known."""
    if fleet.running_decode or live_trajectories <= 0 or live_context_tokens <= 0:
        return fleet.mean_decode_context_tokens
    return live_context_tokens / live_trajectories


def stage_spans(events: pl.DataFrame, start_kind: str, end_kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(start model s, duration s) of every turn's stage from its `start_kind` event to its
    `end_kind` event (first attempts' pairs, matched by trajectory and turn)."""
    keys = ["trajectory_id", "turn"]
    start = events.filter(pl.col("kind") == start_kind).group_by(keys).agg(pl.col("at_s").min().alias("start_s"))
    end = events.filter(pl.col("kind") == end_kind).group_by(keys).agg(pl.col("at_s").min().alias("end_s"))
    pairs = start.join(end, on=keys).filter(pl.col("end_s") >= pl.col("start_s")).sort("start_s")
    return pairs["start_s"].to_numpy(), (pairs["end_s"] - pairs["start_s"]).to_numpy()


class RecordedDemand:
    """The true per-second demand of a recorded run (its lifecycle frame), by model time."""

    def __init__(self, events: pl.DataFrame, cost: TokenCost = UNIT_COST, initial: dict[str, str] | None = None) -> None:
        """`initial`: each engine's role (a `Role` or its name) at the recorded run's start (it
        started as this run does; none given: colocated)."""
        series = bin_events(events, ORACLE_BIN_S, cost=cost)
        self.cost = cost
        self.prefill_tokens = np.asarray(totals(series, "prefill_miss_tokens"), dtype=float)
        self.prefill_engine_s = np.asarray(totals(series, "prefill_engine_s"), dtype=float)
        self.new_tokens = np.asarray(totals(series, "prefill_new_tokens"), dtype=float)
        self.decode_seqs = np.asarray(totals(series, "decode_active_seqs"), dtype=float)
        arrivals, finishes = (np.asarray(totals(series, c), dtype=float) for c in ("arrivals", "finishes"))
        self.live = np.cumsum(arrivals - finishes)  # trajectories live at the end of each bin
        self.live_context = live_context_by_bin(events, ORACLE_BIN_S, len(self.live))
        spans = (
            events.filter(pl.col("trajectory_id") != "")
            .group_by("trajectory_id")
            .agg(pl.col("at_s").min().alias("first_s"), pl.col("at_s").max().alias("last_s"))
        )
        self.first_s, self.last_s = spans["first_s"].to_numpy(), spans["last_s"].to_numpy()
        self.stages = [stage_spans(events, start, end) for start, end in STAGE_BOUNDS]
        appends = events.filter((pl.col("kind") == "prefill_done") & (pl.col("turn") > 0))
        self.append_s = appends["at_s"].to_numpy()
        self.append_tokens = appends.select(missed_tokens())[:, 0].to_numpy()
        self.switch_s, self.arrangements = arrangements(events, initial or {})

    def arrangement_at(self, at_s: float) -> int:
        """The recorded run's arrangement at `at_s` (prefill engines, 0: colocated)."""
        return self.arrangements[bisect.bisect_right(self.switch_s, at_s)]

    def stages_timed_in(self, now_s: float) -> int:
        """The arrangement the recorded run held longest over `ORACLE_STAGE_WINDOW_S` from
        `now_s`, the window `turn_stage_s` reads (the earliest, on a tie)."""
        held = Counter(self.arrangement_at(now_s + k * ORACLE_BIN_S) for k in range(int(ORACLE_STAGE_WINDOW_S / ORACLE_BIN_S)))
        return max(held, key=held.__getitem__)

    def turn_stage_s(self, now_s: float) -> tuple[float, float, float]:
        """A turn's mean seconds queued and prefilling, decoding, and in its tool call, over
        the stages that start within `ORACLE_STAGE_WINDOW_S` from `now_s` (0s: none starts)."""
        means = []
        for start_s, duration_s in self.stages:
            inside = (start_s >= now_s) & (start_s < now_s + ORACLE_STAGE_WINDOW_S)
            means.append(float(duration_s[inside].mean()) if inside.any() else 0.0)
        return means[0], means[1], means[2]

    def turn_prefill_tokens(self, now_s: float) -> float:
        """An append's mean cache-missed prefill tokens, over those prefilled within
        `ORACLE_STAGE_WINDOW_S` from `now_s` (0: none)."""
        inside = (self.append_s >= now_s) & (self.append_s < now_s + ORACLE_STAGE_WINDOW_S)
        return float(self.append_tokens[inside].mean()) if inside.any() else 0.0

    def remaining_s(self, now_s: float) -> float:
        """The mean over the trajectories live at `now_s` of the model seconds until their last
        event (0: none live)."""
        live = (self.first_s <= now_s) & (self.last_s > now_s)
        return float((self.last_s[live] - now_s).mean()) if live.any() else 0.0

    def at(self, fleet: Fleet, horizon_s: float) -> Demand:
        lo = int(fleet.now_s // ORACLE_BIN_S)
        hi = max(lo + 1, int((fleet.now_s + horizon_s) // ORACLE_BIN_S))
        window_p, window_d, window_n = self.prefill_tokens[lo:hi], self.decode_seqs[lo:hi], self.new_tokens[lo:hi]
        backlog = backlog_tokens_per_s(fleet, horizon_s)
        live = float(self.live[min(lo, len(self.live) - 1)]) if len(self.live) else 0.0
        live_context = float(self.live_context[min(lo, len(self.live_context) - 1)]) if len(self.live_context) else 0.0
        return Demand(
            prefill_tokens_per_s=(float(window_p.mean()) if len(window_p) else 0.0) / ORACLE_BIN_S + backlog,
            decode_seqs=float(window_d.mean()) if len(window_d) else 0.0,
            decode_context_tokens=next_decode_context_tokens(fleet, live, live_context),
            source="oracle",
            prefill_new_tokens_per_s=(float(window_n.mean()) if len(window_n) else 0.0) / ORACLE_BIN_S,
            kv_working_set_tokens=float(fleet.kv_working_set_tokens),
            live_trajectories=live,
            live_context_tokens=live_context,
            live_known=True,
            prefill_attention_tokens=self.cost.attention_tokens(float(self.prefill_engine_s[lo:hi].sum()), float(window_p.sum())),
            prefill_backlog_tokens_per_s=backlog,
            remaining_s=self.remaining_s(fleet.now_s),
            turn_stage_s=self.turn_stage_s(fleet.now_s),
            turn_prefill_tokens=self.turn_prefill_tokens(fleet.now_s),
            stages_timed_in=self.stages_timed_in(fleet.now_s),
        )
