"""Environments on real engines, end to end (`ops.launch`, every actor its own process): a
user's class named by `environments.entrypoint` that fails in every way it can, and the
built-in sandboxed `code` family."""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pytest

pytest.importorskip("torch", reason="the torch backend is the optional [torch] extra; the dev extra CI installs includes it")

from tests.test_launch import launch_to_completion
from tests.torch_helpers import write_torch_config

pytestmark = pytest.mark.e2e


def launch(tmp_path: Path, environments: str, workload: str, samples: int, tasks: int) -> tuple[dict, pl.DataFrame]:
    config = write_torch_config(tmp_path / "torch.toml", checkpoint="", steps=1, stop_at_eos=False)
    text = config.read_text()
    text = text.replace("[environments]\ncount = 1\n", f"[environments]\ncount = 1\n{environments}\n")
    text = text.replace("tasks_per_step = 2\nsamples_per_task = 4", f"tasks_per_step = {tasks}\nsamples_per_task = {samples}")
    text = text.replace("mix = { calc = 1.0 }", workload)
    config.write_text(text)
    out = tmp_path / "run"
    summary = launch_to_completion(config, out, timeout_wall_s=300)
    return summary, pl.read_parquet(out / "events.parquet")


def test_a_user_environment_that_raises_hangs_or_returns_garbage_ends_only_its_own_trajectories(tmp_path: Path):
    summary, events = launch(
        tmp_path,
        'entrypoint = "tests.user_envs:Misbehaving"\noptions = { greeting = "hello" }\nstep_timeout_wall_s = 2.0',
        "mix = { my-agent = 1.0 }",  # a user's family: only a name
        samples=6,
        tasks=1,
    )
    assert summary["status"] == "completed"
    assert summary["trajectories_finished"] == summary["trajectories_expected"] == 6 and summary["trajectories_lost"] == 0
    assert summary["incomplete_trajectories"] == 0  # the one whose reset failed ran no turn, and its log says so
    env = summary["actors"]["env0"]
    assert env["env_errors"] == 4
    assert (env["env_exceptions"], env["env_timeouts"], env["env_bad_returns"]) == (2, 1, 1)  # step raised + reset raised
    errors = events.filter(pl.col("kind") == "env_error")
    by_sample = {int(t.rsplit("g", 1)[1]): d for t, d in zip(errors["trajectory_id"], errors["detail"], strict=True)}
    assert sorted(by_sample) == [1, 2, 3, 4]
    assert "step raised RuntimeError: tool crashed" in by_sample[1]
    assert by_sample[2].startswith("env_timeouts: step did not return within 2 s")
    assert "not a StepResult or (observation, reward, done)" in by_sample[3]
    assert "reset raised KeyError" in by_sample[4]
    finished = events.filter(pl.col("kind") == "finished")
    rewards = {int(t.rsplit("g", 1)[1]): r for t, r in zip(finished["trajectory_id"], finished["reward"], strict=True)}
    assert rewards == {0: 1.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0, 5: 1.0}  # two steps of 0.5 where it behaves
    assert finished.filter(pl.col("trajectory_id").str.ends_with("g0"))["task_family"].to_list() == ["my-agent"]
    # the well-behaved ones ran two turns: the observation (three token ids) went back to the engines
    tools = events.filter((pl.col("kind") == "tool_done") & pl.col("trajectory_id").str.ends_with("g0"))
    assert tools["new_tokens"].to_list() == [3]
    assert summary["actors"]["trainer"]["train_updates"] == 1  # the group was trained, failures at reward 0


def test_the_sandboxed_code_family_runs_the_models_code_and_rewards_it_by_its_tests(tmp_path: Path):
    summary, events = launch(tmp_path, "", "mix = { code = 1.0 }", samples=2, tasks=2)
    assert summary["status"] == "completed" and summary["trajectories_finished"] == 4 and summary["incomplete_trajectories"] == 0
    assert summary["actors"]["env0"].get("env_errors", 0) == 0
    finished = events.filter(pl.col("kind") == "finished")
    assert all(0.0 <= r <= 1.0 for r in finished["reward"])
    tools = events.filter(pl.col("kind") == "tool_done")
    # a random byte-level model writes no Python that passes: every trajectory runs its three
    # turns, each one's code run in a subprocess (tens of milliseconds at least) and reported back
    assert tools.height == 8 and (tools["duration_s"] > 0.01).all() and (tools["new_tokens"] > 20).all()
