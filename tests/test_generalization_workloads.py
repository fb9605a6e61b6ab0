"""Workload structure the forecaster is not told: a latent difficulty shared by GRPO siblings,
heavy-tailed tool calls with timeouts and retries, random per-step mixes and families that
drift over steps; and the rollout bench's generalization table built from them."""

from __future__ import annotations

import statistics

import msgspec
import numpy as np
import pytest

from actors.config import Config, WorkloadSection, load_config
from actors.config_schema import RandomMixes, ToolTail
from actors.environment.workloads import PROFILES, latent_difficulty, plan_trajectory, shape_scales, tail_latency_s, task_prompt_seed
from bus_schemas.train import TaskAssignment
from runners.rollout import SUITES, run_config
from runners.simulate import run
from tests.conftest import write_tiny_config


def assignment(task: int, sample: int, step: int = 0) -> TaskAssignment:
    return TaskAssignment(
        trajectory_id=f"s{step}-k{task}-g{sample}",
        task_id=f"s{step}-k{task}",
        task_family="swe",
        sample_index=sample,
        step=step,
        policy_version=step,
        seed=task * 8 + sample,
        assigned_at_s=0.0,
    )


def test_siblings_share_their_tasks_difficulty_as_much_as_the_correlation_says():
    def z(task, sample, rho):
        a = assignment(task, sample)
        return latent_difficulty(7, task_prompt_seed(a.task_id), a.seed, rho)

    pairs = [(z(k, 0, 0.7), z(k, 1, 0.7)) for k in range(400)]
    corr = np.corrcoef(np.array(pairs).T)[0, 1]
    assert corr == pytest.approx(0.7**2 + 0.0, abs=0.12)  # two siblings: rho^2 of their variance in common
    unrelated = np.corrcoef(np.array([(z(k, 0, 0.0), z(k, 1, 0.0)) for k in range(400)]).T)[0, 1]
    assert abs(unrelated) < 0.12
    assert statistics.pstdev(a for a, _ in pairs) == pytest.approx(1.0, abs=0.1)


def test_a_harder_trajectory_takes_more_turns_and_longer_outputs_and_observations():
    workload = msgspec.convert({"difficulty": {"sigma": 0.5}}, WorkloadSection)
    scales = [shape_scales(workload, 7, assignment(k, 0)) for k in range(200)]
    turns, gen, obs = (np.array(x) for x in zip(*scales))
    assert np.all(np.argsort(turns) == np.argsort(gen)) and np.all(np.argsort(gen) == np.argsort(obs))
    assert 0.3 < np.log(turns).std() < 0.7  # sigma 0.5
    assert shape_scales(WorkloadSection(), 7, assignment(3, 1)) == (1.0, 1.0, 1.0)
    hard = plan_trajectory(PROFILES["swe"], 7, 3, turns_scale=3.0)
    base = plan_trajectory(PROFILES["swe"], 7, 3).turns
    assert abs(hard.turns - 3 * base) <= 1.5  # the drawn count, three times


def test_drift_grows_trajectories_step_over_step():
    workload = msgspec.convert({"drift": {"turns_per_step": 0.1, "gen_per_step": 0.2}}, WorkloadSection)
    assert shape_scales(workload, 7, assignment(0, 0, step=0)) == (1.0, 1.0, 1.0)
    turns, gen, obs = shape_scales(workload, 7, assignment(0, 0, step=2))
    assert (turns, gen, obs) == (pytest.approx(1.21), pytest.approx(1.44), 1.0)


def test_tool_calls_past_the_timeout_are_retried_and_the_last_ends_at_the_timeout():
    spec = ToolTail(share=1.0, alpha=0.5, scale_s=10.0, timeout_s=60.0, retries=2)
    rng = np.random.default_rng(1)
    times = [tail_latency_s(spec, rng, 1.0, lambda: 1.0) for _ in range(2000)]
    assert min(times) >= 10.0  # every attempt Pareto (share 1): at least its scale
    assert max(times) == pytest.approx(3 * 60.0)  # three attempts past the timeout: 3 x 60 s
    retried = [t for t in times if t > 60.0]
    assert retried and all(t >= 60.0 for t in retried)
    none = ToolTail(share=0.0, timeout_s=60.0)
    assert tail_latency_s(none, rng, 5.0, lambda: 1.0) == 5.0
    assert tail_latency_s(none, rng, 90.0, lambda: 5.0) == 60.0 + 5.0  # a slow call abandoned, the retry answers


def test_a_heavy_tail_lengthens_tool_calls_and_leaves_the_other_draws_as_they_were():
    plain = plan_trajectory(PROFILES["terminal"], 7, 11)
    tail = plan_trajectory(PROFILES["terminal"], 7, 11, tool_tail=ToolTail(share=0.2, scale_s=20.0))
    a = [(plain.gen_tokens(), plain.obs_tokens(), plain.tool_latency_s()) for _ in range(300)]
    b = [(tail.gen_tokens(), tail.obs_tokens(), tail.tool_latency_s()) for _ in range(300)]
    assert [x[:2] for x in a] == [x[:2] for x in b]  # lengths from the trajectory's own stream
    assert sum(x[2] for x in b) > 1.5 * sum(x[2] for x in a)


def test_random_mixes_draw_single_family_steps_and_shares_the_same_for_every_reader():
    workload = msgspec.convert({"random_mixes": {"families": ["swe", "search", "math"], "single_share": 0.3}}, WorkloadSection)
    mixes = [workload.mix_at(step, 5) for step in range(200)]
    assert mixes == [workload.mix_at(step, 5) for step in range(200)]
    single = sum(len(m) == 1 for m in mixes)
    assert 30 < single < 90  # about 30% of 200
    assert all(abs(sum(m.values()) - 1.0) < 1e-9 and set(m) <= {"swe", "search", "math"} for m in mixes)
    assert mixes != [workload.mix_at(step, 6) for step in range(200)]  # another run seed, other mixes
    assert workload.families() == ["swe", "search", "math"]
    with pytest.raises(msgspec.ValidationError, match="unknown task family"):
        msgspec.convert({"workload": {"random_mixes": {"families": ["chess"]}}}, Config)
    assert RandomMixes().families == []


def test_a_run_with_every_kind_of_structure_finishes_every_trajectory(tmp_path):
    path = write_tiny_config(tmp_path / "gen.toml", policy="prorsa", steps=3)
    path.write_text(
        path.read_text()
        + """
[workload.difficulty]
sigma = 0.5
[workload.tool_tail]
share = 0.1
timeout_s = 30.0
[workload.random_mixes]
families = ["search", "math"]
[workload.drift]
gen_per_step = 0.2
"""
    )
    summary = run(load_config(path), tmp_path / "gen", show_progress=False)
    assert summary["status"] == "completed" and summary["trajectories_lost"] == 0
    assert summary["trajectories_finished"] == summary["trajectories_expected"]


def test_the_generalization_table_runs_every_fleet_on_fresh_seeds_with_the_main_tables_policies():
    suite = SUITES["paper"]
    cases = suite.cases(("generalization",), fresh=(11, 12, 13, 14, 15))
    assert {c.fleet.name for c in cases} == {f.name for f in suite.fleets}
    assert {c.workload.name for c in cases} == {"difficulty", "tool-tail", "random-mix", "drift"}
    assert {c.seed for c in cases} == {11, 12, 13, 14, 15}
    case = next(c for c in cases if c.fleet.name == "deepseek" and c.workload.name == "tool-tail")
    assert suite.case_policies(case.fleet, case.table) == suite.policies(case.fleet, "main")
    config = run_config(suite, case, "prorsa")
    assert config.workload.tool_tail.share == 0.05 and config.workload.mix == {"terminal": 1.0}
    assert config.run.seed in {11, 12, 13, 14, 15}
    assert run_config(suite, next(c for c in cases if c.workload.name == "random-mix"), "prorsa").trainer.steps == 3
