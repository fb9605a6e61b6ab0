"""Demand forecasts, published by the forecaster actor on subjects.forecast() every tick.

Values are per bin of `bin_s` model seconds: flows (tokens, engine-seconds) are sums over
the bin, decode_active_seqs its time-weighted mean, live_kv_tokens its value at the bin's
end. Horizon h means the bin that ends h seconds after `as_of_s`. Targets (see
forecasting.series): prefill_new_tokens, prefill_miss_tokens, prefill_engine_s,
decode_active_seqs, decode_tokens, decode_engine_s, live_kv_tokens.
"""

from __future__ import annotations

import msgspec


class TargetForecast(msgspec.Struct, frozen=True, kw_only=True):
    target: str  # what is forecast; its unit is in its name (tokens, seqs)
    mean: list[float]  # point forecast per horizon, in the target's unit per bin
    quantile_levels: list[float]  # e.g. [0.1, 0.5, 0.9]
    quantiles: list[list[float]]  # [level][horizon], in the target's unit per bin
    # per horizon h: the mean forecast averaged over every bin from the first to h's, in the
    # target's unit per bin (what a consumer sizing for the next h seconds reads; a prefill's
    # compute counted when it is asked for where the model tells that from when it is done,
    # so it can differ from averaging `mean`); empty: not published (a consumer falls back
    # to averaging `mean` over the horizons up to h)
    window_mean: list[float] = msgspec.field(default_factory=list)


class DemandForecast(msgspec.Struct, frozen=True, kw_only=True):
    forecaster_id: str
    model: str  # registry name of the model that was asked for (forecasting.models)
    tick: int  # 1, 2, … : the number of ticks computed so far
    as_of_s: float  # model time the forecast is made from: every event before it is in
    computed_at_s: float  # model time it was computed (as_of_s + watermark + compute)
    bin_s: float  # width of one forecast bin, model seconds
    horizons_s: list[float]  # model seconds after as_of_s
    targets: list[TargetForecast]
    live_trajectories: int  # trajectories live at as_of_s
    live_context_tokens: int = 0  # KV tokens they hold at as_of_s: histories and prefilled turns (0: not known)
    # what is left of their work (forecasting.remaining): expected turns, summed over them, and
    # the mean of their expected model seconds left (0: not known)
    remaining_turns: float = 0.0
    remaining_s: float = 0.0
    # ... and a turn's mean seconds queued and prefilling, decoding, in its tool call (0: not known)
    turn_prefill_s: float = 0.0
    turn_decode_s: float = 0.0
    turn_tool_s: float = 0.0
    turn_prefill_tokens: float = 0.0  # ... and an append's mean cache-missed prefill tokens (0: not known)
    # the costs prefill_engine_s is priced at (forecasting.series.TokenCost: seconds per
    # cache-missed token, and per token x context token it attends over); 0, 0: not stated
    prefill_cost_per_token_s: float = 0.0
    prefill_cost_per_token_pair_s: float = 0.0
    # the costs decode_engine_s is priced at (per generated token, and per generated token x
    # context token it reads; forecasting.series.TokenCost.decode_of); 0, 0: not stated
    decode_cost_per_token_s: float = 0.0
    decode_cost_per_token_pair_s: float = 0.0
    events_total: int  # lifecycle events consumed so far
    fallback: bool = False  # this tick's numbers are naive's: the model failed to fit
    fallback_reason: str = ""  # why (empty when fallback is False)
    fallbacks_total: int = 0  # ticks so far that fell back
    late_events: int = 0  # events that arrived after their tick was computed (counted in the next one)
    skipped_ticks: int = 0  # ticks so far never computed: the forecaster was behind and skipped ahead to now

    def windows(self) -> dict[str, list[float]]:
        """Per target, its window means where it publishes one for every horizon."""
        return {t.target: t.window_mean for t in self.targets if len(t.window_mean) == len(self.horizons_s)}
