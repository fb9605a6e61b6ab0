"""End to end with real compute: `ops.launch` of a torch-backend run, every actor its own process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

pytest.importorskip("torch", reason="the torch backend is the optional [torch] extra; the dev extra CI installs includes it")

from ops.checks import incomplete_trajectories
from tests.conftest import REPO
from tests.torch_helpers import write_torch_config

pytestmark = pytest.mark.e2e


def test_a_small_torch_run_updates_the_policy_from_its_rollouts_and_hands_real_kv_over(tmp_path: Path):
    """Two GRPO updates on the generated tokens, their weights served and loaded everywhere,
    real KV handed over. Two steps are too few to show learning; the main job
    (configs/torch-demo.toml, 20 steps) shows the reward rising."""
    config = write_torch_config(tmp_path / "torch.toml", checkpoint="", steps=2, stop_at_eos=True, verify=True)
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ops.launch", str(config), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (out / "model" / "config.json").exists()  # built once, loaded by every process

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["backend"] == "torch"
    assert summary["trajectories_finished"] == summary["trajectories_expected"] == 16
    assert summary["trajectories_lost"] == 0 and summary["invalid_messages"] == 0 and summary["incomplete_trajectories"] == 0
    assert [s["step"] for s in summary["steps"]] == [0, 1]
    assert all(0.0 <= s["mean_reward"] <= 1.0 and s["decode_tokens"] > 0 for s in summary["steps"])
    actors = summary["actors"]
    assert actors["e0"]["kv_bytes_served"] == actors["e1"]["kv_bytes_fetched"] > 0
    assert actors["e1"]["kv_tokens_reused"] > 0  # turn 2 moved only what the decode engine lacked
    # policies 1 and 2 were trained, served in chunks and loaded by both engines
    assert actors["e0"]["weights_bytes_loaded"] == actors["e1"]["weights_bytes_loaded"] > 0
    assert actors["trainer"]["weights_chunks_served"] >= 4
    assert actors["trainer"]["train_updates"] == 2  # one GRPO update per step, on real tokens
    assert actors["trainer"]["trained_tokens"] > 0 and actors["trainer"].get("trajectories_without_tokens", 0) == 0
    assert all(actors[e].get("reprefills", 0) == 0 for e in ("e0", "e1"))

    events = pl.read_parquet(out / "events.parquet")
    finished = set(events.filter(pl.col("kind") == "finished")["trajectory_id"])
    assert incomplete_trajectories(events, finished, disaggregated=True) == {}
    loaded = events.filter(pl.col("kind") == "policy_loaded")
    assert sorted(loaded["policy_version"].to_list()) == [1, 1, 2, 2]
