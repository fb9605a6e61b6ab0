"""Calibrated quantiles: split-conformal shifts learned from each model's recent errors.

    tick t:   raw = model.predict(H)            quantiles q_l(h) for levels l, horizons h
              published = raw + shift[l, h]      (clipped at 0, kept in level order)
    later:    bin b closes with value y; every forecast issued for it (b = issued + h - 1)
              adds y - raw q_l(h) to the recent residuals of (target, l, h)
    shift[l, h] = the l-quantile of those residuals (the last `window_bins` of them)

So each published quantile q_l covers a share l of the recent outcomes at its horizon, and
the 10-90% interval 80% of them, whatever the model's own spread says (a normal spread
around a lifecycle forecast is too narrow; one around ETS too wide). The shift is the
quantile of the residuals of the same level, so an asymmetric error (a flow that is mostly
zero with rare large bins) moves the upper quantile and leaves the lower one. Until a
(target, horizon) has `min_points` residuals its quantiles go out as the model made them.
The mean and the point forecast are never changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from forecasting.models.base import QUANTILES, TARGETS, Prediction

LEVELS = np.asarray(QUANTILES)


@dataclass(slots=True)
class _Ring:
    """The last `window` residuals per (level, horizon), NaN where there are none yet."""

    values: np.ndarray  # (levels, horizons, window)
    count: np.ndarray  # (horizons,): residuals seen so far per horizon

    def add(self, h: int, residuals: np.ndarray) -> None:
        window = self.values.shape[2]
        self.values[:, h, self.count[h] % window] = residuals
        self.count[h] += 1


class Conformal:
    def __init__(self, window_bins: int = 300, min_points: int = 30) -> None:
        if window_bins < 1 or min_points < 1:
            raise ValueError("window_bins and min_points must be >= 1")
        self.window_bins = window_bins
        self.min_points = min_points
        self._issued: dict[int, dict[str, np.ndarray]] = {}  # bins closed at issue -> raw quantiles per target
        self._rings: dict[str, _Ring] = {}
        self._seen = 0  # bins whose residuals have been taken

    def observe(self, series: dict[str, np.ndarray], n_bins: int) -> None:
        """Take the residuals of every issued forecast for the bins closed since the last call."""
        for b in range(self._seen, n_bins):
            for issued_at, raw in self._issued.items():
                for target, q in raw.items():
                    h = b - issued_at  # bin issued_at is horizon index 0
                    if 0 <= h < q.shape[1]:
                        self._ring(target, q.shape[1]).add(h, series[target][b] - q[:, h])
        self._seen = max(self._seen, n_bins)
        for issued_at in [k for k, raw in self._issued.items() if k + _horizon(raw) <= self._seen]:
            del self._issued[issued_at]

    def adjust(self, prediction: Prediction, issued_at: int) -> Prediction:
        """The prediction with calibrated quantiles; remembers the raw ones to learn from."""
        self._issued[issued_at] = {t: prediction.quantiles[t].copy() for t in TARGETS if t in prediction.quantiles}
        quantiles = dict(prediction.quantiles)
        for target, q in prediction.quantiles.items():
            shift = self.shift(target, q.shape[1])
            if shift is not None:
                quantiles[target] = np.sort(np.maximum(q + shift, 0.0), axis=0)
        return Prediction(prediction.mean, quantiles, prediction.point)

    def shift(self, target: str, horizons: int) -> np.ndarray | None:
        """(levels, horizons): the shift of each quantile; 0 where too few residuals yet."""
        ring = self._rings.get(target)
        if ring is None or ring.values.shape[1] < horizons or ring.count.max() < self.min_points:
            return None
        values = ring.values[:, :horizons]
        out = np.zeros((len(LEVELS), horizons))
        ready = ring.count[:horizons] >= self.min_points
        for i, level in enumerate(LEVELS):
            out[i, ready] = np.nanquantile(values[i, ready], level, axis=1)
        return out

    def _ring(self, target: str, horizons: int) -> _Ring:
        ring = self._rings.get(target)
        if ring is None or ring.values.shape[1] < horizons:
            ring = self._rings[target] = _Ring(np.full((len(LEVELS), horizons, self.window_bins), np.nan), np.zeros(horizons, np.int64))
        return ring


def _horizon(raw: dict[str, np.ndarray]) -> int:
    return max((q.shape[1] for q in raw.values()), default=0)
