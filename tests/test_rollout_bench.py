"""The rollout bench's machinery on its smoke suite (virtual time): every policy runs, the
records carry what the README's table needs, and the figures are consistent."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from runners.rollout import SUITES, lower_bound_s, run_config, run_suite

FIELDS = {"table", "fleet", "workload", "mode", "policy", "trajectories_per_gpu", "dp_sync", "kv_writeback", "rollout_s", "speedup_vs_colocated", "role_switches", "p50_traj_s", "p99_traj_s", "lower_bound_s"}


def test_smoke_suite_runs_every_policy_and_writes_the_table_and_a_timeline(tmp_path: Path):
    suite = SUITES["smoke"]
    results = run_suite(suite, tmp_path, jobs=1)
    policies = [r["policy"] for r in results]
    assert policies == ["colocated", "colocated-sticky", "static-1:3", "reactive", "prorsa", "oracle"]
    assert json.loads((tmp_path / "results.json").read_text()) == results
    for r in results:
        assert FIELDS <= set(r)
        assert r["status"] == "completed" and r["trajectories_lost"] == 0 and r["incomplete_trajectories"] == 0
        assert 0 < r["lower_bound_s"] <= r["rollout_s"]  # no policy beats the critical path
        assert r["p50_traj_s"] <= r["p99_traj_s"] <= r["rollout_s"] + 1e-6
    colocated_s = results[0]["rollout_s"]  # each speedup is colocated's rollout time over the policy's own
    for r in results:
        assert r["speedup_vs_colocated"] == round(colocated_s / r["rollout_s"], 3), r["policy"]
    assert len({r["rollout_s"] for r in results}) > 1  # the policies differ: the ratios are not all trivially 1
    table = (tmp_path / "results.md").read_text()
    assert "| main | moe | search | 4 | default | prorsa |" in table and "vs best static" in table
    assert (tmp_path / "timeline-moe-search.png").stat().st_size > 10_000
    bounds = {r["lower_bound_s"] for r in results}
    assert len(bounds) == 1  # the same workload (same seeds) under every policy: the same physical limit


def test_lower_bound_is_the_longest_critical_path(tmp_path: Path):
    suite = SUITES["smoke"]
    config = run_config(suite, suite.cases(("main",))[0], "colocated")
    ev = lambda kind, traj, **kw: {"kind": kind, "trajectory_id": traj, "step": 0, "new_tokens": 0, "context_tokens": 0, "generated_tokens": 0, "duration_s": 0.0, **kw}  # noqa: E731
    events = pl.DataFrame(
        [
            ev("prefill_queued", "a", new_tokens=100),
            ev("decode_done", "a", generated_tokens=1000),
            ev("tool_done", "a", duration_s=5.0),
            ev("prefill_queued", "b", new_tokens=100),
            ev("decode_done", "b", generated_tokens=10),
        ]
    )
    bound = lower_bound_s(config, events)
    assert 5.0 + 1000 * 0.003 < bound < 5.0 + 1000 * 0.01  # a's path: its tool time and 1000 tokens at a fast TPOT


def test_paper_suite_plans_the_pd_tables_with_their_settings():
    suite = SUITES["paper"]
    cases = suite.cases()
    tables = {c.table for c in cases}
    assert tables == {"main", "sweep", "ablation", "sensitivity"}
    fleets = {c.fleet.name for c in cases}
    assert any("stage" in f for f in fleets) and any("deepseek" in f for f in fleets)
    sweep = {(c.fleet.name, c.workload.name, c.trajectories_per_gpu) for c in cases if c.table in ("main", "sweep")}
    for fleet in ("moe-stage", "deepseek"):
        for workload in ("swe", "shift"):
            assert {n for f, w, n in sweep if (f, w) == (fleet, workload)} == {16, 32, 64, 128}
    by_variant = {c.variant: c for c in cases if c.table in ("ablation", "sensitivity")}
    ideal = run_config(suite, by_variant["dp_sync=ideal"], "prorsa")
    assert ideal.engines.dp_sync == "ideal"
    assert run_config(suite, by_variant["kv_writeback=none"], "prorsa").engines.kv_writeback == "none"
    off = run_config(suite, by_variant["stage layouts off"], "prorsa").engines
    assert off.prefill_layout is None and off.decode_layout is None and off.layout.dp == 4
    assert run_config(suite, by_variant["lockstep constants high"], "prorsa").engines.lockstep_constants == "high"
    stage = next(c for c in cases if c.table == "main" and c.fleet.name == "moe-stage")
    assert "colocated-sticky@1" in suite.policies(stage.fleet)  # colocated baselines in the prefill layout too
    other_layout = run_config(suite, stage, "colocated-sticky@1")
    assert other_layout.run.policy == "colocated-sticky" and other_layout.engines.layout.dp == 4
    main = run_config(suite, stage, "prorsa")
    assert main.engines.prefill_layout.tp == 4 and main.engines.decode_layout.dp == 4 and main.engines.layout.tp == 4
    per_gpu_128 = next(c for c in cases if c.trajectories_per_gpu == 128 and c.fleet.name == "deepseek")
    config = run_config(suite, per_gpu_128, "colocated")
    assert config.trainer.tasks_per_step * config.trainer.samples_per_task == 128 * per_gpu_128.fleet.gpus
