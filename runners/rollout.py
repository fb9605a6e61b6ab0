"""The rollout bench: the same workloads (same seeds) under every policy, side by side.

    python -m runners.bench rollout [--suite paper] [--out DIR] [--live] [--jobs N]

Each fleet x workload x policy is one run of the same actors — in virtual time by default
(`runners.simulate`), on a real nats-server with `--live` (`ops.launch`). `oracle` reads
the true demand from the `prorsa` run's log of the same fleet and workload, so it runs
after it. Writes DIR/results.json (one record per run), DIR/results.md (the table) and a
timeline PNG per workload; every run's folder (events, summary) is kept under DIR/runs.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import polars as pl
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from actors.allocator.capacity import decode_step_s
from actors.config import Config, initial_roles, policy_label, with_policy
from actors.engine.emulated.costmodel import prefill_s
from bus_schemas.control import Role
from ops.export import load_events

console = Console(stderr=True)


@dataclass(frozen=True, slots=True)
class Fleet:
    name: str
    engines: dict  # the [engines] section
    gpus_per_engine: int
    static_splits: tuple[int, ...]  # prefill engines of each static-P:D the bench sweeps

    @property
    def gpus(self) -> int:
        return self.engines["count"] * self.gpus_per_engine


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    mix: dict[str, float]
    phases: tuple[dict, ...] = ()  # later steps' mixes
    overrides: dict = field(default_factory=dict)
    steps: int = 1  # sync RL steps (a shifting mix needs at least two)


@dataclass(frozen=True, slots=True)
class Suite:
    name: str
    fleets: tuple[Fleet, ...]
    workloads: tuple[Workload, ...]
    trajectories_per_gpu: int  # per RL step
    samples_per_task: int  # G
    environments: int
    seed: int = 2026
    dynamic: tuple[str, ...] = ("reactive", "prorsa")

    def tasks_per_step(self, fleet: Fleet) -> int:
        return max(1, fleet.gpus * self.trajectories_per_gpu // self.samples_per_task)

    def policies(self, fleet: Fleet) -> list[str]:
        count = fleet.engines["count"]
        statics = [f"static-{p}:{count - p}" for p in fleet.static_splits]
        return ["colocated", "colocated-sticky", *statics, *self.dynamic, "oracle"]


_SWE_SHORT = {"swe": {"turns_max": 16}}  # SWE episodes capped at 16 turns: keeps a step in minutes
SUITES = {
    # The README's suite: a MoE fleet with DP attention inside each engine (where the paper
    # reports its gains) and a dense 8B fleet (where PD helps less); 32 trajectories per GPU.
    "paper": Suite(
        name="paper",
        fleets=(
            Fleet("moe", {"count": 8, "preset": "h200-qwen3-30b-a3b", "layout": {"dp": 4, "ep": 4}}, 4, (1, 2, 3, 4)),
            Fleet("dense", {"count": 8, "preset": "h200-qwen3-8b"}, 1, (1, 2, 3, 4)),
        ),
        workloads=(
            Workload("swe", {"swe": 1.0}, overrides=_SWE_SHORT),
            Workload("search", {"search": 1.0}),
            Workload("math", {"math": 1.0}),
            Workload("shift", {"math": 0.8, "swe": 0.2}, ({"from_step": 1, "mix": {"swe": 0.8, "search": 0.2}},), _SWE_SHORT, steps=2),
        ),
        trajectories_per_gpu=32,
        samples_per_task=8,
        environments=4,
    ),
    # A minute-long check of the machinery (tests and smoke runs).
    "smoke": Suite(
        name="smoke",
        fleets=(Fleet("moe", {"count": 4, "preset": "h200-qwen3-30b-a3b", "layout": {"dp": 2, "ep": 2}}, 2, (1,)),),
        workloads=(Workload("search", {"search": 1.0}),),
        trajectories_per_gpu=4,
        samples_per_task=4,
        environments=2,
    ),
}


def run_config(suite: Suite, fleet: Fleet, workload: Workload, policy: str, oracle_log: Path | None = None) -> Config:
    raw = {
        "run": {"name": f"{suite.name}-{fleet.name}-{workload.name}", "seed": suite.seed, "time_scale": 20.0},
        "engines": {**fleet.engines, "prefill_engines": max(1, fleet.engines["count"] // 4)},
        "environments": {"count": suite.environments, "max_live_trajectories": 4096},
        "trainer": {"steps": workload.steps, "tasks_per_step": suite.tasks_per_step(fleet), "samples_per_task": suite.samples_per_task, "train_s": 60.0},
        "workload": {"mix": workload.mix, "phases": list(workload.phases), "overrides": workload.overrides},
        "allocator": {"oracle_log": str(oracle_log) if oracle_log else ""},
    }
    config = msgspec.convert(raw, Config)
    return with_policy(config, policy)


# --- one run -----------------------------------------------------------------------------
def _run_one(args: tuple[bytes, str, bool]) -> dict:
    config_json, out, live = args
    config = msgspec.json.decode(config_json, type=Config)
    out_path = Path(out)
    if live:
        from ops.launch import launch

        asyncio.run(launch(config, out_path, None))
        summary = json.loads((out_path / "summary.json").read_text())
    else:
        import logging

        from runners import simulate
        from runners.simulate import run

        logging.disable(logging.WARNING)  # the runs' warnings are in their summaries
        simulate.console.quiet = True  # the bench's progress bar is the one to watch
        summary = run(config, out_path, show_progress=False)
    return summary


def lower_bound_s(config: Config, events: pl.DataFrame) -> float:
    """Sum over steps of the longest trajectory's critical path: every prefill alone on a
    prefill engine (new tokens on a cached prefix), every decode at the fastest step (one
    sequence alone on the engine), its tool latencies, no queueing."""
    prefill, decode = config.engines.cost_preset(Role.PREFILL), config.engines.cost_preset(Role.DECODE)
    tpot_s = decode_step_s(decode, 1, 0)  # one sequence alone: under DP attention, busy peers slow a step
    turns = events.filter(pl.col("kind") == "prefill_queued").select("trajectory_id", "step", "new_tokens", "context_tokens")
    prefill_col = pl.struct("new_tokens", "context_tokens").map_elements(
        lambda r: prefill_s(prefill, max(1, r["new_tokens"]), r["context_tokens"]), return_dtype=pl.Float64
    )
    per_traj = turns.with_columns(prefill_col.alias("s")).group_by("trajectory_id", "step").agg(pl.col("s").sum().alias("prefill_s"))
    gen = events.filter(pl.col("kind") == "decode_done").group_by("trajectory_id").agg(pl.col("generated_tokens").sum().alias("gen"))
    tools = events.filter(pl.col("kind") == "tool_done").group_by("trajectory_id").agg(pl.col("duration_s").sum().alias("tool_s"))
    paths = (
        per_traj.join(gen, on="trajectory_id", how="left")
        .join(tools, on="trajectory_id", how="left")
        .fill_null(0)
        .with_columns((pl.col("prefill_s") + pl.col("gen") * tpot_s + pl.col("tool_s")).alias("path_s"))
    )
    return float(paths.group_by("step").agg(pl.col("path_s").max())["path_s"].sum())


def trajectory_times(events: pl.DataFrame) -> pl.Series:
    started = events.filter(pl.col("kind") == "started").group_by("trajectory_id").agg(pl.col("at_s").min().alias("t0"))
    finished = events.filter(pl.col("kind") == "finished").group_by("trajectory_id").agg(pl.col("at_s").max().alias("t1"))
    return started.join(finished, on="trajectory_id").select(pl.col("t1") - pl.col("t0"))["t1"]


def record(fleet: Fleet, workload: Workload, config: Config, summary: dict, out: Path) -> dict:
    events = load_events(out / "events.parquet")
    times = trajectory_times(events)
    role_switches = events.filter(pl.col("kind") == "role_switched").height
    return {
        "fleet": fleet.name,
        "workload": workload.name,
        "mode": config.run.mode,
        "policy": policy_label(config),
        "status": summary["status"],
        "rollout_s": round(sum(s["rollout_s"] for s in summary["steps"]), 2),
        "step_rollout_s": [s["rollout_s"] for s in summary["steps"]],
        "role_switches": role_switches,
        "p50_traj_s": round(float(times.quantile(0.5)), 2),
        "p99_traj_s": round(float(times.quantile(0.99)), 2),
        "lower_bound_s": round(lower_bound_s(config, events), 2),
        "trajectories_lost": summary["trajectories_lost"],
        "incomplete_trajectories": summary["incomplete_trajectories"],
        "wall_s": summary["wall_s"],
        "run_dir": str(out),
        "initial_roles": {e: r.value for e, r in initial_roles(config).items()},
    }


# --- the suite ---------------------------------------------------------------------------
def run_suite(suite: Suite, out: Path, live: bool = False, jobs: int = 2) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    plan: list[tuple[Fleet, Workload, str]] = [(f, w, p) for f in suite.fleets for w in suite.workloads for p in suite.policies(f)]
    first = [x for x in plan if x[2] != "oracle"]
    second = [x for x in plan if x[2] == "oracle"]
    results: list[dict] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    ctx = multiprocessing.get_context("spawn")
    with Progress(*columns, console=console) as progress, ctx.Pool(max(1, jobs)) as pool:
        bar = progress.add_task(f"rollout bench {suite.name} ({'live' if live else 'virtual time'})", total=len(plan))
        for batch in (first, second):
            configs = []
            for fleet, workload, policy in batch:
                run_dir = out / "runs" / f"{fleet.name}-{workload.name}-{policy.replace(':', '-')}"
                oracle_log = out / "runs" / f"{fleet.name}-{workload.name}-prorsa" / "events.parquet" if policy == "oracle" else None
                config = run_config(suite, fleet, workload, policy, oracle_log)
                configs.append((fleet, workload, config, run_dir))
            args = [(msgspec.json.encode(c), str(d), live) for _, _, c, d in configs]
            for (fleet, workload, config, run_dir), summary in zip(configs, pool.imap(_run_one, args)):
                results.append(record(fleet, workload, config, summary, run_dir))
                progress.update(bar, advance=1, description=f"{fleet.name}/{workload.name}/{policy_label(config)}")
    add_speedups(results)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(results_markdown(results))
    from runners.timeline import plot_timelines

    plot_timelines(results, out)
    return results


def add_speedups(results: list[dict]) -> None:
    base = {(r["fleet"], r["workload"]): r["rollout_s"] for r in results if r["policy"] == "colocated"}
    for r in results:
        b = base.get((r["fleet"], r["workload"]))
        r["speedup_vs_colocated"] = round(b / r["rollout_s"], 3) if b and r["rollout_s"] > 0 else None


def best_static(results: list[dict], fleet: str, workload: str) -> dict | None:
    statics = [r for r in results if r["fleet"] == fleet and r["workload"] == workload and r["policy"].startswith("static-")]
    return min(statics, key=lambda r: r["rollout_s"], default=None)


def results_markdown(results: list[dict]) -> str:
    lines = [
        "| fleet | workload | policy | rollout s | vs colocated | switches | p50 traj s | p99 traj s | rollout / bound |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        bound = r["rollout_s"] / r["lower_bound_s"] if r["lower_bound_s"] else float("nan")
        lines.append(
            f"| {r['fleet']} | {r['workload']} | {r['policy']} | {r['rollout_s']:.1f} | {r['speedup_vs_colocated']:.3f}x | "
            f"{r['role_switches']} | {r['p50_traj_s']:.1f} | {r['p99_traj_s']:.1f} | {bound:.2f} |"
        )
    lines += ["", "prorsa against the others (ratio > 1: prorsa faster):", "",
              "| fleet | workload | vs colocated | vs colocated-sticky | vs best static | vs reactive | of oracle |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for fleet, workload in dict.fromkeys((r["fleet"], r["workload"]) for r in results):
        by = {r["policy"]: r["rollout_s"] for r in results if r["fleet"] == fleet and r["workload"] == workload}
        if "prorsa" not in by:
            continue
        p = by["prorsa"]
        static = best_static(results, fleet, workload)

        def ratio(other: float | None) -> str:
            return f"{other / p:.3f}x" if other else "-"

        static_cell = f"{ratio(static['rollout_s'])} ({static['policy']})" if static else "-"
        lines.append(
            f"| {fleet} | {workload} | {ratio(by.get('colocated'))} | {ratio(by.get('colocated-sticky'))} | {static_cell} | "
            f"{ratio(by.get('reactive'))} | {ratio(by.get('oracle'))} |"
        )
    return "\n".join(lines) + "\n"
