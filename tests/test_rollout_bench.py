"""The rollout bench's machinery on its smoke suite (virtual time): every policy runs, the
records carry what the README's table needs, and the figures are consistent."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl

from runners.rollout import SUITES, lower_bound_s, run_config, run_suite

FIELDS = {"fleet", "workload", "mode", "policy", "rollout_s", "speedup_vs_colocated", "role_switches", "p50_traj_s", "p99_traj_s", "lower_bound_s"}


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
    assert "| moe | search | prorsa |" in table and "vs best static" in table
    assert (tmp_path / "timeline-moe-search.png").stat().st_size > 10_000
    bounds = {r["lower_bound_s"] for r in results}
    assert len(bounds) == 1  # the same workload (same seeds) under every policy: the same physical limit


def test_lower_bound_is_the_longest_critical_path(tmp_path: Path):
    suite = SUITES["smoke"]
    fleet, workload = suite.fleets[0], suite.workloads[0]
    config = run_config(suite, fleet, workload, "colocated")
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
