"""Calibrated intervals: conformal shifts make a miscalibrated model's 10-90% interval
cover about 80%, leave the mean and the point forecast alone, and the allocator can
provision on a quantile of the published forecast."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from actors.allocator.demand import forecast_values, from_forecast
from actors.allocator.state import Fleet
from actors.config import AllocatorSection
from bus_schemas.codec import decode
from bus_schemas.forecast import DemandForecast, TargetForecast
from forecasting.calibrate import Conformal
from forecasting.core import CoreConfig, ForecastCore
from forecasting.models import QUANTILES, TARGETS, Prediction
from forecasting.synthetic import synthetic_log

H = 3


def _prediction(center: float, spread: float) -> Prediction:
    """The same forecast for every target: quantiles center ± spread (too narrow on purpose)."""
    q = np.array([[center - spread] * H, [center] * H, [center + spread] * H])
    return Prediction(
        {t: np.full(H, center) for t in TARGETS}, {t: q.copy() for t in TARGETS}, {t: np.full(H, center - 1) for t in TARGETS}
    )


def _ar1(rng: np.random.Generator, n: int) -> np.ndarray:
    y = np.empty(n)
    y[0] = 10.0
    for i in range(1, n):
        y[i] = 10.0 + 0.97 * (y[i - 1] - 10.0) + rng.normal(0, 1.0)
    return np.maximum(y, 0.0)


OUTCOMES = {
    "skewed": lambda rng, n: rng.gamma(2.0, 5.0, size=n),
    "mostly zero": lambda rng, n: np.where(rng.random(n) < 0.6, 0.0, rng.gamma(2.0, 10.0, size=n)),  # a bursty flow
    "correlated": _ar1,  # a level: neighbouring residuals alike
}


@pytest.mark.parametrize("outcome", sorted(OUTCOMES))
def test_shifts_make_a_too_narrow_interval_cover_its_level(outcome):
    rng = np.random.default_rng(0)
    n = 2000
    y = OUTCOMES[outcome](rng, n)  # outcomes around a forecast of 10 ± 1
    series = {t: y for t in TARGETS}
    conformal = Conformal(window_bins=300, min_points=30, horizons=(2,))
    inside_raw, inside, below_median = [], [], []
    for b in range(n - H):
        conformal.observe(series, b)  # bins < b are closed
        p = _prediction(10.0, 1.0)
        out = conformal.adjust(p, b)
        assert out.mean is p.mean and out.point is p.point  # the point forecasts are never changed
        q = out.quantiles["decode_tokens"]
        assert np.all(np.diff(q, axis=0) >= 0) and np.all(q >= 0)
        if b > 400:
            h = 2
            inside_raw.append(9.0 <= y[b + h] <= 11.0)
            inside.append(q[0, h] <= y[b + h] <= q[2, h])
            below_median.append(y[b + h] <= q[1, h])
    assert np.mean(inside_raw) < 0.2  # the model's own interval is far off
    assert 0.75 <= np.mean(inside) <= 0.85
    if outcome != "mostly zero":  # (its median is 0: every outcome at 0 is below it)
        assert 0.45 <= np.mean(below_median) <= 0.55


def test_only_the_published_horizons_are_calibrated():
    conformal = Conformal(window_bins=50, min_points=10, horizons=(2,))
    series = {t: np.full(100, 100.0) for t in TARGETS}
    for b in range(40):
        conformal.observe(series, b)
        out = conformal.adjust(_prediction(10.0, 1.0), b)
    q = out.quantiles["decode_tokens"]
    assert np.array_equal(q[:, 0], [9.0, 10.0, 11.0]) and np.array_equal(q[:, 1], [9.0, 10.0, 11.0])
    assert q[0, 2] > 50.0  # moved up to the outcomes


def test_nothing_is_shifted_before_min_points_residuals():
    conformal = Conformal(window_bins=50, min_points=30)
    series = {t: np.full(100, 100.0) for t in TARGETS}
    for b in range(20):
        conformal.observe(series, b)
        out = conformal.adjust(_prediction(10.0, 1.0), b)
    assert np.array_equal(out.quantiles["decode_tokens"][:, 0], [9.0, 10.0, 11.0])


def test_the_core_publishes_calibrated_quantiles_and_keeps_the_raw_ones():
    events = synthetic_log(40, seed=1, spread_s=20.0)
    core = ForecastCore(CoreConfig(models=("moving_average",), horizons_s=(1.0, 5.0)))
    at_s = events["at_s"].to_numpy()
    start = 0
    for until_s in range(1, int(at_s.max()) + 2):
        cut = int(np.searchsorted(at_s, until_s))
        result = core.tick(events.slice(start, cut - start), float(until_s))
        start = cut
    outcome = result.outcomes["moving_average"]
    assert outcome.raw_quantiles is not None
    moved = [t for t in TARGETS if not np.allclose(outcome.raw_quantiles[t], outcome.prediction.quantiles[t])]
    assert moved  # after a minute of residuals, some target's interval has moved
    off = ForecastCore(CoreConfig(models=("moving_average",), horizons_s=(1.0, 5.0), calibrate=False))
    assert off.calibrators == {}


def _forecast() -> DemandForecast:
    def target(name: str, mean: float) -> TargetForecast:
        return TargetForecast(
            target=name, mean=[mean, mean], quantile_levels=list(QUANTILES), quantiles=[[mean / 2] * 2, [mean] * 2, [mean * 2] * 2]
        )

    return DemandForecast(
        forecaster_id="fc",
        model="lifecycle",
        tick=1,
        as_of_s=10.0,
        computed_at_s=12.0,
        bin_s=1.0,
        horizons_s=[5.0, 10.0],
        targets=[
            target("prefill_new_tokens", 1000.0),
            target("prefill_miss_tokens", 2000.0),
            target("decode_active_seqs", 40.0),
            target("decode_tokens", 500.0),
        ],
        live_trajectories=10,
        events_total=100,
    )


def test_the_allocator_provisions_on_the_mean_or_a_quantile():
    forecast, fleet = _forecast(), Fleet(now_s=12.0, engines=())
    on_mean = from_forecast(forecast, fleet, horizon_s=10.0)
    on_p90 = from_forecast(forecast, fleet, horizon_s=10.0, quantile=0.9)
    assert on_mean.decode_seqs == pytest.approx(40.0) and on_p90.decode_seqs == pytest.approx(80.0)
    assert on_p90.prefill_tokens_per_s == pytest.approx(2 * on_mean.prefill_tokens_per_s)
    assert forecast_values(forecast.targets[2], 0.7) == pytest.approx([60.0, 60.0])  # between the 0.5 and 0.9 levels
    assert forecast_values(forecast.targets[2], 0.05) == pytest.approx([20.0, 20.0])  # clamped to the lowest level


def test_provision_quantile_is_validated_and_old_forecasts_still_decode():
    assert AllocatorSection().provision_quantile == 0.0
    assert AllocatorSection(provision_quantile=0.9).provision_quantile == 0.9
    with pytest.raises(ValueError, match="provision_quantile"):
        AllocatorSection(provision_quantile=1.0)
    fields = msgspec.to_builtins(_forecast())
    del fields["skipped_ticks"]  # a forecast from before the field existed
    assert decode(DemandForecast, msgspec.msgpack.encode(fields)).skipped_ticks == 0
