"""Every registered model holds to the one interface (the contract test), and a model that
cannot fit falls back to naive for that tick, counted and reported."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from forecasting.core import CoreConfig, ForecastCore
from forecasting.live import LiveState
from forecasting.models import QUANTILES, REGISTRY, TARGETS, FitError, History, make
from forecasting.synthetic import synthetic_log


@pytest.fixture(scope="module")
def history() -> History:
    """A replayed synthetic rollout: 120 closed bins and the live state at t = 120 s."""
    core = ForecastCore(CoreConfig(models=("naive",)))
    events = synthetic_log(trajectories=40, seed=1)
    at_s = events["at_s"].to_numpy()
    start = 0
    for until_s in range(1, 121):
        cut = int(np.searchsorted(at_s, until_s))
        core.tick(events.slice(start, cut - start), float(until_s))
        start = cut
    return History(1.0, 120.0, {t: s.view().copy() for t, s in core.series.items()}, core.live)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_model_fits_updates_and_predicts_every_target_with_ordered_quantiles(name, history):
    model = make(name)
    assert model.name == name
    assert model.fit(history) is model
    prediction = model.predict(7)
    assert set(prediction.mean) == set(TARGETS) == set(prediction.quantiles)
    for target in TARGETS:
        mean, q = prediction.mean[target], prediction.quantiles[target]
        assert mean.shape == (7,) and q.shape == (len(QUANTILES), 7)
        assert np.all(np.isfinite(mean)) and np.all(mean >= 0) and np.all(q >= 0)
        assert np.all(np.diff(q, axis=0) >= -1e-9), f"{name}/{target}: quantiles out of order"
    longer = History(1.0, 121.0, {t: np.append(v, v[-1]) for t, v in history.series.items()}, history.live)
    assert model.update(longer) is model and model.predict(3).mean[TARGETS[0]].shape == (3,)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_model_says_why_it_cannot_fit_an_empty_history(name):
    empty = History(1.0, 0.0, {t: np.zeros(0) for t in TARGETS}, LiveState())
    with pytest.raises(FitError):
        make(name).fit(empty).predict(3)


def test_unknown_model_name_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'prophet'.*naive"):
        make("prophet")


def test_a_failed_fit_falls_back_to_naive_and_is_counted():
    core = ForecastCore(CoreConfig(models=("arima", "lifecycle"), horizons_s=(1.0, 2.0)))
    empty = pl.DataFrame(schema=synthetic_log(trajectories=1, seed=0).schema)
    first = core.tick(empty, 1.0)  # one bin: too little for ARIMA, no turn seen by lifecycle
    for name in ("arima", "lifecycle"):
        outcome = first.outcomes[name]
        assert outcome.fallback_reason and outcome.fallbacks_total == 1
        assert np.array_equal(outcome.prediction.mean["decode_active_seqs"], np.zeros(2))
    assert "arima needs >= 20 bins" in first.outcomes["arima"].fallback_reason
    assert "no prefill finished" in first.outcomes["lifecycle"].fallback_reason
    assert core.tick(empty, 2.0).outcomes["arima"].fallbacks_total == 2
