"""The KV footprint target (`live_kv_tokens`): the forecaster's series of it is the oracle's
reading of the log however the ticks are cut, and the lifecycle model forecasts it from each
live trajectory's phase: turns add their new and generated tokens, a finishing trajectory
lets its whole context go."""

from __future__ import annotations

import numpy as np
import pytest

from forecasting.core import CoreConfig, ForecastCore
from forecasting.models.lifecycle import Lifecycle
from forecasting.series import LIVE_KV, live_context_by_bin
from forecasting.synthetic import synthetic_log
from tests.forecast_helpers import history_at
from tests.test_forecasting_lifecycle import _burst


def _ticked(events, tick_s: int, until_s: int, models=("naive",)) -> ForecastCore:
    core = ForecastCore(CoreConfig(models=models, horizons_s=(1.0, 30.0)))
    at_s = events["at_s"].to_numpy()
    for t in range(tick_s, until_s + 1, tick_s):
        core.tick(events.filter((at_s >= t - tick_s) & (at_s < t)), float(t))
    return core


def test_the_live_kv_series_is_the_oracle_s_reading_however_the_ticks_are_cut():
    events = synthetic_log(40, seed=5, spread_s=10.0, max_turns=6)
    until_s = 60
    expected = live_context_by_bin(events.filter(events["at_s"] < until_s), 1.0, until_s)
    assert expected.max() > 0 and expected[-1] < expected.max()  # it rises, then trajectories finish
    for tick_s in (1, 3):  # 3: every tick closes three bins (a forecaster skipping ahead)
        series = _ticked(events, tick_s, until_s).series[LIVE_KV].view()
        np.testing.assert_array_equal(series, expected)


def test_an_opening_burst_holds_its_prompts_as_the_queue_drains_them():
    """400 prompts of 300 tokens, one prefilled every 50 ms: at 5 s the 99 prefilled hold
    their prompts; the other 301 are held as the queue drains them, all by the bin it empties
    in (15-16 s ahead)."""
    n = 400
    history = history_at(_burst([0.05 * (i + 1) for i in range(n)], [None] * n), 5)
    kv = Lifecycle().update(history).predict(30).mean[LIVE_KV]
    assert 99 * 300.0 < kv[0] < 120 * 300.0  # about 20 more prefilled within the first second
    assert np.all(np.diff(kv[:16]) > 0) and kv[14] < n * 300.0
    assert kv[15:] == pytest.approx([n * 300.0] * 15)


def test_the_forecast_sees_trajectories_finish_where_persistence_does_not():
    """Past the starts, the live trajectories take turns and finish: 30 s ahead the
    lifecycle model's KV is closer to what the log holds than the KV of now, on average over
    the run's second half."""
    events = synthetic_log(60, seed=2, spread_s=10.0, min_turns=2, max_turns=8)
    end_s = int(events["at_s"].max())
    actual = live_context_by_bin(events, 1.0, end_s + 1)
    errors, persistence = [], []
    for now_s in range(end_s // 2, end_s - 30, 5):
        core = _ticked(events, 1, now_s, models=("lifecycle",))
        forecast = core.models["lifecycle"].predict(30).mean[LIVE_KV]
        assert np.all(forecast >= -1e-6)
        errors.append(abs(forecast[-1] - actual[now_s + 29]))
        persistence.append(abs(actual[now_s - 1] - actual[now_s + 29]))
    assert len(errors) >= 3
    assert np.mean(errors) < 0.6 * np.mean(persistence)
