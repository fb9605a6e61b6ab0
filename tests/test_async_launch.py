"""Async RL end to end on a real nats-server: `ops.launch` runs an async job (every actor its
own process, real time), under seeds that change the trajectories' lengths and latencies,
and no training batch holds a trajectory staler than `trainer.max_staleness`."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

from tests.conftest import write_tiny_config
from tests.test_launch import launch_to_completion

pytestmark = pytest.mark.e2e
STEPS = 4


@pytest.mark.parametrize("seed, stale_policy", [(3, "hold"), (11, "drop")])
def test_a_launched_async_run_keeps_every_batch_within_the_staleness_bound(tmp_path: Path, seed: int, stale_policy: str):
    config = write_tiny_config(tmp_path / "tiny.toml", policy="colocated", steps=STEPS, time_scale=20.0)
    text = config.read_text().replace("seed = 3", f'seed = {seed}\nmode = "async"', 1)
    text = text.replace("train_s = 2.0", f'train_s = 2.0\nmax_staleness = 1\nstale_policy = "{stale_policy}"', 1)
    config.write_text(text)
    out = tmp_path / "run"
    summary = launch_to_completion(config, out)
    steps = summary["steps"]
    assert len(steps) == STEPS and all(step["trajectories"] == 2 * 2 for step in steps)  # B x G each
    for step in steps:  # trained trajectories per staleness 0, 1, ...: none beyond the bound
        assert sum(step["staleness"]) == 4 and sum(step["staleness"][2:]) == 0, step
    assert any(len(step["staleness"]) > 1 and step["staleness"][1] > 0 for step in steps)  # the bound was reached
    events = pl.read_parquet(out / "events.parquet")
    assert events.filter(pl.col("kind") == "batch_ready").height == STEPS
    updates = events.filter(pl.col("kind") == "policy_loaded")
    assert set(updates["engine_id"]) == {"e0", "e1"}  # both engines took the new versions mid-run
    if stale_policy == "drop":
        assert summary["trajectories_dropped"] == events.filter(pl.col("kind") == "trajectory_dropped").height
