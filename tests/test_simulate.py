"""The same actors in virtual time, in one process: deterministic, and true to a live run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from actors.config import load_config, with_policy
from bus_schemas.lifecycle import FINAL_STEP
from ops.checks import incomplete_trajectories
from runners.simulate import run
from tests.conftest import REPO, write_tiny_config
from tests.realtime import event_counts, read_summary, xfail_if_too_loaded


def simulate(tmp_path: Path, name: str, policy: str = "colocated", **kw) -> Path:
    config = with_policy(load_config(write_tiny_config(tmp_path / f"{name}.toml", steps=2, **kw)), policy)
    out = tmp_path / name
    summary = run(config, out, show_progress=False)
    assert summary["status"] == "completed"
    return out


def test_same_config_and_seed_give_byte_identical_logs(tmp_path: Path):
    a, b = simulate(tmp_path, "a"), simulate(tmp_path, "b")
    assert (a / "events.parquet").read_bytes() == (b / "events.parquet").read_bytes()
    assert json.loads((a / "summary.json").read_text())["steps"] == json.loads((b / "summary.json").read_text())["steps"]


def test_async_runs_are_byte_identical_too(tmp_path: Path):
    """Async mode (interrupting updates, batches formed while rollout goes on): same config and
    seed, the same log and the same batches."""
    outs = []
    for name in ("async-a", "async-b"):
        path = write_tiny_config(tmp_path / f"{name}.toml", policy="prorsa", steps=3)
        text = (
            path.read_text()
            .replace("[run]\n", '[run]\nmode = "async"\n')
            .replace("[engines]\n", '[engines]\ninflight_on_update = "interrupt"\n')
        )
        path.write_text(text)
        assert run(load_config(path), tmp_path / name, show_progress=False)["status"] == "completed"
        outs.append(tmp_path / name)
    a, b = outs
    assert (a / "events.parquet").read_bytes() == (b / "events.parquet").read_bytes()
    steps = json.loads((a / "summary.json").read_text())["steps"]
    assert steps == json.loads((b / "summary.json").read_text())["steps"] and len(steps) == 3


@pytest.mark.parametrize("policy", ["colocated", "static", "colocated-sticky", "reactive", "prorsa"])
def test_simulated_run_finishes_every_trajectory_with_every_transition(tmp_path: Path, policy: str):
    out = simulate(tmp_path, policy, policy)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trajectories_finished"] == summary["trajectories_expected"] == 8
    events = pl.read_parquet(out / "events.parquet")
    finished = set(events.filter(pl.col("kind") == "finished")["trajectory_id"])
    # None: roles change, or a static split prefills short appends where their KV lives
    disaggregated = {"colocated": False, "colocated-sticky": False}.get(policy)
    assert incomplete_trajectories(events, finished, disaggregated) == {}
    assert summary["incomplete_trajectories"] == 0
    rollouts = events.filter(pl.col("kind") == "rollout_done").sort("step")
    assert rollouts["detail"].to_list() == ["", FINAL_STEP]  # the trainer marks the run's last step


def test_a_prorsa_fleet_started_in_a_split_serves_in_it_and_finishes_every_trajectory(tmp_path: Path):
    import msgspec

    config = with_policy(load_config(write_tiny_config(tmp_path / "split.toml", policy="prorsa", steps=2)), "prorsa")
    config = msgspec.structs.replace(config, allocator=msgspec.structs.replace(config.allocator, start_prefill_engines=1))
    out = tmp_path / "split"
    summary = run(config, out, show_progress=False)
    assert summary["status"] == "completed" and summary["trajectories_finished"] == summary["trajectories_expected"] == 8
    events = pl.read_parquet(out / "events.parquet")
    served = events.filter(pl.col("kind").is_in(["prefill_done", "decode_started"]) & (pl.col("actor_id") == pl.col("engine_id")))
    first_switch_s = events.filter(pl.col("kind") == "role_switched")["at_s"].min()
    before = served.filter(pl.col("at_s") < first_switch_s) if first_switch_s is not None else served
    # until the allocator's first switch, e0 is a prefill engine and e1 a decode engine: the
    # split it was given (a decode engine also prefills short turns itself, per-turn placement)
    assert set(before.filter(pl.col("kind") == "decode_started")["engine_id"]) == {"e1"}
    assert before.filter((pl.col("kind") == "prefill_done") & (pl.col("engine_id") == "e0")).height > 0
    assert dict(before.select("engine_id", "role").unique().iter_rows()) == {"e0": "prefill", "e1": "decode"}
    finished = set(events.filter(pl.col("kind") == "finished")["trajectory_id"])
    assert incomplete_trajectories(events, finished, None) == {}


def test_every_allocator_tick_is_recorded_with_the_reason_each_switch_logged(tmp_path: Path):
    """`allocations.parquet`: one row per tick of the allocator (`subjects.allocation()`), with
    the demand it judged by; a tick that changed roles names the same reason the engines logged."""
    path = write_tiny_config(tmp_path / "p.toml", policy="prorsa", steps=2)
    with path.open("a") as f:  # always a PD split: the fleet starts colocated, so it switches
        f.write('\n[allocator]\ntick_s = 1.0\nmin_dwell_s = 0.0\ncolocation = "never"\n')
    config = load_config(path)
    out = tmp_path / "prorsa"
    assert run(config, out, show_progress=False)["status"] == "completed"
    ticks = pl.read_parquet(out / "allocations.parquet")
    assert ticks.height > 10 and ticks["at_s"].is_sorted() and set(ticks["policy"]) == {"prorsa"}
    assert (ticks["prefill_engines"] + ticks["decode_engines"] + ticks["colocated_engines"] == 2).all()
    judged = ticks.filter(pl.col("demand_source") != "")
    assert (judged["decode_context_tokens"] > 0).all()
    backlog = judged["prefill_backlog_tokens_per_s"]
    assert (backlog >= 0).all() and (backlog <= judged["prefill_tokens_per_s"]).all()  # recorded: the part of the demand queued then
    changed = ticks.filter(pl.col("changes") != "")
    events = pl.read_parquet(out / "events.parquet").filter(pl.col("kind") == "role_switched")
    assert changed.height > 0 and set(changed["reason"]) == set(events["detail"])
    assert changed["epoch"].to_list() == list(range(1, changed.height + 1))  # one epoch per tick that changed roles


@pytest.mark.e2e
def test_simulation_matches_a_live_run(tmp_path: Path):
    """Live (real NATS, emulated engines, 5x) vs virtual time: the same lifecycle event
    counts by kind; rollout per step within 5% unless the live run fell behind (tests/realtime.py)."""
    config = write_tiny_config(tmp_path / "live.toml", steps=2, time_scale=5.0)
    proc = subprocess.run(
        [sys.executable, "-m", "ops.launch", str(config), "--out", str(tmp_path / "live")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sim = simulate(tmp_path, "sim", time_scale=5.0)
    assert event_counts(tmp_path / "live") == event_counts(sim)  # counts: exactly
    live_summary = read_summary(tmp_path / "live")
    for live, simulated in zip(live_summary["steps"], read_summary(sim)["steps"], strict=True):  # times: if the live run kept up
        if abs(simulated["rollout_s"] - live["rollout_s"]) / live["rollout_s"] > 0.05:
            xfail_if_too_loaded(
                live_summary, f"step {live['step']}: live {live['rollout_s']:.2f} s vs simulated {simulated['rollout_s']:.2f} s"
            )
            raise AssertionError(f"live and simulated differ by more than 5% while the live run kept up: {live} vs {simulated}")
