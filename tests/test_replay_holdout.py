"""Held-out evaluation: `runners.replay --config C --holdout-seeds S` records fresh logs of
C with seed S (virtual time) and scores only those; prefill_engine_s is weighed by the
config's cost model."""

from __future__ import annotations

import polars as pl
import pytest

from forecasting import series
from ops.export import load_events
from runners import replay
from tests.conftest import write_tiny_config


def test_holdout_seeds_record_fresh_logs_and_score_only_those(tmp_path, capsys):
    config = write_tiny_config(tmp_path / "tiny.toml", steps=2)
    out = tmp_path / "out"
    code = replay.main(
        ["--config", str(config), "--holdout-seeds", "7", "--models", "lifecycle", "--horizons", "1", "5", "--out", str(out)]
    )
    assert code == 0, capsys.readouterr().err
    log = out / "holdout" / "tiny-seed7" / "events.parquet"
    events = load_events(log)
    table = pl.read_csv(out / "accuracy.csv")
    assert set(table["log"]) == {"tiny"}  # the config's name: its held-out logs pooled
    assert "prefill_engine_s" in set(table["target"]) and "coverage_raw" in table.columns
    points = table.filter((pl.col("model") == "lifecycle") & (pl.col("horizon_s") == 1.0))["points"].unique().to_list()
    assert points == [int(events["at_s"].max() // 1.0) - int(events["at_s"].min() // 1.0) + 1]  # every tick of that log, no other
    # engine-seconds weigh each cache-missed token by the cost model: more per token at longer context
    cost = replay.prefill_cost(replay.load_config(config))
    binned = series.bin_events(events, 1.0, cost=cost)
    engine_s, miss = (sum(series.totals(binned, c)) for c in ("prefill_engine_s", "prefill_miss_tokens"))
    assert engine_s > cost.per_token_s * miss > 0


def test_a_holdout_seed_equal_to_the_configs_own_is_refused(tmp_path, capsys):
    config = write_tiny_config(tmp_path / "tiny.toml")
    assert replay.main(["--config", str(config), "--holdout-seeds", "3", "--out", str(tmp_path / "o")]) == 2
    assert "seed 3 is the config's own: not held out" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--holdout-seeds", "5"], [], ["x.parquet", "--holdout-seeds", "5", "--config", "c.toml"]])
def test_log_or_config_with_seeds_is_required(tmp_path, capsys, argv):
    assert replay.main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert "give a LOG, or --config" in capsys.readouterr().err
