"""Univariate baselines, one per target: naive, moving average, Holt/ETS and ARIMA.

ETS and ARIMA (statsmodels) re-estimate their parameters every `refit_every` updates on
the last `window_bins` bins and, in between, only filter the new bins with the fitted
parameters — the usual way to run them every second. Quantiles are normal around the
point forecast, with the spread of the model's own one-step errors growing with √h.
"""

from __future__ import annotations

import warnings
from typing import Any, Self

import numpy as np

from forecasting.models.base import TARGETS, FitError, Forecaster, History, Prediction, register, require_bins


class Univariate(Forecaster):
    """Fits one state per target; subclasses implement _fit_one / _update_one / _predict_one."""

    min_bins = 1

    def __init__(self) -> None:
        self._states: dict[str, Any] = {}
        self._seen = 0

    def update(self, history: History) -> Self:
        require_bins(history, self.min_bins, self.name)
        states = {}  # all targets or none: a failure leaves the model as it was
        for target in TARGETS:
            y = history.series[target]
            state = self._states.get(target)
            states[target] = self._fit_one(y) if state is None else self._update_one(state, y, self._seen)
        self._states, self._seen = states, history.n_bins
        return self

    def predict(self, horizon_bins: int) -> Prediction:
        if not self._states:
            raise FitError(f"{self.name}: predict before update")
        means, sds = {}, {}
        for target, state in self._states.items():
            means[target], sds[target] = self._predict_one(state, horizon_bins)
        return Prediction.normal(means, sds)

    def _fit_one(self, y: np.ndarray) -> Any:
        raise NotImplementedError

    def _update_one(self, state: Any, y: np.ndarray, seen: int) -> Any:
        return self._fit_one(y)

    def _predict_one(self, state: Any, h: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError


def _sqrt_h(h: int) -> np.ndarray:
    return np.sqrt(np.arange(1, h + 1, dtype=float))


@register
class Naive(Univariate):
    """The last closed bin, for every horizon."""

    name = "naive"

    def __init__(self, window_bins: int = 120) -> None:
        super().__init__()
        self.window_bins = window_bins

    def _fit_one(self, y: np.ndarray) -> tuple[float, float]:
        tail = y[-self.window_bins :]
        return float(y[-1]), float(np.std(np.diff(tail))) if len(tail) > 1 else 0.0

    def _predict_one(self, state, h):
        last, sd = state
        return np.full(h, last), sd * _sqrt_h(h)


@register
class MovingAverage(Univariate):
    name = "moving_average"

    def __init__(self, window_bins: int = 10) -> None:
        super().__init__()
        self.window_bins = window_bins

    def _fit_one(self, y: np.ndarray) -> tuple[float, float]:
        tail = y[-self.window_bins :]
        return float(tail.mean()), float(tail.std()) * np.sqrt(1 + 1 / len(tail))

    def _predict_one(self, state, h):
        mean, sd = state
        return np.full(h, mean), np.full(h, sd)


class _Refitting(Univariate):
    min_bins = 20

    def __init__(self, refit_every: int = 30, window_bins: int = 300) -> None:
        super().__init__()
        self.refit_every = refit_every
        self.window_bins = window_bins
        self._updates = 0

    def update(self, history: History) -> Self:
        self._updates += 1
        if self._updates % self.refit_every == 1 or self.refit_every == 1:
            self._states.clear()  # re-estimate the parameters on this update
        return super().update(history)


@register
class Holt(_Refitting):
    """Holt's linear method with a damped additive trend (ETS(A,Ad,N)), statsmodels fit."""

    name = "ets"

    def _fit_one(self, y: np.ndarray) -> dict:
        from statsmodels.tsa.holtwinters import Holt as SmHolt

        window = np.asarray(y[-self.window_bins :], float)
        if np.ptp(window) == 0:  # constant: nothing to estimate
            return dict(alpha=1.0, beta=0.0, phi=1.0, level=float(window[-1]), trend=0.0, sd=0.0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fit = SmHolt(window, damped_trend=True, initialization_method="estimated").fit()
        p = fit.params
        if not np.isfinite(fit.level[-1]):
            raise FitError("ets: non-finite level after fit")
        return dict(
            alpha=float(p["smoothing_level"]),
            beta=float(p["smoothing_trend"]),
            phi=float(p["damping_trend"]),
            level=float(fit.level[-1]),
            trend=float(fit.trend[-1]),
            sd=float(np.std(fit.resid)),
        )

    def _update_one(self, s: dict, y: np.ndarray, seen: int) -> dict:
        level, trend = s["level"], s["trend"]
        for value in y[seen:]:
            prev = level
            level = s["alpha"] * value + (1 - s["alpha"]) * (prev + s["phi"] * trend)
            trend = s["beta"] * (level - prev) + (1 - s["beta"]) * s["phi"] * trend
        return {**s, "level": level, "trend": trend}

    def _predict_one(self, s, h):
        damp = np.cumsum(s["phi"] ** np.arange(1, h + 1))
        return s["level"] + damp * s["trend"], s["sd"] * _sqrt_h(h)


@register
class Arima(_Refitting):
    """ARIMA(p, d, q) by statsmodels; new bins are filtered with `extend` between refits."""

    name = "arima"

    def __init__(self, order: tuple[int, int, int] = (1, 1, 1), **kw: Any) -> None:
        super().__init__(**kw)
        self.order = tuple(order)

    def _fit_one(self, y: np.ndarray):
        from statsmodels.tsa.arima.model import ARIMA

        window = np.asarray(y[-self.window_bins :], float)
        if np.ptp(window) == 0:
            return ("constant", float(window[-1]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ARIMA(window, order=self.order).fit()

    def _update_one(self, res, y: np.ndarray, seen: int):
        new = np.asarray(y[seen:], float)
        if isinstance(res, tuple):
            return self._fit_one(y) if np.ptp(y[-self.window_bins :]) > 0 else ("constant", float(y[-1]))
        if len(new) == 0:
            return res
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return res.extend(new)

    def _predict_one(self, res, h):
        if isinstance(res, tuple):
            return np.full(h, res[1]), np.zeros(h)
        forecast = res.get_forecast(h)
        mean, sd = np.asarray(forecast.predicted_mean), np.sqrt(np.asarray(forecast.var_pred_mean))
        if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(sd))):
            raise FitError("arima: non-finite forecast")
        return mean, sd
