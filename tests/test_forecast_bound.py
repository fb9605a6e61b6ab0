"""The ceiling on decode-token bin forecasts without output lengths (forecasting.bound,
runners.forecast_bound)."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from forecasting.bound import Decodes, bound_forecast, decodes
from forecasting.core import CoreConfig
from forecasting.synthetic import synthetic_log
from runners import forecast_bound, replay


@pytest.fixture(scope="module")
def log() -> pl.DataFrame:
    return synthetic_log(trajectories=30, seed=5, spread_s=30.0)


def test_with_one_length_per_family_the_bound_is_exact(log):
    """Lengths the same for every decode: the only unknown is gone, so knowing each running
    decode's pace the bound calls every bin (its paces differ, so ends are not trivial)."""
    fixed = log.with_columns(
        pl.when(pl.col("kind") == "decode_done").then(400).otherwise(pl.col("generated_tokens")).alias("generated_tokens")
    )
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


def test_a_running_decode_draws_its_length_from_the_others_longer_than_its_tokens_so_far():
    """A decode of 1,000 tokens at 10 ms a token, 2 s in (200 tokens so far); its family's other
    lengths are 100 and 1,000. It cannot be 100 any more, and its own length is left out of the
    pool, so every draw is the other 1,000: it ends at 10 s, in the bin [10, 11)."""
    d = Decodes(
        started_s=np.array([0.0, 100.0, 200.0]),
        done_s=np.array([10.0, 101.0, 210.0]),
        tokens=np.array([1000.0, 100.0, 1000.0]),
        family=np.array(["f", "f", "f"]),
    )
    assert bound_forecast(d, np.array([2.0]), 9.0)[0] == 1000.0  # bin [10, 11)
    assert bound_forecast(d, np.array([2.0]), 5.0)[0] == 0.0  # bin [6, 7): it is still running
    alone = Decodes(d.started_s[:2], d.done_s[:2], np.array([1000.0, 100.0]), d.family[:2])
    assert bound_forecast(alone, np.array([2.0]), 9.0)[0] == 0.0  # no other length as long: nothing to draw


@pytest.mark.parametrize("bin_s, horizon_s", [(1.0, 5.0), (2.0, 10.0)])
def test_the_bound_scores_the_ticks_and_bins_a_replay_scores(log, bin_s, horizon_s):
    """The same ticks and bins as `runners.replay` with one tick per bin, also for a log whose
    last event sits on a bin edge: the naive forecast's MAE on decode tokens agrees to the last digit."""
    edge = log.with_columns(pl.col("at_s") + (np.ceil(log["at_s"].max()) - log["at_s"].max()))
    for events in (log, edge):
        cfg = CoreConfig(models=("naive",), bin_s=bin_s, horizons_s=(horizon_s,))
        results, _ = replay.replay(events, cfg)
        actual = replay.actuals(events, cfg, results[-1].as_of_s)
        naive = next(s for s in replay.align(results, cfg, actual, float(events["at_s"].min())) if s.target == "decode_tokens")
        table = forecast_bound.score(events, [horizon_s], bin_s, samples=20)
        assert table["ticks"][0] == len(naive.actual)
        assert table["naive_mae"][0] == pytest.approx(float(np.abs(naive.actual - naive.forecast).mean()), rel=1e-12)
    with pytest.raises(ValueError, match="not a positive multiple"):
        forecast_bound.score(log, [2.5], 1.0)


def test_the_runner_prints_the_gains_beside_a_replays_models(log, tmp_path, capsys):
    path = tmp_path / "events.parquet"
    log.write_parquet(path)
    out = tmp_path / "replay"
    assert (
        replay.main([str(path), "--models", "ets", "arima", "lifecycle", "--horizons", "5", "--score", "bin", "median", "--out", str(out)])
        == 0
    )
    capsys.readouterr()
    assert forecast_bound.main([str(path), "--horizons", "5", "--accuracy", str(out / "accuracy.csv")]) == 0
    printed = capsys.readouterr().out
    assert "bound_mae" in printed and "lifecycle" in printed and "median" in printed
    gains = forecast_bound.gains(forecast_bound.score(log, [5.0]), pl.read_csv(out / "accuracy.csv"))
    assert set(gains["score"]) == {"bin", "median"} and gains["bound"].is_finite().all()


def test_bad_input_is_one_line_and_exit_2(log, tmp_path, capsys):
    assert forecast_bound.main([str(tmp_path / "missing.parquet")]) == 2
    assert "error:" in capsys.readouterr().err
    empty = tmp_path / "empty.parquet"
    log.clear().write_parquet(empty)
    assert forecast_bound.main([str(empty)]) == 2
    assert "the log is empty" in capsys.readouterr().err
    path = tmp_path / "events.parquet"
    log.write_parquet(path)
    two = tmp_path / "two.csv"
    rows = {
        "log": ["a", "b"],
        "score": ["bin", "bin"],
        "model": ["ets", "ets"],
        "target": ["decode_tokens"] * 2,
        "horizon_s": [5.0, 5.0],
        "points": [9, 9],
        "mae": [1.0, 2.0],
    }
    pl.DataFrame(rows).write_csv(two)
    assert forecast_bound.main([str(path), "--horizons", "5", "--accuracy", str(two)]) == 2
    assert "scores several logs" in capsys.readouterr().err
    other = tmp_path / "other.csv"
    pl.DataFrame({k: v[:1] for k, v in rows.items()}).write_csv(other)  # one log, but 9 points: not these ticks
    assert forecast_bound.main([str(path), "--horizons", "5", "--accuracy", str(other)]) == 2
    assert "not the same log, bins or ticks" in capsys.readouterr().err
    bare = tmp_path / "bare.csv"
    pl.DataFrame({"log": ["a"], "mae": [1.0]}).write_csv(bare)
    assert forecast_bound.main([str(path), "--horizons", "5", "--accuracy", str(bare)]) == 2
    assert "lacks" in capsys.readouterr().err


def test_the_decodes_come_in_one_order_whatever_the_logs(log):
    """The Monte Carlo draws follow the decodes' order, so it must not depend on the order of
    the log's rows (nor on a join's): the same bound every run."""
    shuffled = log.sample(fraction=1.0, shuffle=True, seed=1)
    a, b = decodes(log), decodes(shuffled)
    for name in ("started_s", "done_s", "tokens", "family"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    ticks = np.arange(5.0, 60.0)
    assert np.array_equal(bound_forecast(a, ticks, 5.0, samples=50), bound_forecast(b, ticks, 5.0, samples=50))
