"""The rollout bench's machinery on its smoke suite (virtual time): every policy runs, the
records carry what the README's table needs, and the figures are consistent."""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import polars as pl
import pytest

from runners.rollout import SUITES, _run_in_order, lower_bound_s, run_config, run_suite
from runners.rollout_tables import comparisons, fleet_summary, mode_comparisons, results_markdown, seed_spread

FIELDS = {
    "table",
    "fleet",
    "workload",
    "mode",
    "policy",
    "trajectories_per_gpu",
    "dp_sync",
    "kv_writeback",
    "rollout_s",
    "run_s",
    "trajectories",
    "trajectories_trained",
    "throughput_per_s",
    "staleness",
    "families",
    "speedup_vs_colocated",
    "role_switches",
    "p50_traj_s",
    "p99_traj_s",
    "lower_bound_s",
}
POLICIES = ["colocated", "colocated-sticky", "colocated-sticky+delayer", "static-1:3", "reactive", "prorsa"]


def test_smoke_suite_runs_every_policy_in_both_modes_and_writes_the_tables_and_a_timeline(tmp_path: Path):
    suite = SUITES["smoke"]
    results = run_suite(suite, tmp_path, jobs=1)
    assert [(r["mode"], r["policy"]) for r in results] == [
        *(("sync", p) for p in POLICIES),
        *(("async", p) for p in POLICIES),
        ("sync", "oracle"),
        ("async", "oracle"),
    ]
    assert json.loads((tmp_path / "results.json").read_text()) == results
    config = run_config(suite, suite.cases(("main",))[0], "colocated")
    batches, per_batch, train_s = (
        config.trainer.steps,
        config.trainer.tasks_per_step * config.trainer.samples_per_task,
        config.trainer.train_s,
    )
    assert batches >= 2  # an async run has a batch to overlap with training
    for r in results:
        assert FIELDS <= set(r)
        assert r["prefill_delayer"] is r["policy"].endswith("+delayer")  # the smoke fleet runs DP attention: the delayer can act
        assert r["status"] == "completed" and r["trajectories_lost"] == 0 and r["incomplete_trajectories"] == 0
        # every assigned trajectory finished and was trained, none dropped: the same work in both modes
        assert r["trajectories"] == r["trajectories_trained"] == r["trajectories_expected"] == batches * per_batch
        assert r["dropped"] == 0 and sum(r["families"].values()) == r["trajectories"]
        assert 0 < r["lower_bound_s"] <= r["rollout_s"]  # no policy beats the critical path
        # what ends the row: its last trajectories' time by what they were doing adds up to it
        assert sum(r["critical_path_s"].values()) == pytest.approx(r["rollout_s"], abs=0.05)
        assert min(r["critical_path_s"][b] for b in ("prefill", "decode", "tool")) > 0  # each turn prefills, decodes, calls a tool
        assert r["p50_traj_s"] <= r["p99_traj_s"] <= r["rollout_s"] + 1e-6
        assert abs(r["throughput_per_s"] - r["trajectories_trained"] / r["run_s"]) < 1e-3 * r["throughput_per_s"]
        if r["mode"] == "sync":  # steps: rollout, then training with rollout paused
            assert r["staleness"] == [] and r["max_staleness"] is None
            assert r["rollout_s"] == round(sum(r["step_rollout_s"]), 2)
            assert r["run_s"] + 0.01 >= r["rollout_s"] + batches * train_s  # each rounded to 0.01 s
        else:  # training overlaps rollout: only the last batch's training is outside rollout_s
            assert (r["max_staleness"], r["stale_policy"]) == (1, "hold")
            assert sum(r["staleness"]) == r["trajectories_trained"] and len(r["staleness"]) <= 2  # staleness <= 1
            # (each rounded to 0.01 s: the last batch's training can end the run exactly)
            assert r["rollout_s"] + train_s <= r["run_s"] + 0.01 and r["run_s"] < r["rollout_s"] + 2 * train_s
    for mode in ("sync", "async"):
        runs = [r for r in results if r["mode"] == mode]
        colocated_s = next(r["rollout_s"] for r in runs if r["policy"] == "colocated")  # each mode's own colocated run
        for r in runs:
            assert r["speedup_vs_colocated"] == round(colocated_s / r["rollout_s"], 3), (mode, r["policy"])
        assert len({r["lower_bound_s"] for r in runs}) == 1  # the same workload (same seeds) under every policy: the same limit
    sync_runs = [r for r in results if r["mode"] == "sync"]
    assert len({r["rollout_s"] for r in sync_runs}) > 1  # the policies differ: the ratios are not all trivially 1
    assert len({json.dumps(r["families"]) for r in results}) == 1  # both modes rolled out the same tasks
    table = (tmp_path / "results.md").read_text()
    assert (
        "| main | moe | search | 4 | default | sync | prorsa |" in table
        and "| main | moe | search | 4 | default | async | prorsa |" in table
    )
    assert (
        "what ends each row" in table and "| main | moe | search | 4 | default | async | prorsa | " in table.split("what ends each row")[1]
    )
    assert (
        "vs best static" in table
        and "async against sync" in table
        and "other tasks" not in table.split("async against sync")[1].split("\n", 1)[1]
    )
    assert (tmp_path / "timeline-moe-search.png").stat().st_size > 10_000


def test_mode_comparison_pairs_each_family_across_modes():
    def rec(mode: str, policy: str, run_s: float, families: dict | None = None) -> dict:
        return {
            "table": "main",
            "fleet": "f",
            "workload": "w",
            "trajectories_per_gpu": 1,
            "variant": "default",
            "mode": mode,
            "policy": policy,
            "run_s": run_s,
            "throughput_per_s": 100 / run_s,
            "families": families or {"swe": 100},
        }

    rows = [rec("sync", "colocated", 200), rec("sync", "static-1:3", 150), rec("sync", "static-2:2", 120), rec("sync", "prorsa", 100)]
    rows += [
        rec("async", "colocated", 100),
        rec("async", "static-1:3", 90),
        rec("async", "static-2:2", 95),
        rec("async", "prorsa", 50, {"math": 100}),
    ]
    by = {m["policy"]: m for m in mode_comparisons(rows)}
    assert set(by) == {"colocated", "static", "prorsa"}  # no colocated-sticky run: no row
    assert by["colocated"]["async_vs_sync"] == 2.0 and by["colocated"]["same_tasks"]
    assert (by["static"]["sync_policy"], by["static"]["async_policy"]) == ("static-2:2", "static-1:3")  # each mode's best split
    assert by["static"]["async_vs_sync"] == round(120 / 90, 3)
    assert not by["prorsa"]["same_tasks"]  # flagged, not hidden
    assert "(other tasks)" in results_markdown(
        [
            {
                **r,
                "rollout_s": r["run_s"],
                "lower_bound_s": 1.0,
                "speedup_vs_colocated": None,
                "role_switches": 0,
                "p50_traj_s": 1.0,
                "p99_traj_s": 1.0,
            }
            for r in rows
        ]
    )


def test_lower_bound_is_the_longest_critical_path(tmp_path: Path):
    suite = SUITES["smoke"]
    config = run_config(suite, suite.cases(("main",))[0], "colocated")
    ev = lambda kind, traj, **kw: {
        "kind": kind,
        "trajectory_id": traj,
        "step": 0,
        "new_tokens": 0,
        "context_tokens": 0,
        "generated_tokens": 0,
        "duration_s": 0.0,
        **kw,
    }
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


def test_lower_bound_takes_the_fastest_layout_of_a_stage_layout_fleet():
    """moe-stage: decode engines run DP attention + EP, colocated and prefill engines TP; a lone
    sequence decodes faster under TP, so the bound prices every decode there (a bound at the
    decode layout's step was beaten by colocated-sticky runs on search)."""
    from actors.allocator.capacity import decode_step_s
    from bus_schemas.control import Role

    suite = SUITES["paper"]
    case = next(c for c in suite.cases(("main",)) if c.fleet.name == "moe-stage")
    config = run_config(suite, case, "colocated")
    tp, dp = (decode_step_s(config.engines.cost_preset(role), 1, 0) for role in (Role.COLOCATED, Role.DECODE))
    assert tp < dp
    events = pl.DataFrame(
        [
            {
                "kind": "prefill_queued",
                "trajectory_id": "a",
                "step": 0,
                "new_tokens": 1,
                "context_tokens": 0,
                "generated_tokens": 0,
                "duration_s": 0.0,
            },
            {
                "kind": "decode_done",
                "trajectory_id": "a",
                "step": 0,
                "new_tokens": 0,
                "context_tokens": 0,
                "generated_tokens": 10_000,
                "duration_s": 0.0,
            },
        ]
    )
    bound = lower_bound_s(config, events)
    assert 9_999 * tp < bound < 10_000 * tp + 0.1 < 10_000 * dp  # 9,999 steps: the first token comes with the prefill


def test_paper_suite_plans_the_pd_tables_with_their_settings():
    suite = SUITES["paper"]
    cases = suite.cases()
    both = suite.cases(modes=("sync", "async"))
    assert len(both) == 2 * len(cases) and {c.mode for c in both} == {"sync", "async"}
    for sync, async_ in zip(both[::2], both[1::2]):  # every row in both modes: same fleet, workload, batches and batch shape
        assert (sync.key.removesuffix("-sync"), sync.mode, async_.mode) == (async_.key.removesuffix("-async"), "sync", "async")
        a, b = run_config(suite, sync, "prorsa"), run_config(suite, async_, "prorsa")
        assert (a.run.mode, b.run.mode) == ("sync", "async") and (b.trainer.max_staleness, b.trainer.stale_policy) == (1, "hold")
        assert (a.trainer.steps, a.trainer.tasks_per_step, a.trainer.samples_per_task) == (
            b.trainer.steps,
            b.trainer.tasks_per_step,
            b.trainer.samples_per_task,
        )
        assert a.workload == b.workload and a.engines == b.engines
    tables = {c.table for c in cases}
    assert tables == {"main", "sweep", "ablation", "sensitivity"}
    fleets = {c.fleet.name for c in cases}
    assert any("stage" in f for f in fleets) and any("deepseek" in f for f in fleets)
    sweep = {(c.fleet.name, c.workload.name, c.trajectories_per_gpu) for c in cases if c.table in ("main", "sweep")}
    for fleet in ("moe-stage", "deepseek"):
        for workload in ("swe", "shift"):
            assert {n for f, w, n in sweep if (f, w) == (fleet, workload)} == {16, 32, 64, 128}
    by_variant = {(c.fleet.name, c.variant): c for c in cases if c.table in ("ablation", "sensitivity")}
    ideal = run_config(suite, by_variant["deepseek", "dp_sync=ideal"], "prorsa")
    assert ideal.engines.dp_sync == "ideal"
    assert run_config(suite, by_variant["moe", "kv_writeback=none"], "prorsa").engines.kv_writeback == "none"
    assert run_config(suite, by_variant["moe-stage", "admission=vllm"], "prorsa").engines.admission == "vllm"
    assert ideal.engines.admission == "sglang"  # the other rows keep the default
    off = run_config(suite, by_variant["moe-stage", "stage layouts off"], "prorsa").engines
    assert off.prefill_layout is None and off.decode_layout is None and off.layout.dp == 4
    assert run_config(suite, by_variant["moe", "lockstep constants high"], "prorsa").engines.lockstep_constants == "high"
    stage = next(c for c in cases if c.table == "main" and c.fleet.name == "moe-stage")
    assert "colocated-sticky@1" in suite.policies(stage.fleet)  # colocated baselines in the prefill layout too
    other_layout = run_config(suite, stage, "colocated-sticky@1")
    assert other_layout.run.policy == "colocated-sticky" and other_layout.engines.layout.dp == 4
    main = run_config(suite, stage, "prorsa")
    assert main.engines.prefill_layout.tp == 4 and main.engines.decode_layout.dp == 4 and main.engines.layout.tp == 4
    per_gpu_128 = next(c for c in cases if c.trajectories_per_gpu == 128 and c.fleet.name == "deepseek")
    config = run_config(suite, per_gpu_128, "colocated")
    assert config.trainer.tasks_per_step * config.trainer.samples_per_task == 128 * per_gpu_128.fleet.gpus


def test_a_run_of_some_policies_runs_only_those_and_oracle_needs_prorsas_log(tmp_path: Path):
    """`--policies`: only the named policies run; `oracle` replays `prorsa`'s log of the same
    case, so without `prorsa` it needs that log from an earlier run in the same folder, and
    says so before running anything."""
    from runners.bench import main

    suite = SUITES["smoke"]
    with pytest.raises(ValueError, match="oracle replays prorsa's log"):
        run_suite(suite, tmp_path, jobs=1, modes=("sync",), policies=("oracle",))
    assert not (tmp_path / "runs").exists()  # nothing ran
    first = run_suite(suite, tmp_path, jobs=1, modes=("sync",), policies=("colocated-sticky", "prorsa"))
    assert [r["policy"] for r in first] == ["colocated-sticky", "prorsa"]
    then = run_suite(suite, tmp_path, jobs=1, modes=("sync",), policies=("oracle",))
    assert [(r["policy"], r["status"]) for r in then] == [("oracle", "completed")]
    assert main(["rollout", "--suite", "smoke", "--mode", "sync", "--policies", "static-9:9", "--out", str(tmp_path)]) == 2


def test_any_static_split_that_fits_a_fleet_can_be_asked_for_though_no_table_runs_it():
    """`--policies static-5:3`: the main table runs 1:7 to 4:4 on an 8-engine fleet, and a
    split it skips still runs where asked; on a 4-engine fleet it does not fit and is left out."""
    suite = SUITES["paper"]
    moe = next(f for f in suite.fleets if f.name == "moe")
    deepseek = next(f for f in suite.fleets if f.name == "deepseek")
    assert "static-5:3" not in suite.policies(moe, "main")
    assert suite.case_policies(moe, "main", ("colocated-sticky", "static-5:3")) == ["colocated-sticky", "static-5:3"]
    assert suite.case_policies(deepseek, "main", ("colocated-sticky", "static-5:3")) == ["colocated-sticky"]
    assert suite.case_policies(moe, "main", ("static-8:0", "static-0:8")) == []  # each side needs an engine
    assert suite.case_policies(moe, "main") == suite.policies(moe, "main")


def test_set_overrides_a_config_value_in_every_run_and_a_bad_one_stops_before_anything_runs(tmp_path: Path):
    """`--set SECTION.KEY=VALUE`: the value reaches every run's config (records say so); a
    malformed item or an unknown key is refused with exit 2 before anything runs."""
    from runners.bench import main

    args = ["rollout", "--suite", "smoke", "--mode", "sync", "--policies", "prorsa"]
    assert main([*args, "--out", str(tmp_path / "bad"), "--set", "allocator.saturated_regim=true"]) == 2
    assert main([*args, "--out", str(tmp_path / "bad"), "--set", "allocatorsaturated_regime=true"]) == 2
    assert not (tmp_path / "bad").exists()
    assert (
        main([*args, "--out", str(tmp_path / "on"), "--set", "allocator.saturated_regime=true", "--set", "engines.kv_writeback=store"]) == 0
    )
    records = json.loads((tmp_path / "on" / "results.json").read_text())
    assert [(r["saturated_regime"], r["kv_writeback"]) for r in records] == [(True, "store")]
    off = run_suite(
        SUITES["smoke"],
        tmp_path / "off",
        jobs=1,
        modes=("sync",),
        policies=("prorsa",),
        overrides={"allocator": {"saturated_regime": False}},
    )
    assert off[0]["saturated_regime"] is False


def test_seeds_run_every_case_once_per_workload_seed_and_the_tables_give_the_spread(tmp_path: Path):
    """`--seeds A,B`: each case runs at each workload seed (its own runs, its own draws), every
    ratio is taken within a seed, and a row run at several seeds gets each ratio's median
    with the lowest and the highest. A seed given twice (with `--set run.seed`) is refused
    before anything runs."""
    from runners.bench import main

    policies = ("colocated", "colocated-sticky", "static-1:3", "prorsa")
    results = run_suite(SUITES["smoke"], tmp_path, jobs=1, modes=("sync",), policies=policies, seeds=(7, 8))
    assert [(r["seed"], r["policy"]) for r in results] == [(s, p) for s in (7, 8) for p in policies]
    assert len({r["run_dir"] for r in results}) == len(results)  # each seed's runs in folders of their own
    by_seed = {s: {r["policy"]: r for r in results if r["seed"] == s} for s in (7, 8)}
    assert by_seed[7]["colocated"]["lower_bound_s"] != by_seed[8]["colocated"]["lower_bound_s"]  # other draws: another workload
    for _s, runs in by_seed.items():  # ratios within a seed
        assert runs["prorsa"]["speedup_vs_colocated"] == round(runs["colocated"]["rollout_s"] / runs["prorsa"]["rollout_s"], 3)
    (spread,) = seed_spread(comparisons(results))
    sticky = [by_seed[s]["colocated-sticky"]["rollout_s"] / by_seed[s]["prorsa"]["rollout_s"] for s in (7, 8)]
    median, low, high = spread["vs_colocated-sticky"]
    assert (
        spread["seeds"] == [7, 8]
        and abs(median - (sticky[0] + sticky[1]) / 2) < 2e-3
        and (low, high) == tuple(sorted(round(x, 3) for x in sticky))
    )
    assert spread["static_at_least"] == sum(by_seed[s]["static-1:3"]["rollout_s"] >= by_seed[s]["prorsa"]["rollout_s"] for s in (7, 8))
    table = (tmp_path / "results.md").read_text()
    assert "| sync, seed 7 | prorsa |" in table and "| sync, seed 8 | prorsa |" in table and "across workload seeds" in table
    args = ["rollout", "--suite", "smoke", "--mode", "sync", "--policies", "prorsa", "--out", str(tmp_path / "twice")]
    assert main([*args, "--seeds", "1,2", "--set", "run.seed=3"]) == 2
    assert main([*args, "--seeds", "1,x"]) == 2
    assert not (tmp_path / "twice").exists()


def _compared(fleet: str, workload: str, seed: int, prorsa_s: float, colocated_s: float) -> dict:
    """One `comparisons` row: prorsa and every baseline family, with the seconds given."""
    return {
        "table": "main",
        "fleet": fleet,
        "workload": workload,
        "trajectories_per_gpu": 32,
        "variant": "default",
        "seed": seed,
        "mode": "sync",
        "prorsa_s": prorsa_s,
        "colocated_s": colocated_s,
        "colocated-sticky_s": colocated_s,
        "colocated-best_s": colocated_s,
        "static_s": 2 * prorsa_s,
        "oracle_s": prorsa_s,
    }


def test_the_fleet_summary_gives_each_ratio_as_its_median_and_range_over_workloads_and_seeds():
    """The README's results: per fleet, one ratio per (workload, seed), their median, lowest and
    highest; a fleet with any row lacking a baseline gets no figure for it rather than a partial one."""
    rows = [
        _compared("moe", "swe", 1, 10.0, 11.0),
        _compared("moe", "swe", 2, 10.0, 15.0),
        _compared("moe", "math", 1, 10.0, 30.0),
        _compared("dense", "swe", 1, 10.0, 9.0),
        {**_compared("dense", "math", 1, 10.0, 12.0), "oracle_s": None},
        {**_compared("moe", "swe", 1, 10.0, 99.0), "table": "sweep"},  # another table: not counted
    ]
    moe, dense = fleet_summary(rows)
    assert (moe["fleet"], moe["workloads"], moe["seeds"]) == ("moe", ["swe", "math"], [1, 2])
    assert moe["vs_colocated"] == (1.5, 1.1, 3.0) and moe["vs_static"] == (2.0, 2.0, 2.0)
    assert moe["vs_colocated-best"] == moe["vs_colocated"]
    assert dense["vs_colocated"] == (1.05, 0.9, 1.2) and dense["of_oracle"] is None


def test_rollout_tables_merges_bench_folders_into_one_table(tmp_path: Path):
    """`python -m runners.rollout_tables A B --out C`: the runs of both folders in one
    results.json and one results.md (the seeds' spread included); a folder without results is
    refused in one line, before anything is written."""
    from runners.rollout_tables import main

    policies = ("colocated", "colocated-sticky", "static-1:3", "prorsa")
    for seed in (7, 8):
        run_suite(SUITES["smoke"], tmp_path / f"s{seed}", jobs=1, modes=("sync",), policies=policies, seeds=(seed,))
    assert main([str(tmp_path / "s7"), str(tmp_path / "nothing"), "--out", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()
    assert main([str(tmp_path / "s7"), str(tmp_path / "s8"), "--out", str(tmp_path / "both")]) == 0
    merged = json.loads((tmp_path / "both" / "results.json").read_text())
    assert sorted({r["seed"] for r in merged}) == [7, 8] and len(merged) == 2 * len(policies)
    table = (tmp_path / "both" / "results.md").read_text()
    assert "across workload seeds" in table and "prorsa per fleet" in table


def test_delayer_variants_set_the_prefill_delayer_keep_the_layout_and_run_only_where_it_can_act():
    """`colocated-sticky+delayer[@i]`: colocated-sticky with engines.prefill_delayer on, in the
    fleet's layout or its i-th colocated layout; planned only where the layout has DP attention
    (dp > 1), and not on rows whose engines already run the delayer."""
    suite = SUITES["paper"]
    fleets = {f.name: f for f in suite.fleets}
    main = {c.fleet.name: c for c in suite.cases(("main",)) if c.workload.name == "swe"}
    config = run_config(suite, main["moe-stage"], "colocated-sticky+delayer@1")
    assert config.run.policy == "colocated-sticky" and config.engines.prefill_delayer and config.engines.layout.dp == 4
    assert not run_config(suite, main["moe-stage"], "colocated-sticky@1").engines.prefill_delayer
    config = run_config(suite, main["deepseek"], "colocated-sticky+delayer")
    assert config.run.policy == "colocated-sticky" and config.engines.prefill_delayer and config.engines.layout.dp == 8
    assert not run_config(suite, main["deepseek"], "colocated-sticky").engines.prefill_delayer
    for table in ("main", "sweep", "ablation"):
        assert "colocated-sticky+delayer" in suite.policies(fleets["moe"], table)
        assert "colocated-sticky+delayer" in suite.policies(fleets["deepseek"], table)
        stage = [p for p in suite.policies(fleets["moe-stage"], table) if "+delayer" in p]
        assert stage == ["colocated-sticky+delayer@1"]  # its own layout is TP4: only the DP layout's
        assert not [p for p in suite.policies(fleets["dense"], table) if "+delayer" in p]  # dp 1: a no-op
    assert "colocated+delayer" not in suite.policies(fleets["moe"])  # naive colocated stays as it is
    rows = {(c.fleet.name, c.variant): c for c in suite.cases(("ablation",))}
    off = rows["moe-stage", "stage layouts off"]  # the DP layout: the delayer can act in the fleet's own layout
    assert "colocated-sticky+delayer" in suite.case_policies(off.fleet, off.table, (), off.engines)
    on = rows["moe", "prefill_delayer=on"]  # every run has it already: no duplicate runs
    assert not [p for p in suite.case_policies(on.fleet, on.table, (), on.engines) if "+delayer" in p]
    assert run_config(suite, on, "colocated-sticky").engines.prefill_delayer and run_config(suite, on, "prorsa").engines.prefill_delayer


def test_ablation_rows_act_where_each_mechanism_does():
    """Lockstep, the DP chunk and sibling prompt sharing on the DP-attention fleets (deepseek,
    moe), the host KV tier on every MoE fleet, the write-back modes on moe and moe-stage;
    stage layouts and admission on moe-stage. share_prompts is a workload override."""
    suite = SUITES["paper"]
    cases = suite.cases(("ablation", "sensitivity"))
    rows = {(c.table, c.fleet.name, c.variant): c for c in cases}
    assert len(rows) == len(cases)  # no row twice
    assert {(c.workload.name, c.trajectories_per_gpu) for c in cases} == {("swe", 64)}
    for fleet in ("deepseek", "moe"):
        engines = {
            "dp_sync=ideal": ("dp_sync", "ideal"),
            "prefill_delayer=on": ("prefill_delayer", True),
            "dp_chunk=full": ("dp_chunk", "full"),
            "host_kv_tier=off": ("host_kv_tier", False),
        }
        for variant, (key, value) in engines.items():
            config = run_config(suite, rows["ablation", fleet, variant], "prorsa")
            assert getattr(config.engines, key) == value, (fleet, variant)
            assert config.workload.share_prompts
        for level in ("low", "high"):
            assert (
                run_config(suite, rows["sensitivity", fleet, f"lockstep constants {level}"], "prorsa").engines.lockstep_constants == level
            )
        shared = rows["ablation", fleet, "share_prompts=off"]
        for policy in ("colocated-sticky", "prorsa"):
            config = run_config(suite, shared, policy)
            assert not config.workload.share_prompts and config.workload.overrides["swe"].turns_max == 16  # the SWE cap kept
            plain = run_config(suite, replace(shared, sections={}), policy)  # the row without its workload override
            assert plain.workload.share_prompts and config.engines == plain.engines  # only the workload differs
    assert {f for t, f, v in rows if v == "host_kv_tier=off"} == {"moe", "moe-stage", "deepseek"}
    for mode in ("none", "store"):
        assert {f for t, f, v in rows if v == f"kv_writeback={mode}"} == {"moe", "moe-stage"}
        assert run_config(suite, rows["ablation", "moe-stage", f"kv_writeback={mode}"], "prorsa").engines.kv_writeback == mode
    assert {f for t, f, v in rows if v in ("stage layouts off", "admission=vllm")} == {"moe-stage"}
    assert not [c for c in cases if c.fleet.name == "dense"]
    assert not SUITES["smoke"].ablations and not SUITES["smoke"].sensitivity
    # --set still wins over a row's own overrides
    config = run_config(suite, rows["ablation", "moe", "share_prompts=off"], "prorsa", overrides={"workload": {"share_prompts": True}})
    assert config.workload.share_prompts


def _run(policy: str, rollout_s: float, mode: str = "sync", **kw) -> dict:
    """One results.json record (the fields the tables read)."""
    return {
        "table": "main",
        "fleet": "moe",
        "workload": "swe",
        "trajectories_per_gpu": 32,
        "variant": "default",
        "seed": 2026,
        "mode": mode,
        "policy": policy,
        "rollout_s": rollout_s,
        "run_s": rollout_s + 60,
        "throughput_per_s": 100 / (rollout_s + 60),
        "families": {"swe": 100},
        "role_switches": 0,
        "p50_traj_s": 1.0,
        "p99_traj_s": 2.0,
        "lower_bound_s": 1.0,
        **kw,
    }


def test_colocated_best_is_the_fastest_colocated_sticky_run_and_names_it():
    """colocated-best: the fastest of a row's colocated-sticky runs over every layout and delayer
    setting, named by the run that won; colocated-sticky keeps its meaning (no delayer) and the
    naive colocated stays the per-run speedup's baseline."""
    from runners.rollout_tables import add_speedups, best_of

    runs = [
        _run("colocated", 200.0),
        _run("colocated-sticky", 150.0),
        _run("colocated-sticky+delayer", 140.0),
        _run("colocated@1", 190.0),
        _run("colocated-sticky@1", 130.0),
        _run("colocated-sticky+delayer@1", 120.0),
        _run("static-2:6", 110.0),
        _run("prorsa", 100.0),
    ]
    assert best_of(runs, "colocated-best")["policy"] == "colocated-sticky+delayer@1"
    assert best_of(runs, "colocated-sticky")["policy"] == "colocated-sticky@1"
    add_speedups(runs)
    by = {r["policy"]: r for r in runs}
    assert by["prorsa"]["speedup_vs_colocated"] == 2.0 and by["prorsa"]["speedup_vs_colocated_best"] == 1.2
    (c,) = comparisons(runs)
    assert (c["best_colocated-best"], c["colocated-best_s"], c["vs_colocated-best"]) == ("colocated-sticky+delayer@1", 120.0, 1.2)
    assert (c["vs_colocated"], c["vs_colocated-sticky"], c["static_vs_colocated_best"]) == (1.9, 1.3, round(120 / 110, 3))
    (f,) = fleet_summary([c])
    assert f["vs_colocated-best"] == (1.2, 1.2, 1.2) and f["colocated_best"] == ["colocated-sticky+delayer@1"]
    table = results_markdown(runs)
    assert "| 120.0 (colocated-sticky+delayer@1) |" in table and "vs colocated-best" in table and "colocated (naive)" in table
    assert "| colocated-sticky+delayer@1 |" in table.split("prorsa per fleet")[1]
    both = runs + [
        _run(p, s / 2, "async") for p, s in (("colocated-sticky", 150.0), ("colocated-sticky+delayer", 140.0), ("prorsa", 100.0))
    ]
    by_mode = {m["policy"]: m for m in mode_comparisons(both)}
    assert (by_mode["colocated-best"]["sync_policy"], by_mode["colocated-best"]["async_policy"]) == (
        "colocated-sticky+delayer@1",
        "colocated-sticky+delayer",
    )


def test_old_records_without_delayer_runs_still_render_with_colocated_best_the_best_sticky(tmp_path: Path):
    """results.json from before the delayer runs (and before speedup_vs_colocated_best):
    colocated-best falls back to the best colocated-sticky run; a row with no sticky run at all
    has none; both the tables and the merge command still render."""
    from runners.rollout_tables import main

    old = [
        _run("colocated", 200.0, speedup_vs_colocated=1.0),
        _run("colocated-sticky", 150.0, speedup_vs_colocated=1.333),
        _run("colocated-sticky@1", 160.0, speedup_vs_colocated=1.25),
        _run("prorsa", 100.0, speedup_vs_colocated=2.0),
        _run("colocated", 50.0, workload="math", speedup_vs_colocated=1.0),
        _run("prorsa", 40.0, workload="math", speedup_vs_colocated=1.25),
    ]
    swe, math = comparisons(old)
    assert (swe["best_colocated-best"], swe["vs_colocated-best"]) == ("colocated-sticky", 1.5)
    assert (math["best_colocated-best"], math["vs_colocated-best"], math["static_vs_colocated_best"]) == (None, None, None)
    (f,) = fleet_summary([swe, math])
    assert f["vs_colocated-best"] is None and f["colocated_best"] == ["colocated-sticky"]  # a row lacks it: no partial figure
    table = results_markdown(old)
    assert "| main | moe | swe | 32 | default | sync | prorsa | 100.0 |" in table and "| 150.0 (colocated-sticky) |" in table
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "results.json").write_text(json.dumps(old))
    assert main([str(tmp_path / "old"), "--out", str(tmp_path / "merged")]) == 0


def test_the_mismatch_table_runs_each_truth_against_prorsa_priced_both_ways_and_an_oracle_given_the_truth():
    suite = SUITES["paper"]
    cases = suite.cases(("mismatch",))
    variants = {(c.fleet.name, c.variant) for c in cases}
    assert {w for c in cases for w in [c.workload.name]} == {"swe", "shift"}
    for fleet in ("moe", "moe-stage", "deepseek", "dense"):
        assert {v for f, v in variants if f == fleet} >= {
            "truth prefill x1.3",
            "truth decode x0.75",
            "truth lockstep high",
            "truth kv x0.8",
        }
    assert ("moe", "truth h100") in variants and ("deepseek", "truth h100") not in variants  # DeepSeek-V3 does not fit 8 H100s
    case = next(c for c in cases if (c.fleet.name, c.variant) == ("deepseek", "truth prefill x1.3"))
    policies = suite.case_policies(case.fleet, case.table, (), case.engines)
    assert {"prorsa", "prorsa+model", "oracle", "static-1:3", "colocated-sticky"} <= set(policies)
    measured, model = run_config(suite, case, "prorsa"), run_config(suite, case, "prorsa+model")
    assert (measured.allocator.capacity, model.allocator.capacity) == ("measured", "model")
    assert model.run.policy == "prorsa" and measured.engines.truth.prefill == 1.3 and measured.engines.truth.spread == 0.1
    assert run_config(suite, case, "oracle", Path("prorsa.parquet")).allocator.capacity == "truth"
    main = next(c for c in suite.cases(("main",)) if c.fleet.name == "deepseek")
    assert run_config(suite, main, "oracle", Path("prorsa.parquet")).allocator.capacity == "measured"
    h100 = next(c for c in cases if (c.fleet.name, c.variant) == ("moe", "truth h100"))
    assert run_config(suite, h100, "prorsa").engines.truth.preset == "h100-qwen3-30b-a3b"


def test_the_mismatch_table_rates_prorsa_both_ways_against_the_best_fixed_arrangement_and_says_how_far_it_priced_from_the_truth():
    from runners.rollout_tables import best_fixed, mismatch_lines

    def rec(policy: str, rollout_s: float, learned: dict | None = None) -> dict:
        return {
            "table": "mismatch",
            "fleet": "deepseek",
            "workload": "swe",
            "trajectories_per_gpu": 32,
            "variant": "truth prefill x1.3",
            "seed": 2026,
            "mode": "sync",
            "policy": policy,
            "rollout_s": rollout_s,
            "learned": learned,
        }

    figures = {"prefill_s_per_token": [1.1, 1.0], "decode_kv_step_s": [0.5, 0.5]}
    results = [
        rec("colocated-sticky", 1800.0),
        rec("colocated-sticky+delayer", 1700.0),
        rec("static-1:3", 1400.0),
        rec("static-2:2", 1500.0),
        rec("prorsa", 1600.0, {"figures": figures}),
        rec("prorsa+model", 1750.0, {"figures": {"prefill_s_per_token": [0.8, 1.0], "decode_kv_step_s": [0.5, 0.5]}}),
        rec("oracle", 1520.0),
    ]
    assert best_fixed(results)["policy"] == "static-1:3"
    assert best_fixed([r for r in results if not r["policy"].startswith("static")])["policy"] == "colocated-sticky+delayer"
    line = mismatch_lines(results)[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[6:12] == ["1400.0 (static-1:3)", "1600.0", "0.875x", "0.800x", "1.094x", "0.950x"]
    assert cells[12] == "+10.0% / -20.0%" and cells[14] == "+0.0% / +0.0%" and cells[13] == "-"


def test_the_mismatch_table_across_seeds_gives_each_ratio_and_error_as_median_and_range():
    from runners.rollout_tables import mismatch_spread_lines

    def rec(seed: int, policy: str, rollout_s: float, prefill_error: float = 0.0) -> dict:
        figures = {"prefill_s_per_token": [1.0 + prefill_error, 1.0]}
        return {
            "table": "mismatch",
            "fleet": "moe",
            "workload": "swe",
            "trajectories_per_gpu": 32,
            "variant": "truth kv x0.8",
            "seed": seed,
            "mode": "sync",
            "policy": policy,
            "rollout_s": rollout_s,
            "learned": {"figures": figures} if policy.startswith("prorsa") else None,
        }

    results = []
    # seed 1: prorsa 1000 against a best fixed 990 (static-2:6); seed 2: 1000 against 1100 (colocated-sticky)
    for seed, fixed, model, oracle, error in (
        (1, ("static-2:6", 990.0), 1010.0, 950.0, 0.05),
        (2, ("colocated-sticky", 1100.0), 1000.0, 1000.0, -0.03),
    ):
        results += [rec(seed, fixed[0], fixed[1]), rec(seed, "static-4:4", 1500.0), rec(seed, "prorsa", 1000.0, error)]
        results += [rec(seed, "prorsa+model", model), rec(seed, "oracle", oracle)]
    results += [rec(3, "static-2:6", 900.0)]  # a seed without prorsa: no ratios, left out
    (line,) = [ln for ln in mismatch_spread_lines(results) if ln.startswith("| mismatch")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[5:7] == ["sync", "1, 2"]
    assert cells[7] == "1.04x [0.99–1.10]"  # vs best fixed: 0.990 and 1.100
    assert cells[8] == "1.04x [0.98–1.10]"  # +model vs best fixed: 990/1010 and 1100/1000
    assert cells[9] == "1.00x [1.00–1.01]" and cells[10] == "0.97x [0.95–1.00]"
    assert cells[11] == "2 of 2"
    assert cells[12] == "+1.0% [-3.0%–+5.0%]" and cells[13:15] == ["-", "-"]
    assert mismatch_spread_lines([r for r in results if r["seed"] == 1]) == []  # one seed: no spread


def test_the_published_seeds_are_five_listed_in_the_bench_and_named_by_one_word():
    from runners.bench import parse_seeds

    assert parse_seeds("published", "paper") == SUITES["paper"].published_seeds
    assert len(SUITES["paper"].published_seeds) >= 5 and SUITES["paper"].published_seeds[0] == SUITES["paper"].seed
    assert parse_seeds("3,1,3", "paper") == (3, 1)
    with pytest.raises(ValueError):
        parse_seeds("one,two", "paper")


def test_the_bench_starts_prorsa_runs_first_and_each_oracle_once_its_prorsa_is_done():
    """One at a time, the order is fixed: both prorsa runs first, each case's oracle right after
    the prorsa run whose log it replays, then the rest in the plan's order; each runs once."""
    a, b = (replace(SUITES["smoke"].cases(("main",))[0], variant=v) for v in "ab")
    plan = [(a, "colocated"), (a, "static-1:3"), (a, "prorsa"), (b, "colocated"), (b, "prorsa"), (a, "oracle"), (b, "oracle")]
    started, finished = [], []
    with ThreadPoolExecutor(1) as pool:

        def start(i: int) -> Future:
            started.append(i)
            return pool.submit(lambda: i)

        _run_in_order(plan, 1, start, lambda i, future: finished.append((i, future.result())), after={5: 2, 6: 4})
    assert started == [2, 5, 4, 6, 0, 1, 3]
    assert sorted(finished) == [(i, i) for i in range(len(plan))]


def test_prorsa_learns_from_an_earlier_run_of_its_case_run_first_and_not_shown(tmp_path: Path):
    """By default the bench runs each prorsa case's earlier run (another workload seed,
    colocated-sticky) before it, and prorsa's forecaster starts from that run's log; the earlier
    run is no row of the results. `prior=False` runs none."""
    from runners.rollout import PRIOR_POLICY, PRIOR_SEED, _run_dir, prior_case

    suite = SUITES["smoke"]
    (case,) = suite.cases(("main",), ("sync",))
    results = run_suite(suite, tmp_path / "on", jobs=1, modes=("sync",), policies=("colocated-sticky", "prorsa"))
    assert [(r["policy"], r["prior_seed"]) for r in results] == [("colocated-sticky", None), ("prorsa", PRIOR_SEED)]
    assert all(r["status"] == "completed" and not r["trajectories_lost"] for r in results)
    earlier = _run_dir(tmp_path / "on", prior_case(case), PRIOR_POLICY)
    assert (earlier / "events.parquet").exists() and str(earlier) not in {r["run_dir"] for r in results}
    config = run_config(suite, case, "prorsa", prior_log=earlier)
    assert config.forecaster.prior_log == str(earlier / "events.parquet")
    assert run_config(suite, case, "prorsa").forecaster.prior_log == ""
    off = run_suite(suite, tmp_path / "off", jobs=1, modes=("sync",), policies=("prorsa",), prior=False)
    assert off[0]["prior_seed"] is None and not _run_dir(tmp_path / "off", prior_case(case), PRIOR_POLICY).exists()
