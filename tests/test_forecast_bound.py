"""The ceiling on decode-token bin forecasts without output lengths (forecasting.bound,
runners.forecast_bound)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from forecasting.bound import bound_forecast, decodes
from forecasting.synthetic import synthetic_log
from runners import forecast_bound, replay


@pytest.fixture(scope="module")
def log() -> pl.DataFrame:
    return synthetic_log(trajectories=30, seed=5, spread_s=30.0)


def test_with_one_length_per_family_the_bound_is_exact(log):
    """Lengths the same for every decode: the only unknown is gone, so knowing each running
    decode's pace the bound calls every bin (its paces differ, so ends are not trivial)."""
    fixed = log.with_columns(pl.when(pl.col("kind") == "decode_done").then(400).otherwise(pl.col("generated_tokens")).alias("generated_tokens"))
    d = decodes(fixed)
    assert np.ptp(d.pace_s_per_token) > 0
    table = forecast_bound.score(fixed, [5.0, 10.0])
    assert table["ticks"].min() > 100
    assert table["bound_mae"].to_list() == pytest.approx([0.0, 0.0], abs=1e-9)
    assert (table["naive_mae"] > 0).all()


def test_with_random_lengths_the_bound_does_not_know_them(log):
    """The synthetic decodes draw their lengths (50-800 tokens): the bound errs (it does not
    read the lengths of the decodes still running), and still beats the naive forecast."""
    table = forecast_bound.score(log, [5.0])
    bound, naive = table["bound_mae"][0], table["naive_mae"][0]
    assert 0 < bound < naive


def test_a_decode_started_after_the_tick_is_known_exactly(log):
    """At a tick before any decode started, every decode in the bin is one that starts later:
    the bound gives its tokens exactly."""
    d = decodes(log)
    t = float(d.started_s.min()) - 0.5
    ends = d.done_s[(d.done_s >= t + 9) & (d.done_s < t + 10)]
    assert len(ends) > 0
    forecast = bound_forecast(d, np.array([t]), 10.0)
    truth = d.tokens[(d.done_s >= t + 9) & (d.done_s < t + 10)].sum()
    assert forecast[0] == pytest.approx(truth)


def test_the_runner_prints_the_gains_beside_a_replays_models(log, tmp_path, capsys):
    path = tmp_path / "events.parquet"
    log.write_parquet(path)
    out = tmp_path / "replay"
    assert replay.main([str(path), "--models", "ets", "arima", "lifecycle", "--horizons", "5", "--score", "bin", "median", "--out", str(out)]) == 0
    capsys.readouterr()
    assert forecast_bound.main([str(path), "--horizons", "5", "--accuracy", str(out / "accuracy.csv")]) == 0
    printed = capsys.readouterr().out
    assert "bound_mae" in printed and "lifecycle" in printed and "median" in printed
    gains = forecast_bound.gains(forecast_bound.score(log, [5.0]), pl.read_csv(out / "accuracy.csv"))
    assert set(gains["score"]) == {"bin", "median"} and gains["bound"].is_finite().all()


def test_bad_input_is_one_line_and_exit_2(log, tmp_path, capsys):
    assert forecast_bound.main([str(tmp_path / "missing.parquet")]) == 2
    assert "error:" in capsys.readouterr().err
    path = tmp_path / "events.parquet"
    log.write_parquet(path)
    two = tmp_path / "two.csv"
    pl.DataFrame({"log": ["a", "b"], "score": ["bin", "bin"], "model": ["ets", "ets"], "target": ["decode_tokens"] * 2, "horizon_s": [5.0, 5.0], "mae": [1.0, 2.0]}).write_csv(two)
    assert forecast_bound.main([str(path), "--horizons", "5", "--accuracy", str(two)]) == 2
    assert "scores several logs" in capsys.readouterr().err
