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

import numpy as np

from forecasting.models.base import QUANTILES, TARGETS, Prediction

LO, MED, HI = QUANTILES.index(0.1), QUANTILES.index(0.5), QUANTILES.index(0.9)
COVERAGE = QUANTILES[HI] - QUANTILES[LO]  # what the 10-90% interval should hold


def _quantiles(sorted_values: np.ndarray, n: np.ndarray, level: np.ndarray) -> np.ndarray:
    """Per row, the `level` quantile (linear interpolation) of its first n sorted values."""
    position = np.clip(level, 0.0, 1.0) * np.maximum(n - 1, 0)
    below = np.floor(position).astype(np.int64)
    above = np.minimum(below + 1, np.maximum(n - 1, 0))
    rows = np.arange(len(n))
    low, high = sorted_values[rows, below], sorted_values[rows, above]
    return low + (position - below) * (high - low)


class Conformal:
    """All targets at once: residuals (targets, levels, horizons kept, window), the raw lower
    quantile of each, and each (target, horizon)'s level c."""

    def __init__(self, window_bins: int = 300, min_points: int = 30, gamma: float = 0.01, horizons: tuple[int, ...] | None = None) -> None:
        """horizons: the horizon indices (bin h + 1 after now) to calibrate, the ones that are
        published and scored; None: all."""
        if window_bins < 1 or min_points < 1 or not 0 <= gamma < 1:
            raise ValueError("window_bins and min_points must be >= 1, gamma in [0, 1)")
        self.window_bins, self.min_points, self.gamma = window_bins, min_points, gamma
        self.horizons = None if horizons is None else np.array(sorted(set(horizons)), np.int64)
        # bins closed at issue -> (raw quantiles (T, L, H), published lower (T, H), published upper (T, H))
        self._issued: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._columns: np.ndarray | None = None  # the horizon indices kept
        self._seen = 0  # bins whose residuals have been taken

    def observe(self, series: dict[str, np.ndarray], n_bins: int) -> None:
        """Take the residuals of every issued forecast for the bins closed since the last call."""
        for b in range(self._seen, n_bins):
            y = np.array([series[t][b] for t in TARGETS])
            for issued_at, (raw, lower, upper) in self._issued.items():
                column = self._column(b - issued_at)  # bin issued_at is horizon index 0
                if column < 0:
                    continue
                h = self._columns[column]
                at = self.count[column] % self.window_bins
                self.residuals[:, :, column, at] = y[:, None] - raw[:, :, h]
                self.lower[:, column, at] = raw[:, LO, h]
                self.count[column] += 1
                covered = (lower[:, h] <= y) & (y <= upper[:, h])
                self.level[:, column] = np.clip(self.level[:, column] + self.gamma * (COVERAGE - covered), 0.5, 0.99)
        self._seen = max(self._seen, n_bins)
        for issued_at in [k for k, v in self._issued.items() if k + v[0].shape[2] <= self._seen]:
            del self._issued[issued_at]

    def adjust(self, prediction: Prediction, issued_at: int) -> Prediction:
        """The prediction with calibrated quantiles; remembers them to learn from."""
        raw = np.stack([prediction.quantiles[t] for t in TARGETS])  # (T, L, H)
        if self._columns is None:
            self._start(raw.shape[2])
        calibrated = raw
        shift = self.shift()
        if shift is not None:
            calibrated = raw.copy()
            calibrated[:, :, self._columns] = np.sort(np.maximum(raw[:, :, self._columns] + shift, 0.0), axis=1)
        self._issued[issued_at] = (raw, calibrated[:, LO].copy(), calibrated[:, HI].copy())
        quantiles = dict(prediction.quantiles) | {t: calibrated[i] for i, t in enumerate(TARGETS)}
        return Prediction(prediction.mean, quantiles, prediction.point, prediction.asked)

    def shift(self) -> np.ndarray | None:
        """(targets, levels, horizons kept): the shift of each quantile; None: too few residuals
        yet anywhere (0 where a horizon has too few)."""
        if self._columns is None or self.count.max() < self.min_points:
            return None
        n_targets, _, kept, _ = self.residuals.shape
        out = np.zeros((n_targets, len(QUANTILES), kept))
        n = np.minimum(self.count, self.window_bins)
        ready = n >= self.min_points
        rows = n_targets * int(ready.sum())
        n_rows = np.tile(n[ready], n_targets)
        residuals = self.residuals[:, :, ready]  # (T, L, R, W); NaN (none yet) sorts last
        ordered = np.sort(residuals, axis=3)
        level = self.level[:, ready].reshape(rows)
        lower = self.lower[:, ready].reshape(rows, -1)
        s_lo = _quantiles(ordered[:, LO].reshape(rows, -1), n_rows, (1.0 - level) / 2.0)
        below = np.nansum(residuals[:, LO].reshape(rows, -1) + lower < np.maximum(lower + s_lo[:, None], 0.0), axis=1) / n_rows
        out[:, LO, ready] = s_lo.reshape(n_targets, -1)
        out[:, MED, ready] = _quantiles(ordered[:, MED].reshape(rows, -1), n_rows, np.full(rows, 0.5)).reshape(n_targets, -1)
        out[:, HI, ready] = _quantiles(ordered[:, HI].reshape(rows, -1), n_rows, level + below).reshape(n_targets, -1)
        return out

    def _start(self, horizons: int) -> None:
        every = np.arange(horizons)
        self._columns = every if self.horizons is None else self.horizons[self.horizons < horizons]
        kept, w = len(self._columns), self.window_bins
        self._lookup = np.full(horizons, -1)
        self._lookup[self._columns] = np.arange(kept)
        self.residuals = np.full((len(TARGETS), len(QUANTILES), kept, w), np.nan)
        self.lower = np.full((len(TARGETS), kept, w), np.nan)
        self.count = np.zeros(kept, np.int64)
        self.level = np.full((len(TARGETS), kept), COVERAGE)

    def _column(self, h: int) -> int:
        """Where horizon index h is kept (-1: not calibrated)."""
        return int(self._lookup[h]) if 0 <= h < len(self._lookup) else -1
