"""`stale_policy = "partial"` end to end on the torch backend: `ops.launch` runs
configs/torch-async.toml with the staleness bound at 0, so every version published while
calc trajectories are between turns moves their remaining turns onto the new weights. Such a
trajectory keeps its earlier tokens (each turn's prefill carries the whole history), its
turns' versions only move forward, and the first turn on new weights reuses no KV computed
by the old ones."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from tests.conftest import REPO
from tests.test_launch import launch_to_completion

pytest.importorskip("torch", reason="the torch backend is the optional [torch] extra; the dev extra CI installs includes it")
pytestmark = pytest.mark.e2e
STEPS = 6  # five versions published while trajectories run: one spanning an update is near certain


def partial_config(path: Path) -> Path:
    text = (REPO / "configs" / "torch-async.toml").read_text()
    for old, new in (
        ('name = "torch-async"', 'name = "torch-partial"'),
        ("steps = 20", f"steps = {STEPS}"),
        ("samples_per_task = 8 ", "samples_per_task = 4 "),
        ("max_staleness = 1 ", "max_staleness = 0 "),
        ('stale_policy = "hold"', 'stale_policy = "partial"'),
    ):
        assert old in text, old
        text = text.replace(old, new, 1)
    path.write_text(text)
    return path


def test_partial_moves_remaining_turns_to_new_weights_with_the_history_intact(tmp_path: Path):
    out = tmp_path / "run"
    summary = launch_to_completion(partial_config(tmp_path / "torch-partial.toml"), out)
    assert sum(step["masked_turns"] for step in summary["steps"]) > 0  # older-version turns masked out of training

    events = pl.read_parquet(out / "events.parquet")
    prefills = events.filter(pl.col("kind") == "prefill_started").sort("at_s").unique(["trajectory_id", "turn"], keep="last")
    decodes = events.filter(pl.col("kind") == "decode_done").unique(["trajectory_id", "turn"], keep="last")
    turns = prefills.join(
        decodes.select("trajectory_id", "turn", pl.col("policy_version").alias("version"), pl.col("generated_tokens").alias("generated")),
        on=["trajectory_id", "turn"],
    )
    spanning = 0
    for (trajectory,), rows in turns.sort("turn").group_by(["trajectory_id"]):
        versions = rows["version"].to_list()
        assert versions == sorted(versions), (trajectory, versions)  # remaining turns move forward, never back
        if len(set(versions)) == 1:
            continue
        spanning += 1
        history = 0
        for row in rows.iter_rows(named=True):
            assert row["context_tokens"] == history, (trajectory, row)  # every earlier token carried into the turn
            history += row["new_tokens"] + row["generated"]
        for prev, row in zip(rows.iter_rows(named=True), rows[1:].iter_rows(named=True)):
            if row["version"] != prev["version"]:
                assert row["cached_prefix_tokens"] == 0, (trajectory, row)  # no KV of the older weights reused
    assert spanning > 0, "no trajectory spanned a weight update: nothing was tested"
