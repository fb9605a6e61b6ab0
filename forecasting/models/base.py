"""The one interface every forecaster implements, and the registry of models by name.

    model = make("ets")                       # a fresh instance from the registry
    model.fit(history)                        # full fit on everything so far
    model.update(history)                     # each tick: history grew by >= 1 closed bin
    p = model.predict(horizon_bins)           # p.mean[target][h-1]: bin h after now
                                              # p.quantiles[target][i, h-1]: QUANTILES[i]
                                              # p.point_forecast(target): what MAE scores

Targets are totals over task families, per bin of `history.bin_s`: flows are per-bin sums,
levels per-bin time-weighted means (see forecasting.series). A model that cannot fit
(too little history, a numerical failure) raises FitError naming why; the caller
(forecasting.core) then falls back to naive for that tick and counts it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, ClassVar, Self

import numpy as np

from forecasting.live import LiveState

TARGETS = (
    "prefill_new_tokens",
    "prefill_miss_tokens",
    "prefill_engine_s",
    "decode_active_seqs",
    "decode_tokens",
    "decode_engine_s",
    "live_kv_tokens",
)
QUANTILES = (0.1, 0.5, 0.9)  # the 10-90 % interval is what coverage is measured on
_Z = np.array([NormalDist().inv_cdf(q) for q in QUANTILES])


class FitError(ValueError):
    """The model cannot produce a forecast on this history; the message says why."""


@dataclass(slots=True)
class History:
    bin_s: float
    now_s: float  # end of the last closed bin
    series: dict[str, np.ndarray]  # target -> value of every closed bin since t = 0
    live: LiveState | None = None  # trajectories and learned distributions (lifecycle models)

    @property
    def n_bins(self) -> int:
        return len(next(iter(self.series.values()))) if self.series else 0


@dataclass(slots=True)
class Prediction:
    mean: dict[str, np.ndarray]  # target -> (H,)
    quantiles: dict[str, np.ndarray]  # target -> (len(QUANTILES), H)
    # target -> (H,): the point forecast where it is not the mean (the median, which
    # minimises absolute error, of a zero-inflated heavy-tailed flow); demand consumers
    # (the allocator) use the mean, accuracy tables score the point forecast
    point: dict[str, np.ndarray] = field(default_factory=dict)
    # target -> (H,): a flow timed when its work is asked for, where the model tells that from
    # when the series counts it (a prefill's compute: queued, against done); the window
    # mean uses it: over a window, what capacity must serve is the work asked for, and timed
    # when done, work a short-handed stage pushes past the window would not show
    asked: dict[str, np.ndarray] = field(default_factory=dict)

    def point_forecast(self, target: str) -> np.ndarray:
        return self.point.get(target, self.mean[target])

    def window_mean(self, target: str, hi: int) -> float:
        """The mean forecast over horizon indices 0..hi: the demand of the next hi + 1 bins,
        per bin, as asked for (what the allocator sizes on; runners.replay --score window
        scores it)."""
        return float(self.asked.get(target, self.mean[target])[: hi + 1].mean())

    @staticmethod
    def normal(mean: dict[str, np.ndarray], sd: dict[str, np.ndarray]) -> Prediction:
        """Quantiles from a normal with the given sd, clipped at 0 (demand is never negative)."""
        quantiles = {t: np.maximum(mean[t][None, :] + _Z[:, None] * sd[t][None, :], 0.0) for t in mean}
        return Prediction({t: np.maximum(m, 0.0) for t, m in mean.items()}, quantiles)


class Forecaster(ABC):
    name: ClassVar[str]

    def fit(self, history: History) -> Self:
        return self.update(history)

    @abstractmethod
    def update(self, history: History) -> Self: ...

    @abstractmethod
    def predict(self, horizon_bins: int) -> Prediction: ...


REGISTRY: dict[str, Callable[..., Forecaster]] = {}


def register(cls: type[Forecaster]) -> type[Forecaster]:
    REGISTRY[cls.name] = cls
    return cls


def make(name: str, **params: Any) -> Forecaster:
    import forecasting.models  # noqa: F401  (fills the registry)

    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r} (known: {', '.join(sorted(REGISTRY))})")
    return REGISTRY[name](**params)


def require_bins(history: History, needed: int, who: str) -> None:
    if history.n_bins < needed:
        raise FitError(f"{who} needs >= {needed} bins of history, has {history.n_bins}")
