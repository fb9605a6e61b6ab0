"""The replay runner and the log loader: a good log is scored, a bad one is refused with
one line that names the problem."""

from __future__ import annotations

import logging
from pathlib import Path

import polars as pl
import pytest

from forecasting.models import TARGETS
from forecasting.models.base import QUANTILES
from forecasting.synthetic import synthetic_log
from ops.export import EventLogError, load_events
from runners import replay


@pytest.fixture(scope="module")
def log_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("log") / "events.parquet"
    synthetic_log(trajectories=30, seed=5, spread_s=30.0).write_parquet(path)
    return path


def test_replay_writes_the_accuracy_table_and_the_plot(log_path, tmp_path):
    out = tmp_path / "out"
    assert replay.main([str(log_path), "--models", "lifecycle", "moving_average", "--horizons", "1", "5", "--out", str(out)]) == 0
    table = pl.read_csv(out / "accuracy.csv")
    assert {"model", "target", "horizon_s", "mae", "smape", "mase", "coverage"} <= set(table.columns)
    assert set(table["model"]) == {"naive", "lifecycle", "moving_average"}
    assert set(table["horizon_s"]) == {1.0, 5.0}
    assert {"prefill_new_tokens", "decode_active_seqs"} <= set(table["target"])
    assert table.filter(pl.col("model") == "naive")["mase"].drop_nans().to_list() == pytest.approx([1.0] * 2 * len(TARGETS))
    assert (out / "forecast_vs_actual.png").stat().st_size > 10_000


def test_missing_columns_are_named(log_path, tmp_path, capsys):
    bad = tmp_path / "bad.parquet"
    pl.read_parquet(log_path).drop("at_s", "turn").write_parquet(bad)
    with pytest.raises(EventLogError, match="missing column\\(s\\) at_s, turn"):
        load_events(bad)
    assert replay.main([str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "missing column(s) at_s, turn" in capsys.readouterr().err


def test_an_unknown_schema_version_is_refused(log_path, tmp_path):
    bad = tmp_path / "v9.parquet"
    pl.read_parquet(log_path).with_columns(pl.lit(9, pl.Int64).alias("schema_version")).write_parquet(bad)
    with pytest.raises(EventLogError, match="schema_version \\[9\\] is unknown"):
        load_events(bad)


def test_out_of_order_rows_are_sorted_with_a_note(log_path, tmp_path, caplog):
    shuffled = tmp_path / "shuffled.parquet"
    original = pl.read_parquet(log_path)
    original.sample(fraction=1.0, shuffle=True, seed=3).write_parquet(shuffled)
    with caplog.at_level(logging.WARNING, logger="prorsa.export"):
        loaded = load_events(shuffled)
    assert "out of time order; sorted" in caplog.text
    assert loaded["event_id"].to_list() == original["event_id"].to_list()


def test_an_empty_log_says_so(log_path, tmp_path, capsys):
    empty = tmp_path / "empty.parquet"
    pl.read_parquet(log_path).clear().write_parquet(empty)
    assert replay.main([str(empty), "--models", "ets", "--out", str(tmp_path / "o")]) == 2
    assert "the log is empty" in capsys.readouterr().err


def test_a_tiny_log_says_how_short_it_is_instead_of_failing_in_statsmodels(log_path, tmp_path, capsys):
    tiny = tmp_path / "tiny.parquet"
    pl.read_parquet(log_path).head(12).write_parquet(tiny)
    assert replay.main([str(tiny), "--models", "arima", "ets", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "too short to score: 12 events" in err and "need >= 40 s" in err


def test_a_window_is_the_mean_of_the_bins_scored_one_by_one(log_path):
    """`--score window` at h: the mean over the next h bins, of the actuals and of each
    model's mean forecast; checked against the bins scored one horizon at a time."""
    import numpy as np

    from forecasting.core import CoreConfig

    events = load_events(log_path)
    cfg = CoreConfig(models=("naive", "moving_average"), horizons_s=(1.0, 2.0, 3.0, 4.0, 5.0))
    results, _ = replay.replay(events, cfg)
    actual = replay.actuals(events, cfg, results[-1].as_of_s)
    start = float(events["at_s"].min())
    bins = {(s.model, s.target, s.horizon_s): s for s in replay.align(results, cfg, actual, start, "bin")}
    windows = {(s.model, s.target, s.horizon_s): s for s in replay.align(results, cfg, actual, start, "window")}
    for target in ("prefill_new_tokens", "decode_active_seqs"):
        w = windows[("moving_average", target, 5.0)]
        n = len(w.actual)  # the ticks whose whole window closed: also scored at h = 5 one bin at a time
        one_by_one = [bins[("moving_average", target, float(h))] for h in range(1, 6)]
        assert np.allclose(w.actual, np.mean([b.actual[:n] for b in one_by_one], axis=0))
        assert np.allclose(w.forecast, np.mean([b.forecast[:n] for b in one_by_one], axis=0))
        assert w.quantiles is None and w.score == "window"
        assert np.allclose(windows[("naive", target, 5.0)].forecast, bins[("naive", target, 1.0)].forecast[:n])  # last value
        assert np.allclose(windows[("moving_average", target, 1.0)].actual, bins[("moving_average", target, 1.0)].actual)
    assert not np.allclose(
        windows[("moving_average", "prefill_new_tokens", 5.0)].actual, bins[("moving_average", "prefill_new_tokens", 5.0)].actual
    )
    with pytest.raises(ValueError, match="unknown score 'sum'"):
        replay.align(results, cfg, actual, start, "sum")


def test_both_scores_in_one_run(log_path, tmp_path):
    out = tmp_path / "out"
    argv = [str(log_path), "--models", "ets", "lifecycle", "--horizons", "1", "5", "--score", "bin", "window", "--out", str(out)]
    assert replay.main(argv) == 0
    table = pl.read_csv(out / "accuracy.csv")
    assert set(table["score"]) == {"bin", "window"}
    window = table.filter(pl.col("score") == "window")
    assert window.height == table.height // 2
    assert window["coverage"].is_null().all() or window["coverage"].is_nan().all()  # per-bin quantiles give no window interval
    assert table.filter(pl.col("score") == "bin")["coverage"].drop_nans().len() > 0
    assert window.filter(pl.col("model") == "naive")["mase"].drop_nans().to_list() == pytest.approx(
        [1.0] * window.filter(pl.col("model") == "naive")["mase"].drop_nans().len()
    )
    gain = pl.read_csv(out / "gain.csv")
    assert set(gain["score"]) == {"bin", "window"} and set(gain["model"]) == {"lifecycle"}


def test_the_median_score_takes_each_models_published_median(log_path):
    """`--score median`: the same bins as `bin`, scored by each model's published (calibrated)
    median instead of its point forecast. A model whose point is its mean (moving average) is
    moved by the conformal median shift once it has residuals; uncalibrated, its median is its
    mean, and the two scores agree."""
    import numpy as np

    from forecasting.core import CoreConfig

    events = load_events(log_path)
    med = QUANTILES.index(0.5)
    for calibrate in (True, False):
        cfg = CoreConfig(models=("naive", "moving_average"), horizons_s=(1.0, 5.0), calibrate=calibrate)
        results, _ = replay.replay(events, cfg)
        actual = replay.actuals(events, cfg, results[-1].as_of_s)
        start = float(events["at_s"].min())
        bins = {(s.model, s.target, s.horizon_s): s for s in replay.align(results, cfg, actual, start, "bin")}
        medians = {(s.model, s.target, s.horizon_s): s for s in replay.align(results, cfg, actual, start, "median")}
        assert bins.keys() == medians.keys()
        moved = 0
        for key, m in medians.items():
            assert m.score == "median" and np.array_equal(m.actual, bins[key].actual)
            assert np.array_equal(m.forecast, m.quantiles[med])  # the published median
            moved += int(not np.allclose(m.forecast, bins[key].forecast))
        assert (moved > 0) == calibrate, (calibrate, moved)
