"""The forecasting tick: one code path for the live forecaster actor and the replay runner.

    events of [last tick, this tick)  ─▶ series.chunk_totals ─▶ closed bins (totals per target)
                                      └▶ LiveState.ingest ─▶ trajectories, learned distributions
    for each model: update(history); predict(max horizon)   (FitError etc. → naive, counted)
                    quantiles shifted by the model's recent errors (forecasting.calibrate)
    ─▶ TickResult: per model, the forecast at every horizon, and whether it fell back

The caller hands each tick the events with at_s in [previous tick, this tick), sorted by
(at_s, event_id); the live actor holds events back until the tick's watermark has passed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

from forecasting import series
from forecasting.calibrate import Conformal
from forecasting.live import LiveState
from forecasting.models import TARGETS, FitError, History, Prediction, make
from forecasting.models.timeseries import Naive
from forecasting.remaining import Remaining, remaining

# What counts as "the model failed to fit on this tick" (statsmodels raises these).
FIT_FAILURES = (FitError, ValueError, ArithmeticError, np.linalg.LinAlgError, IndexError)


@dataclass(slots=True)
class ModelOutcome:
    prediction: Prediction
    fallback_reason: str = ""  # non-empty: this tick's forecast is naive's, because of this
    fallbacks_total: int = 0
    raw_quantiles: dict[str, np.ndarray] | None = None  # the model's own, before calibration (None: not calibrated)


@dataclass(slots=True)
class TickResult:
    as_of_s: float
    outcomes: dict[str, ModelOutcome]
    live_trajectories: int
    events_total: int
    live_context_tokens: int = 0  # KV the live trajectories hold (LiveState.live_context_tokens)
    remaining: Remaining = Remaining()  # what is left of their work (forecasting.remaining)


class _Growing:
    """A float array that grows by appending (amortised doubling)."""

    def __init__(self) -> None:
        self._data = np.zeros(256)
        self.n = 0

    def extend(self, values: np.ndarray) -> None:
        while self.n + len(values) > len(self._data):
            self._data = np.concatenate([self._data, np.zeros(len(self._data))])
        self._data[self.n : self.n + len(values)] = values
        self.n += len(values)

    def view(self) -> np.ndarray:
        return self._data[: self.n]


@dataclass(slots=True)
class CoreConfig:
    models: tuple[str, ...]
    bin_s: float = 1.0
    horizons_s: tuple[float, ...] = (1.0, 5.0, 10.0, 20.0, 30.0)
    keep_series: bool = False  # keep the per-family series frames (the replay runner plots them)
    calibrate: bool = True  # shift quantiles by the model's recent errors (forecasting.calibrate)
    calibration_window_bins: int = 300  # recent residuals per (target, horizon) the shifts are learned from
    prefill_cost: series.TokenCost = series.UNIT_COST  # prefill_engine_s: engine-seconds per prefill (default: its tokens)
    decode_cost: series.TokenCost = series.UNIT_COST  # decode_engine_s: engine-seconds per decode (default: its tokens)

    def __post_init__(self) -> None:
        if self.bin_s <= 0:
            raise ValueError("bin_s must be > 0")
        for h in self.horizons_s:
            k = h / self.bin_s
            if h <= 0 or abs(k - round(k)) > 1e-9:
                raise ValueError(f"horizon {h} s is not a positive multiple of bin_s = {self.bin_s} s")

    @property
    def horizon_bins(self) -> int:
        return round(max(self.horizons_s) / self.bin_s)

    def horizon_index(self) -> list[int]:
        return [round(h / self.bin_s) - 1 for h in self.horizons_s]


@dataclass
class ForecastCore:
    config: CoreConfig
    live: LiveState | None = None

    def __post_init__(self) -> None:
        if self.live is None:
            self.live = LiveState(cost=self.config.prefill_cost, decode_cost=self.config.decode_cost)
        self.models = {name: make(name) for name in self.config.models}
        for model in self.models.values():  # only the published horizons need exact flow distributions
            for inner in (model, getattr(model, "base", None)):
                if hasattr(inner, "exact_bins"):
                    inner.exact_bins = tuple(self.config.horizon_index())
        self._naive = {name: Naive() for name in self.config.models}
        self.fallbacks = {name: 0 for name in self.config.models}
        calibrated = tuple(self.config.horizon_index())  # the horizons published and scored
        self.calibrators = (
            {name: Conformal(self.config.calibration_window_bins, horizons=calibrated) for name in self.config.models}
            if self.config.calibrate
            else {}
        )
        self.series = {t: _Growing() for t in TARGETS}
        self.frames: list[pl.DataFrame] = []
        self.end_s = 0.0
        self._carry: dict[str, float] = {}
        self._family_carry: series.Levels = {}

    def tick(self, events: pl.DataFrame, until_s: float) -> TickResult:
        """Close the bins of [end_s, until_s) with `events`, then forecast from until_s."""
        totals, self._carry = series.chunk_totals(
            events, self.end_s, until_s, self.config.bin_s, self._carry, self.config.prefill_cost, self.config.decode_cost
        )
        if self.config.keep_series:
            chunk, self._family_carry = series.bin_chunk(
                events, self.end_s, until_s, self.config.bin_s, self._family_carry, self.config.prefill_cost, self.config.decode_cost
            )
            self.frames.append(chunk)
        totals[series.LIVE_KV] = self._ingest_by_bin(events, until_s)
        for t in TARGETS:
            self.series[t].extend(totals[t])
        self.end_s = until_s
        history = History(self.config.bin_s, until_s, {t: s.view() for t, s in self.series.items()}, self.live)
        outcomes = {name: self._run(name, history) for name in self.models}
        return TickResult(
            until_s, outcomes, self.live.live_count(), self.live.events, self.live.live_context_tokens(), remaining(self.live, until_s)
        )

    def _ingest_by_bin(self, events: pl.DataFrame, until_s: float) -> np.ndarray:
        """Feed the live state the events of [end_s, until_s), one bin at a time (earlier ones
        in the first; in the order they came within a bin), and read the live trajectories' KV
        after each bin (series.LIVE_KV)."""
        n_bins = round((until_s - self.end_s) / self.config.bin_s)
        local = np.clip(np.floor((events["at_s"].to_numpy() - self.end_s) / self.config.bin_s), 0, n_bins - 1).astype(np.int64)
        order = np.argsort(local, kind="stable")
        cuts = np.searchsorted(local[order], np.arange(n_bins + 1), side="left")
        kv = np.zeros(n_bins)
        for b in range(n_bins):
            self.live.ingest(events[order[cuts[b] : cuts[b + 1]]])
            kv[b] = self.live.live_context_tokens()
        return kv

    def _run(self, name: str, history: History) -> ModelOutcome:
        naive = self._naive[name].update(history)  # kept current: the fallback is always ready
        try:
            outcome = ModelOutcome(self.models[name].update(history).predict(self.config.horizon_bins), "", self.fallbacks[name])
        except FIT_FAILURES as err:
            self.fallbacks[name] += 1
            reason = f"{type(err).__name__}: {err}"[:200]
            outcome = ModelOutcome(naive.predict(self.config.horizon_bins), reason, self.fallbacks[name])
        calibrator = self.calibrators.get(name)
        if calibrator is not None:  # learns the errors of what was issued, the fallback's included
            calibrator.observe(history.series, history.n_bins)
            outcome.raw_quantiles = outcome.prediction.quantiles
            outcome.prediction = calibrator.adjust(outcome.prediction, history.n_bins)
        return outcome

    def series_frame(self) -> pl.DataFrame:
        return pl.concat(self.frames) if self.frames else pl.DataFrame()
