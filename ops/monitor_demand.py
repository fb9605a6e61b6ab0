"""The monitor's demand: what the lifecycle log measures per bin against what the forecaster
predicted for that bin, plus the latest forecast ahead.

Measured targets follow `forecasting.series`: flows (tokens) summed per bin of model time,
levels (sequences decoding) time-weighted per bin. `prefill_engine_s` = per_token_s * miss +
per_token_pair_s * miss * (prefix + miss / 2) (`forecasting.series.TokenCost`): the two
sums are kept per bin, so the run's cost coefficients can come later (set `prefill_cost`).
Each forecast's first horizon is kept per bin as `predicted`.
"""

from __future__ import annotations

import math

from bus_schemas.forecast import DemandForecast, TargetForecast
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from forecasting.series import TokenCost
from ops.monitor_common import rounded

# Forecast targets measured here as forecasting.series defines them; a forecast's other targets show without a measured line.
DEMAND_TARGETS = ("prefill_new_tokens", "prefill_miss_tokens", "prefill_engine_s", "decode_tokens", "decode_active_seqs")
LEVEL_TARGETS = ("decode_active_seqs",)
_ATTN = "_prefill_token_pairs"  # per bin: sum of miss * (prefix + miss / 2); the miss sum is prefill_miss_tokens


def _band(t: TargetForecast | None, pick) -> list | None:
    """The forecast's lowest (pick=min) or highest (pick=max) quantile, None without quantiles."""
    if t is None or not t.quantile_levels:
        return None
    return [rounded(x, 2) for x in t.quantiles[t.quantile_levels.index(pick(t.quantile_levels))]]


class Demand:
    def __init__(self, *, spark_bins: int, prefill_cost: TokenCost | None) -> None:
        self.spark_bins = spark_bins
        self.prefill_cost = prefill_cost  # the run's, for prefill_engine_s (None: not measured)
        self.bin_s = 1.0
        self.measured: dict[str, dict[int, float]] = {t: {} for t in (*DEMAND_TARGETS, _ATTN)}
        self.predicted: dict[str, dict[int, float]] = {}  # target -> bin -> the forecast's first horizon
        self._level = {t: 0.0 for t in LEVEL_TARGETS}
        self._level_at = {t: 0.0 for t in LEVEL_TARGETS}
        self.forecast: DemandForecast | None = None
        self.forecast_wall_s: float | None = None
        self.forecasts_total = 0

    # --- feeding ---------------------------------------------------------------------------
    def on_forecast(self, f: DemandForecast, wall_s: float) -> None:
        if not math.isclose(f.bin_s, self.bin_s):
            self.bin_s = f.bin_s
            self.measured = {t: {} for t in self.measured}
            self.predicted = {}
        self.forecast, self.forecast_wall_s = f, wall_s
        self.forecasts_total += 1
        if f.horizons_s:
            h0 = f.horizons_s[0]
            b = round((f.as_of_s + h0) / f.bin_s) - 1  # the bin that ends h0 after as_of_s
            for t in f.targets:
                if t.mean:
                    series = self.predicted.setdefault(t.target, {})
                    series[b] = float(t.mean[0])
                    self._trim(series, b)

    def on_event(self, ev: LifecycleEvent) -> None:
        """Measured demand per bin, as forecasting.series defines the targets."""
        b = math.floor(ev.at_s / self.bin_s)
        flows: tuple = ()
        if ev.kind is EventKind.PREFILL_QUEUED:
            flows = (("prefill_new_tokens", ev.new_tokens),)
        elif ev.kind is EventKind.PREFILL_DONE:
            miss = ev.context_tokens - ev.cached_prefix_tokens + ev.new_tokens
            flows = (("prefill_miss_tokens", miss), (_ATTN, miss * (ev.cached_prefix_tokens + miss / 2.0)))
        elif ev.kind is EventKind.DECODE_DONE:
            flows = (("decode_tokens", ev.generated_tokens),)
        for target, value in flows:
            series = self.measured[target]
            series[b] = series.get(b, 0.0) + value
            self._trim(series, b)
        if ev.kind in (EventKind.DECODE_STARTED, EventKind.DECODE_DONE):
            self._step_level("decode_active_seqs", ev.at_s, 1.0 if ev.kind is EventKind.DECODE_STARTED else -1.0)

    def _step_level(self, target: str, at_s: float, delta: float) -> None:
        """A time-weighted level: the old level is added to the bins it spanned, then it steps."""
        self._spread_level(target, at_s, self.measured[target], commit=True)
        self._level[target] += delta

    def _spread_level(self, target: str, until_s: float, into: dict[int, float], *, commit: bool) -> None:
        """Add the level since it last stepped, up to `until_s`, to the bins of `into`;
        `commit`: `into` is the measured series, and the level is now spread up to `until_s`."""
        start = self._level_at[target]
        if until_s <= start:
            return  # a late event: it only steps the level
        level = self._level[target]
        if start < until_s - self.spark_bins * 2 * self.bin_s:  # a long gap: only the recent bins matter
            start = until_s - self.spark_bins * 2 * self.bin_s
        b = math.floor(start / self.bin_s)
        while start < until_s:
            end = min((b + 1) * self.bin_s, until_s)
            if level:
                into[b] = into.get(b, 0.0) + level * (end - start) / self.bin_s
            start, b = end, b + 1
        if commit:
            self._level_at[target] = until_s
            self._trim(into, b)

    def _trim(self, series: dict[int, float], newest: int) -> None:
        if len(series) > 4 * self.spark_bins:
            for k in [k for k in series if k < newest - 2 * self.spark_bins]:
                del series[k]

    # --- reading out -----------------------------------------------------------------------
    def _bins(self, now_s: float) -> tuple[int, list[int]]:
        """The bin now, and the whole bins shown: the last `spark_bins`, or where a forecaster
        far behind is."""
        now_bin = math.floor(now_s / self.bin_s)
        last = now_bin - 1  # the last whole bin
        first = last - self.spark_bins + 1
        newest_predicted = max((max(p) for p in self.predicted.values() if p), default=None)
        if newest_predicted is not None and newest_predicted < first + self.spark_bins // 4:  # a forecaster far behind: show where it is
            first = max(newest_predicted - self.spark_bins // 2, last - 2 * self.spark_bins + 1)
        return now_bin, list(range(first, last + 1))

    def _derived(self, now_bin: int, bins: list[int]) -> dict[str, dict[int, float]]:
        """Series computed at read time: levels spread up to now (without moving the state),
        and prefill_engine_s where the run's cost is known."""
        levels = {}
        for target in LEVEL_TARGETS:
            levels[target] = dict(self.measured[target])
            self._spread_level(target, now_bin * self.bin_s, levels[target], commit=False)
        if self.prefill_cost is not None:
            gemm, attn, cost = self.measured["prefill_miss_tokens"], self.measured[_ATTN], self.prefill_cost
            levels["prefill_engine_s"] = {b: cost.per_token_s * gemm.get(b, 0.0) + cost.per_token_pair_s * attn.get(b, 0.0) for b in bins}
        return levels

    def view(self, now_s: float) -> dict:
        now_bin, bins = self._bins(now_s)
        levels = self._derived(now_bin, bins)
        f = self.forecast
        targets = {}
        latest = {t.target: t for t in f.targets} if f is not None else {}
        for target in [*DEMAND_TARGETS, *(t for t in latest if t not in DEMAND_TARGETS)]:
            series = levels.get(target, self.measured.get(target)) if target != "prefill_engine_s" else levels.get(target)
            measured = [rounded(series.get(b, 0.0), 2) for b in bins] if series is not None else [None] * len(bins)
            predicted = [rounded(self.predicted[target][b], 2) if b in self.predicted.get(target, {}) else None for b in bins]
            t = latest.get(target)
            targets[target] = {
                "measured": measured,
                "predicted": predicted,  # what the forecast said for each bin, its first horizon ahead
                "forecast": [rounded(x, 2) for x in t.mean] if t is not None else [],
                "forecast_low": _band(t, min),
                "forecast_high": _band(t, max),
                "last_measured": measured[-1] if measured else None,
            }
        return {
            "bin_s": self.bin_s,
            "first_bin_s": rounded(bins[0] * self.bin_s) if bins else None,
            "tick": f.tick if f else None,
            "model": f.model if f else "",
            "as_of_s": rounded(f.as_of_s) if f else None,
            "lag_s": rounded(now_s - f.as_of_s, 2) if f else None,  # how far the forecaster is behind the bus
            "horizons_s": list(f.horizons_s) if f else [],
            "fallback": bool(f.fallback) if f else False,
            "fallback_reason": f.fallback_reason if f else "",
            "forecasts_total": self.forecasts_total,
            "skipped_ticks": f.skipped_ticks if f else 0,  # ticks the forecaster skipped, behind the bus
            "live_trajectories": f.live_trajectories if f else None,
            "targets": targets,
        }
