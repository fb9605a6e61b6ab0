"""Calibrated quantiles: split-conformal shifts learned from each model's recent errors,
with the interval's level steered by adaptive conformal inference.

    tick t:   raw = model.predict(H)               quantiles lo, med, hi per horizon h
              published lo' = max(lo + s_lo, 0), med' = med + s_med, hi' = hi + s_hi
    later:    bin b closes with value y; every forecast issued for it adds y - raw to the
              recent residuals of its (target, h), and whether [lo', hi'] held y to c
    s_lo  = the (1 - c)/2-quantile of the lower residuals  y - lo   (the last window_bins)
    s_hi  = the (c + m_lo)-quantile of the upper residuals y - hi, where m_lo is the share
            of recent outcomes that fell below lo' (a lower bound clipped at 0 misses fewer)
    s_med = the 0.5-quantile of y - med
    c    += gamma · (0.8 - covered)   per outcome (Gibbs & Candès 2021), kept in [0.5, 0.99]

So each (target, horizon)'s published 10-90% interval holds about 80% of the outcomes,
whatever the model's own spread says (a normal spread around a lifecycle forecast is too
narrow; a zero-inflated flow's lower bound sits at 0 and misses little, so the upper one
takes the rest), and the level correction keeps it there when the residuals of one
horizon are correlated from tick to tick (a level like decode sequences 30 s ahead). Until
a (target, horizon) has `min_points` residuals its quantiles go out as the model made them.
The mean and the point forecast are never changed.
"""


from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from forecasting.models.base import QUANTILES, TARGETS, Prediction

LO, MED, HI = QUANTILES.index(0.1), QUANTILES.index(0.5), QUANTILES.index(0.9)
COVERAGE = QUANTILES[HI] - QUANTILES[LO]  # what the 10-90% interval should hold


@dataclass(slots=True)
class _Target:
    """One target's recent residuals per horizon (NaN where none yet) and its level c."""

    residuals: np.ndarray  # (levels, horizons, window): y - raw quantile
    lower: np.ndarray  # (horizons, window): the raw lower quantile of each residual
    count: np.ndarray  # (horizons,): residuals seen so far
    level: np.ndarray = field(init=False)  # (horizons,): the interval's nominal coverage c

    def __post_init__(self) -> None:
        self.level = np.full(self.residuals.shape[1], COVERAGE)

    def add(self, h: int, residuals: np.ndarray, lower: float) -> None:
        at = self.count[h] % self.residuals.shape[2]
        self.residuals[:, h, at], self.lower[h, at] = residuals, lower
        self.count[h] += 1


def _quantiles(sorted_values: np.ndarray, n: np.ndarray, level: np.ndarray) -> np.ndarray:
    """Per row, the `level` quantile (linear interpolation) of its first n sorted values."""
    position = np.clip(level, 0.0, 1.0) * np.maximum(n - 1, 0)
    below = np.floor(position).astype(np.int64)
    above = np.minimum(below + 1, np.maximum(n - 1, 0))
    rows = np.arange(len(n))
    low, high = sorted_values[rows, below], sorted_values[rows, above]
    return low + (position - below) * (high - low)


class Conformal:
    def __init__(self, window_bins: int = 300, min_points: int = 30, gamma: float = 0.01, horizons: tuple[int, ...] | None = None) -> None:
        """horizons: the horizon indices (bin h + 1 after now) to calibrate, the ones that are
        published and scored; None: all."""
        if window_bins < 1 or min_points < 1 or not 0 <= gamma < 1:
            raise ValueError("window_bins and min_points must be >= 1, gamma in [0, 1)")
        self.window_bins, self.min_points, self.gamma = window_bins, min_points, gamma
        self.horizons = None if horizons is None else np.array(sorted(set(horizons)), np.int64)
        # bins closed at issue -> per target: (raw quantiles, published lower, published upper)
        self._issued: dict[int, dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._targets: dict[str, _Target] = {}
        self._seen = 0  # bins whose residuals have been taken

    def observe(self, series: dict[str, np.ndarray], n_bins: int) -> None:
        """Take the residuals of every issued forecast for the bins closed since the last call."""
        for b in range(self._seen, n_bins):
            for issued_at, per_target in self._issued.items():
                h = b - issued_at  # bin issued_at is horizon index 0
                column = self._column(h, max(raw.shape[1] for raw, _, _ in per_target.values()))
                if column < 0:
                    continue
                for target, (raw, lower, upper) in per_target.items():
                    if h < raw.shape[1]:
                        y = series[target][b]
                        state = self._state(target, raw.shape[1])
                        state.add(column, y - raw[:, h], raw[LO, h])
                        covered = lower[h] <= y <= upper[h]
                        level = state.level[column] + self.gamma * (COVERAGE - covered)
                        state.level[column] = min(max(level, 0.5), 0.99)
        self._seen = max(self._seen, n_bins)
        for issued_at in [k for k, v in self._issued.items() if k + max(raw.shape[1] for raw, _, _ in v.values()) <= self._seen]:
            del self._issued[issued_at]

    def _columns(self, horizons: int) -> np.ndarray:
        """The calibrated horizon indices of a forecast of `horizons` bins."""
        every = np.arange(horizons)
        return every if self.horizons is None else self.horizons[self.horizons < horizons]

    def _column(self, h: int, horizons: int) -> int:
        """Where horizon index h is kept (-1: not calibrated)."""
        if not 0 <= h < horizons:
            return -1
        if self.horizons is None:
            return h
        at = int(np.searchsorted(self.horizons, h))
        return at if at < len(self.horizons) and self.horizons[at] == h else -1

    def adjust(self, prediction: Prediction, issued_at: int) -> Prediction:
        """The prediction with calibrated quantiles; remembers them to learn from."""
        quantiles = dict(prediction.quantiles)
        issued = {}
        for target in TARGETS:
            raw = prediction.quantiles.get(target)
            if raw is None:
                continue
            shift = self.shift(target, raw.shape[1])
            if shift is not None:
                quantiles[target] = np.sort(np.maximum(raw + shift, 0.0), axis=0)
            issued[target] = (raw.copy(), quantiles[target][LO].copy(), quantiles[target][HI].copy())
        self._issued[issued_at] = issued
        return Prediction(prediction.mean, quantiles, prediction.point)

    def shift(self, target: str, horizons: int) -> np.ndarray | None:
        """(levels, horizons): the shift of each quantile; 0 where too few residuals yet."""
        state = self._targets.get(target)
        columns = self._columns(horizons)
        if state is None or state.count.max() < self.min_points:
            return None
        kept = len(columns)
        n = np.minimum(state.count[:kept], self.window_bins)
        ready = n >= self.min_points
        out = np.zeros((len(QUANTILES), horizons))
        if not ready.any():
            return out
        n, level, lower = n[ready], state.level[:kept][ready], state.lower[:kept][ready]
        residuals = state.residuals[:, :kept][:, ready]  # NaN (none yet) sorts last
        ordered = np.sort(residuals, axis=2)
        s_lo = _quantiles(ordered[LO], n, (1.0 - level) / 2.0)
        below = np.nansum(residuals[LO] + lower < np.maximum(lower + s_lo[:, None], 0.0), axis=1) / n
        at = columns[ready]
        out[LO, at] = s_lo
        out[MED, at] = _quantiles(ordered[MED], n, np.full(len(n), 0.5))
        out[HI, at] = _quantiles(ordered[HI], n, level + below)
        return out

    def _state(self, target: str, horizons: int) -> _Target:
        kept = len(self._columns(horizons))
        state = self._targets.get(target)
        if state is None or state.residuals.shape[1] < kept:
            w = self.window_bins
            state = self._targets[target] = _Target(
                np.full((len(QUANTILES), kept, w), np.nan), np.full((kept, w), np.nan), np.zeros(kept, np.int64)
            )
        return state
