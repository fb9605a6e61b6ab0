"""The replay runner and the log loader: a good log is scored, a bad one is refused with
one line that names the problem."""

from __future__ import annotations

import logging
from pathlib import Path

import polars as pl
import pytest

from forecasting.synthetic import synthetic_log
from ops.export import EventLogError, load_events
from forecasting.models import TARGETS
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
