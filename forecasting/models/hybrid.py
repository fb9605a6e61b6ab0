"""The hybrid model: the lifecycle forecast plus, per (target, horizon), an exponentially
smoothed residual (ETS(A,N,N)) of its own past forecasts."""

from __future__ import annotations

from typing import Self

import numpy as np

from forecasting.models.base import TARGETS, Forecaster, History, Prediction, register
from forecasting.models.lifecycle import Lifecycle


@register
class Hybrid(Forecaster):
    """Lifecycle forecast + per-(target, horizon) exponentially smoothed residual (ETS(A,N,N))."""

    name = "hybrid"

    def __init__(self, alpha: float = 0.1, **lifecycle_params) -> None:
        self.alpha = alpha
        self.base = Lifecycle(**lifecycle_params)
        self._issued: dict[int, Prediction] = {}  # closed-bin count at issue -> base prediction
        self._bias: dict[str, np.ndarray] = {}
        self._seen = 0
        self._base_ok = False

    def update(self, history: History) -> Self:
        self._learn_residuals(history)
        self._seen = history.n_bins
        self.base.update(history)
        return self

    def _learn_residuals(self, history: History) -> None:
        for closed in range(self._seen, history.n_bins):  # bin index `closed` just got its value
            for issued_at, pred in list(self._issued.items()):
                h = closed - issued_at  # issued when `issued_at` bins were closed: bin issued_at is h=1
                horizon = len(next(iter(pred.mean.values())))
                if h < 0 or h >= horizon:
                    continue
                for t in TARGETS:
                    bias = self._bias.setdefault(t, np.zeros(horizon))
                    if len(bias) < horizon:
                        bias = self._bias[t] = np.concatenate([bias, np.zeros(horizon - len(bias))])
                    residual = history.series[t][closed] - pred.mean[t][h]
                    bias[h] += self.alpha * (residual - bias[h])
        oldest = history.n_bins - max((len(next(iter(p.mean.values()))) for p in self._issued.values()), default=0)
        for issued_at in [k for k in self._issued if k < oldest]:
            del self._issued[issued_at]

    def predict(self, horizon_bins: int) -> Prediction:
        base = self.base.predict(horizon_bins)
        self._issued[self._seen] = base
        mean, quantiles, asked = {}, {}, {}
        for t in TARGETS:
            shift = self._bias.get(t, np.zeros(horizon_bins))[:horizon_bins]
            shift = np.pad(shift, (0, horizon_bins - len(shift)))
            mean[t] = np.maximum(base.mean[t] + shift, 0.0)
            quantiles[t] = np.maximum(base.quantiles[t] + shift[None, :], 0.0)
            if t in base.asked:  # the same shift on the flow as asked for (the window's timing)
                asked[t] = np.maximum(base.asked[t] + shift, 0.0)
        return Prediction(mean, quantiles, asked=asked)


__all__ = ["Hybrid"]
