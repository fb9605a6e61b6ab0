"""The rollout bench: the same workloads (same seeds) under every policy, side by side.

    python -m runners.bench rollout [--suite paper] [--mode sync|async|both] [--out DIR] [--live] [--jobs N]

Each fleet x workload x mode x policy is one run of the same actors — in virtual time by default
(`runners.simulate`), on a real nats-server with `--live` (`ops.launch`). `oracle` reads
the true demand from the `prorsa` run's log of the same fleet, workload and mode, so it runs
after it. Async runs (run.mode = "async", docs/async.md) train the same number of batches
of the same shape as the sync run, with max_staleness = ASYNC_MAX_STALENESS and
stale_policy = ASYNC_STALE_POLICY. colocated-sticky also runs with SGLang's PrefillDelayer
(`colocated-sticky+delayer[@i]`) where the layout has DP attention; the tables' colocated-best is
the fastest of a row's colocated-sticky runs (runners/rollout_tables.py). Writes DIR/results.json (one record per run), DIR/results.md (the table) and a
timeline PNG per workload; every run's folder (events, summary) is kept under DIR/runs.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import secrets
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path

import msgspec
import polars as pl
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from actors.allocator.capacity import CapacityModel, decode_step_s
from actors.config import Config, EngineSection, initial_roles, with_policy
from actors.engine.emulated.costmodel import prefill_s
from bus_schemas.control import Role
from ops.critical_path import critical_paths, summed
from ops.export import load_events
from runners.rollout_tables import MISMATCH_FIGURES, add_speedups, results_markdown

console = Console(stderr=True)


@dataclass(frozen=True, slots=True)
class Fleet:
    name: str
    engines: dict  # the [engines] section
    gpus_per_engine: int
    static_splits: tuple[int, ...]  # prefill engines of each static-P:D the bench sweeps
    # other layouts the colocated baselines also run with (stage-layout fleets: the prefill
    # layout); the tables compare against the better of them
    colocated_layouts: tuple[dict, ...] = ()
    # the static splits the other tables sweep (fewer: they run at up to 4x the trajectories)
    side_static_splits: tuple[int, ...] | None = None

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
    structure: dict = field(default_factory=dict)  # the workload section's other keys (difficulty, tool_tail, random_mixes, drift)


MODES = ("sync", "async")
TABLES = ("main", "sweep", "ablation", "sensitivity", "mismatch", "generalization")
ASYNC_MAX_STALENESS = 1  # policy versions (trainer.max_staleness) in the bench's async runs
ASYNC_STALE_POLICY = "hold"  # every assigned group is trained: the same trajectories as sync


@dataclass(frozen=True, slots=True)
class Case:
    """One row of a table: a fleet, a workload and a concurrency, with engine settings that
    differ from the fleet's (`engines`, named by `variant`), in one RL mode, run under every policy."""

    table: str  # one of TABLES
    fleet: Fleet
    workload: Workload
    trajectories_per_gpu: int
    engines: dict = field(default_factory=dict)
    variant: str = "default"
    mode: str = "sync"  # run.mode: "sync" or "async"
    seed: int | None = None  # run.seed (the workload's draws); None: the suite's
    # other sections' overrides, {section: {key: value}} (e.g. {"workload": {"share_prompts": False}})
    sections: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        seed = "" if self.seed is None else f"-seed{self.seed}"
        return f"{self.table}-{self.fleet.name}-{self.workload.name}-{self.trajectories_per_gpu}-{self.variant}-{self.mode}{seed}"


@dataclass(frozen=True, slots=True)
class Suite:
    name: str
    fleets: tuple[Fleet, ...]
    workloads: tuple[Workload, ...]
    trajectories_per_gpu: int  # per RL step, main table
    samples_per_task: int  # G
    environments: int
    seed: int = 2026
    # the workload seeds the docs' tables are run on (`--seeds published`): the suite's, then 1-4
    published_seeds: tuple[int, ...] = (2026, 1, 2, 3, 4)
    dynamic: tuple[str, ...] = ("reactive", "prorsa")
    # concurrency sweep: (fleet names, workload names, trajectories per GPU)
    sweep: tuple[tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]], ...] = ()
    # ablation / sensitivity rows: (fleet, workload, trajectories per GPU, variant, engine
    # overrides[, other sections' overrides {section: {key: value}}]); `_rows` builds them
    ablations: tuple[tuple, ...] = ()
    sensitivity: tuple[tuple, ...] = ()
    # engines whose truth differs from the model they are priced with (`engines.truth`): rows
    # as ablations' (`mismatch_rows`)
    mismatch: tuple[tuple, ...] = ()
    generalization: tuple[Workload, ...] = ()  # run on every fleet at the main table's concurrency

    def tasks_per_step(self, fleet: Fleet, trajectories_per_gpu: int | None = None) -> int:
        per_gpu = self.trajectories_per_gpu if trajectories_per_gpu is None else trajectories_per_gpu
        return max(1, fleet.gpus * per_gpu // self.samples_per_task)

    def policies(self, fleet: Fleet, table: str = "main", engines: dict | None = None) -> list[str]:
        """Every policy on the main table; the other tables (ratios against colocated-sticky,
        the best static split and oracle) skip plain colocated, reactive and the least
        likely static splits, to stay within the bench's time. colocated-sticky also runs with
        SGLang's PrefillDelayer (`+delayer`) in each layout where it can act: DP attention
        (dp > 1), and the case's engines (`engines`, its overrides) not already running it."""
        merged = {**fleet.engines, **(engines or {})}
        count = fleet.engines["count"]
        main = table in ("main", "generalization")  # the generalization table runs the main table's policies
        splits = fleet.static_splits if main or fleet.side_static_splits is None else fleet.side_static_splits
        statics = [f"static-{p}:{count - p}" for p in splits]
        families = ["colocated", "colocated-sticky"] if main else ["colocated-sticky"]
        colocated = []
        for i, layout in enumerate((merged.get("layout"), *fleet.colocated_layouts)):
            at = f"@{i}" if i else ""
            colocated += [f"{family}{at}" for family in families]
            if delayer_acts(layout) and not merged.get("prefill_delayer"):
                colocated.append(f"colocated-sticky{DELAYER}{at}")
        dynamic = list(self.dynamic) if main else [p for p in self.dynamic if p != "reactive"]
        if table == "mismatch":  # what learning buys: prorsa priced by the cost model alone beside it
            dynamic.append(f"prorsa{MODEL_CAPACITY}")
        return [*colocated, *statics, *dynamic, "oracle"]

    def case_policies(self, fleet: Fleet, table: str, asked: tuple[str, ...] = (), engines: dict | None = None) -> list[str]:
        """The policies a case runs: the table's (`policies`, for the case's `engines`
        overrides), only those `asked` where given, plus any static split `asked` names that
        fits the fleet (`static-P:D`, P + D engines, each at least 1), though the table does not
        run it by default."""
        own = self.policies(fleet, table, engines)
        if not asked:
            return own
        count = fleet.engines["count"]
        fits = {f"static-{p}:{count - p}" for p in range(1, count)}
        return [p for p in own if p in asked] + [p for p in asked if p in fits and p not in own]

    def cases(
        self,
        tables: tuple[str, ...] = ("main", "sweep", "ablation", "sensitivity"),
        modes: tuple[str, ...] = ("sync",),
        seeds: tuple[int, ...] = (),
        fresh: tuple[int, ...] = (),
    ) -> list[Case]:
        """Every row of `tables`, once per mode (a row's sync and async cases side by side) and
        per workload seed in `seeds` (none: the suite's; the generalization table's: `fresh`,
        the seeds a bench run draws for it)."""
        return [
            replace(c, mode=m, seed=s)
            for c in self._cases(tables)
            for m in modes
            for s in (seeds or (fresh if c.table == "generalization" and fresh else (None,)))
        ]

    def _cases(self, tables: tuple[str, ...]) -> list[Case]:
        fleets = {f.name: f for f in self.fleets}
        workloads = {w.name: w for w in (*self.workloads, *self.generalization)}
        out: list[Case] = []
        if "main" in tables:
            out += [Case("main", f, w, self.trajectories_per_gpu) for f in self.fleets for w in self.workloads]
        if "generalization" in tables:
            out += [Case("generalization", f, w, self.trajectories_per_gpu) for f in self.fleets for w in self.generalization]
        if "sweep" in tables:
            for fleet_names, workload_names, per_gpu in self.sweep:
                out += [
                    Case("sweep", fleets[f], workloads[w], n)
                    for f in fleet_names
                    for w in workload_names
                    for n in per_gpu
                    if n != self.trajectories_per_gpu
                ]
        for table, rows in (("ablation", self.ablations), ("sensitivity", self.sensitivity), ("mismatch", self.mismatch)):
            if table in tables:
                out += [
                    Case(table, fleets[f], workloads[w], n, dict(engines), variant, sections=dict(sections[0]) if sections else {})
                    for f, w, n, variant, engines, *sections in rows
                ]
        return out


DELAYER = "+delayer"  # a colocated-sticky policy with engines.prefill_delayer on: colocated-sticky+delayer[@i]
MODEL_CAPACITY = "+model"  # prorsa priced by the cost model alone (allocator.capacity = "model"): prorsa+model


def delayer_acts(layout: dict | None) -> bool:
    """Whether SGLang's PrefillDelayer can act on colocated engines of `layout`: DP attention (dp > 1)."""
    return bool(layout) and layout.get("dp", 1) > 1


def _rows(
    fleets: tuple[str, ...], variant: str, engines: dict | None = None, workload: dict | None = None, on: tuple[str, int] = ("swe", 64)
) -> tuple[tuple, ...]:
    """One ablation / sensitivity row per fleet in `fleets`, on workload `on` (name, trajectories
    per GPU): `variant` names the `engines` overrides and the `workload` section's overrides."""
    sections = {"workload": dict(workload)} if workload else {}
    return tuple((f, *on, variant, dict(engines or {}), sections) for f in fleets)


_SWE_SHORT = {"swe": {"turns_max": 16}}  # SWE episodes capped at 16 turns: keeps a step in minutes
_MOE = {"count": 8, "preset": "h200-qwen3-30b-a3b", "layout": {"dp": 4, "ep": 4}}
# Stage-specific parallelism: prefill engines run TP over the engine's 4 GPUs (no DP attention,
# so one long prefill uses all of them and no all-to-all runs), decode engines DP attention + EP.
# Colocated engines mix prefill and decode in every step, which under DP attention makes every
# mixed step eager with normal-mode all-to-all: they run TP too; the colocated baselines also
# run the DP layout (`colocated_layouts`) and the tables compare against the better one.
_DP4_EP4 = {"dp": 4, "ep": 4}
_MOE_STAGE = {**_MOE, "layout": {"tp": 4}, "prefill_layout": {"tp": 4}, "decode_layout": _DP4_EP4}
_DEEPSEEK = {"count": 4, "preset": "h200-deepseek-v3-fp8", "layout": {"dp": 8, "ep": 8}}
_WORKLOADS = (
    Workload("swe", {"swe": 1.0}, overrides=_SWE_SHORT),
    Workload("search", {"search": 1.0}),
    Workload("math", {"math": 1.0}),
    Workload("shift", {"math": 0.8, "swe": 0.2}, ({"from_step": 1, "mix": {"swe": 0.8, "search": 0.2}},), _SWE_SHORT, steps=2),
)
# Workloads with structure the forecaster is not told (docs/workloads.md, "Structure nobody
# told the forecaster"): no constant of the allocator or the forecaster is set from their table.
_TERMINAL_SHORT = {"terminal": {"turns_max": 16}}
_GENERALIZATION = (
    # a latent difficulty per trajectory, correlated across GRPO siblings
    Workload(
        "difficulty", {"swe": 0.5, "search": 0.5}, (), _SWE_SHORT, structure={"difficulty": {"sigma": 0.5, "sibling_correlation": 0.7}}
    ),
    # long-horizon terminal tasks whose tool calls are heavy-tailed, with timeouts and retries
    Workload(
        "tool-tail",
        {"terminal": 1.0},
        (),
        _TERMINAL_SHORT,
        structure={"tool_tail": {"share": 0.05, "alpha": 1.5, "scale_s": 10.0, "timeout_s": 120.0, "retries": 2}},
    ),
    # each step's mix drawn at random, single-family steps and abrupt changes included
    Workload(
        "random-mix",
        {"swe": 1.0},
        (),
        {**_SWE_SHORT, **_TERMINAL_SHORT},
        steps=3,
        structure={"random_mixes": {"families": ["swe", "search", "math", "terminal"], "single_share": 0.3}},
    ),
    # trajectories that grow step over step as the policy learns
    Workload(
        "drift", {"swe": 0.5, "math": 0.5}, (), _SWE_SHORT, steps=3, structure={"drift": {"turns_per_step": 0.1, "gen_per_step": 0.15}}
    ),
)
# The earlier run prorsa's forecaster starts from (`forecaster.prior_log`), as an operator's
# earlier run of the same task mix on the same fleet: another workload seed (none of the
# tables': fresh generalization seeds are drawn below it), under the plain colocated fleet
PRIOR_SEED = 1_000_000
PRIOR_POLICY = "colocated-sticky"
GENERALIZATION_SEEDS = 5  # fresh workload seeds per bench run, printed, where --seeds gives none
# Each mechanism's rows where it acts: lockstep and the DP chunk on the DP-attention fleets
# (deepseek, moe; on moe-stage colocated engines run TP4), the host KV tier on every MoE fleet,
# the write-back modes on the 8-engine MoE fleets, stage layouts and admission on moe-stage.
_LOCKSTEP = ("deepseek", "moe")
_MOE_FLEETS = ("moe", "moe-stage", "deepseek")
_ABLATIONS = (
    *_rows(("moe",), "default"),  # the defaults at the rows' concurrency (deepseek's and moe-stage's are in the sweep)
    *_rows(_LOCKSTEP, "dp_sync=ideal", {"dp_sync": "ideal"}),
    *_rows(_LOCKSTEP, "prefill_delayer=on", {"prefill_delayer": True}),
    *_rows(_MOE_FLEETS, "host_kv_tier=off", {"host_kv_tier": False}),
    *_rows(("moe", "moe-stage"), "kv_writeback=none", {"kv_writeback": "none"}),
    *_rows(("moe", "moe-stage"), "kv_writeback=store", {"kv_writeback": "store"}),
    *_rows(_LOCKSTEP, "dp_chunk=full", {"dp_chunk": "full"}),
    *_rows(_LOCKSTEP, "share_prompts=off", workload={"share_prompts": False}),
    *_rows(("moe-stage",), "stage layouts off", {"layout": _DP4_EP4, "prefill_layout": None, "decode_layout": None}),
    *_rows(("moe-stage",), "admission=vllm", {"admission": "vllm"}),
)
_PAPER_FLEETS = (
    Fleet("moe", _MOE, 4, (1, 2, 3, 4)),
    Fleet("moe-stage", _MOE_STAGE, 4, (1, 2, 3, 4), colocated_layouts=(_DP4_EP4,), side_static_splits=(2, 3, 4)),
    Fleet("deepseek", _DEEPSEEK, 8, (1, 2, 3), side_static_splits=(1, 2, 3)),
    Fleet("dense", {"count": 8, "preset": "h200-qwen3-8b"}, 1, (1, 2, 3, 4)),
)
_SENSITIVITY = (
    *_rows(_LOCKSTEP, "lockstep constants low", {"lockstep_constants": "low"}),
    *_rows(_LOCKSTEP, "lockstep constants high", {"lockstep_constants": "high"}),
)
# Engines whose truth differs from the cost model the allocator is given (`engines.truth`):
# each constant family at the ends of its range and beyond, a different GPU, and in every
# case engines that differ from each other by up to 10% (docs/allocation.md, "What the
# allocator knows"). Factors multiply model time: prefill x1.3 is 30% less prefill throughput.
TRUTH_SPREAD = 0.1
MISMATCH_CASES = (
    ("truth prefill x1.3", {"prefill": 1.3}),
    ("truth prefill x0.7", {"prefill": 0.7}),
    ("truth decode x1.25", {"decode": 1.25}),
    ("truth decode x0.75", {"decode": 0.75}),
    ("truth lockstep high", {"lockstep_constants": "high"}),
    ("truth lockstep low", {"lockstep_constants": "low"}),
    ("truth kv x0.8", {"kv": 0.8}),
    ("truth kv x1.2", {"kv": 1.2}),
    ("truth h100", {"preset": "h100"}),  # an H100 fleet priced as the H200 preset
)


def mismatch_rows(fleets: tuple[Fleet, ...], workloads: tuple[str, ...], per_gpu: int) -> tuple[tuple, ...]:
    """One mismatch row per fleet, workload and case of MISMATCH_CASES; the H100 case only
    where the fleet's layouts fit H100s (DeepSeek-V3's DP8 + EP8 does not: 8 x 80 GB)."""
    rows = []
    for fleet in fleets:
        for variant, truth in MISMATCH_CASES:
            truth = {**truth, "spread": TRUTH_SPREAD}
            if "preset" in truth:
                truth["preset"] = fleet.engines["preset"].replace("h200-", "h100-", 1)
                try:
                    msgspec.convert({**fleet.engines, "truth": truth}, EngineSection)
                except (msgspec.ValidationError, ValueError):
                    continue
            rows += [(fleet.name, w, per_gpu, variant, {"truth": truth}) for w in workloads]
    return tuple(rows)


SUITES = {
    # The docs' suite (docs/allocation.md): MoE fleets with DP attention inside each engine
    # (where the paper reports its gains; one with stage-specific layouts), a DeepSeek-V3
    # fleet (DP attention + EP, where the interference is strongest) and a dense 8B fleet.
    "paper": Suite(
        name="paper",
        fleets=_PAPER_FLEETS,
        workloads=_WORKLOADS,
        trajectories_per_gpu=32,
        samples_per_task=8,
        environments=4,
        sweep=((("moe-stage", "deepseek"), ("swe", "shift"), (16, 32, 64, 128)),),
        ablations=_ABLATIONS,
        sensitivity=_SENSITIVITY,
        mismatch=mismatch_rows(_PAPER_FLEETS, ("swe", "shift"), 32),
        generalization=_GENERALIZATION,
    ),
    # A seconds-long check of the machinery (tests and smoke runs); two batches, so an async
    # run has a batch to overlap with training.
    "smoke": Suite(
        name="smoke",
        fleets=(Fleet("moe", {"count": 4, "preset": "h200-qwen3-30b-a3b", "layout": {"dp": 2, "ep": 2}}, 2, (1,)),),
        workloads=(Workload("search", {"search": 1.0}, steps=2),),
        trajectories_per_gpu=4,
        samples_per_task=4,
        environments=2,
    ),
}


def run_config(
    suite: Suite, case: Case, policy: str, oracle_log: Path | None = None, overrides: dict | None = None, prior_log: Path | None = None
) -> Config:
    """The case's config under `policy` (its forecaster starting from `prior_log`, where
    given); `overrides` ({section: {key: value}}, the bench's --set) replace the suite's
    values in every run, for variants of the code's defaults."""
    fleet, workload = case.fleet, case.workload
    engines = {**fleet.engines, **case.engines, "prefill_engines": max(1, fleet.engines["count"] // 4)}
    engines = {k: v for k, v in engines.items() if v is not None}
    if "@" in policy:  # a colocated baseline in another of the fleet's layouts
        policy, which = policy.split("@")
        engines["layout"] = fleet.colocated_layouts[int(which) - 1]
    capacity = {}
    if policy.endswith(MODEL_CAPACITY):  # prorsa priced by the cost model alone
        policy, capacity = policy.removesuffix(MODEL_CAPACITY), {"capacity": "model"}
    elif policy == "oracle" and case.table == "mismatch":  # the oracle is given the truth
        capacity = {"capacity": "truth"}
    if policy.endswith(DELAYER):  # colocated-sticky with SGLang's PrefillDelayer
        policy = policy.removesuffix(DELAYER)
        engines["prefill_delayer"] = True
    raw = {
        "run": {
            "name": f"{suite.name}-{case.key}",
            "seed": suite.seed if case.seed is None else case.seed,
            "time_scale": 20.0,
            "mode": case.mode,
        },
        "engines": engines,
        "environments": {"count": suite.environments, "max_live_trajectories": 1 << 16},
        "trainer": {
            "steps": workload.steps,
            "tasks_per_step": suite.tasks_per_step(fleet, case.trajectories_per_gpu),
            "samples_per_task": suite.samples_per_task,
            "train_s": 60.0,
            **({"max_staleness": ASYNC_MAX_STALENESS, "stale_policy": ASYNC_STALE_POLICY} if case.mode == "async" else {}),
        },
        "workload": {"mix": workload.mix, "phases": list(workload.phases), "overrides": workload.overrides, **workload.structure},
        "allocator": {"oracle_log": str(oracle_log) if oracle_log else "", **capacity},
        "forecaster": {"prior_log": str(prior_log) if prior_log else ""},
    }
    for section, values in [*case.sections.items(), *(overrides or {}).items()]:  # the row's, then --set's
        raw[section] = {**raw.get(section, {}), **values}
    config = msgspec.convert(raw, Config)
    return with_policy(config, policy)


# --- one run -----------------------------------------------------------------------------
def _run_one(args: tuple[Case, str, bytes, str, bool]) -> dict:
    """Run one case under one policy, and return its results row (read from the run's log
    here, in the worker, so that the bench's own process does no per-run work)."""
    case, policy, config_json, out, live = args
    config = msgspec.json.decode(config_json, type=Config)
    return record(case, policy, config, _simulate_or_launch(config, Path(out), live), Path(out))


def _simulate_or_launch(config: Config, out_path: Path, live: bool) -> dict:
    """The run's summary."""
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
    """No policy's `rollout_s` can beat this. A trajectory's critical path: every prefill alone
    on an engine (new tokens on a cached prefix), every decode step at the fastest step (one
    sequence alone on the engine; a decode's first token comes with its prefill), its tool
    latencies, no queueing; each at the fastest of the fleet's prefill, decode and colocated
    layouts (with stage layouts a colocated TP engine decodes a lone sequence faster than the
    DP-attention decode layout). The same for every policy whose engines run among those
    layouts. Sync: the sum over steps of the longest path of the step. Async (no step
    boundaries): the longest path of the run."""
    presets = [config.engines.cost_preset(role) for role in (Role.PREFILL, Role.DECODE, Role.COLOCATED)]
    tpot_s = min(decode_step_s(p, 1, 0) for p in presets)  # one sequence alone: under DP attention, busy peers slow a step
    turns = events.filter(pl.col("kind") == "prefill_queued").select("trajectory_id", "new_tokens", "context_tokens")
    prefill_col = pl.struct("new_tokens", "context_tokens").map_elements(
        lambda r: min(prefill_s(p, max(1, r["new_tokens"]), r["context_tokens"]) for p in presets), return_dtype=pl.Float64
    )
    per_traj = turns.with_columns(prefill_col.alias("s")).group_by("trajectory_id").agg(pl.col("s").sum().alias("prefill_s"))
    step = events.filter(pl.col("kind") == "started").group_by("trajectory_id").agg(pl.col("step").first())  # sync: the trajectory's step
    # a decode of g tokens takes g - 1 steps: its first token is sampled at the end of its prefill
    steps = (pl.col("generated_tokens") - 1).clip(lower_bound=0)
    decode = events.filter(pl.col("kind") == "decode_done").group_by("trajectory_id").agg(steps.sum().alias("decode_steps"))
    tools = events.filter(pl.col("kind") == "tool_done").group_by("trajectory_id").agg(pl.col("duration_s").sum().alias("tool_s"))
    paths = (
        per_traj.join(step, on="trajectory_id", how="left")
        .join(decode, on="trajectory_id", how="left")
        .join(tools, on="trajectory_id", how="left")
        .fill_null(0)
        .with_columns((pl.col("prefill_s") + pl.col("decode_steps") * tpot_s + pl.col("tool_s")).alias("path_s"))
    )
    if config.run.mode == "async":
        return float(paths["path_s"].max() or 0.0)
    return float(paths.group_by("step").agg(pl.col("path_s").max())["path_s"].sum())


def trajectory_times(events: pl.DataFrame) -> pl.Series:
    started = events.filter(pl.col("kind") == "started").group_by("trajectory_id").agg(pl.col("at_s").min().alias("t0"))
    finished = events.filter(pl.col("kind") == "finished").group_by("trajectory_id").agg(pl.col("at_s").max().alias("t1"))
    return started.join(finished, on="trajectory_id").select(pl.col("t1") - pl.col("t0"))["t1"]


def rollout_s(mode: str, steps: list[dict]) -> float:
    """Model seconds of rollout. Sync: the sum over steps of first assignment to last finished
    trajectory (training and weight loads excluded: rollout is paused then). Async (rollout
    never pauses, training overlaps it): first assignment to the forming of the last batch, when
    its last trajectory finished — training that overlaps rollout is inside it."""
    if mode == "async":
        return steps[-1]["rollout_done_at_s"] - steps[0]["started_at_s"]
    return sum(s["rollout_s"] for s in steps)


def run_s(events: pl.DataFrame, steps: list[dict]) -> float:
    """Model seconds of the whole RL loop, the same in both modes: first assignment to the
    last policy version published (the last batch trained)."""
    published = events.filter(pl.col("kind") == "policy_published")["at_s"].max()
    return float(published) - steps[0]["started_at_s"]


def record(case: Case, policy: str, config: Config, summary: dict, out: Path) -> dict:
    events = load_events(out / "events.parquet")
    times = trajectory_times(events)
    role_switches = events.filter(pl.col("kind") == "role_switched").height
    steps = summary["steps"]
    trained = sum(s["trajectories"] for s in steps)
    whole_s = run_s(events, steps)
    started = events.filter(pl.col("kind") == "started").group_by("task_family").len()
    families = {f: int(n) for f, n in sorted(started.iter_rows())}  # trajectories started per task family
    staleness: list[int] = []  # trained trajectories per staleness, over every batch (async)
    for s in steps:
        for i, n in enumerate(s["staleness"]):
            staleness += [0] * (i + 1 - len(staleness))
            staleness[i] += n
    return {
        "table": case.table,
        "fleet": case.fleet.name,
        "workload": case.workload.name,
        "trajectories_per_gpu": case.trajectories_per_gpu,
        "variant": case.variant,
        "mode": config.run.mode,
        "seed": config.run.seed,
        "policy": policy,
        "dp_sync": config.engines.dp_sync,
        "kv_writeback": config.engines.kv_writeback,
        "admission": config.engines.admission,
        "lockstep_constants": config.engines.lockstep_constants,
        "prefill_delayer": config.engines.prefill_delayer,
        "host_kv_tier": config.engines.host_kv_tier,
        "dp_chunk": config.engines.dp_chunk,
        "share_prompts": config.workload.share_prompts,
        "stage_layouts": config.engines.prefill_layout is not None or config.engines.decode_layout is not None,
        "saturated_regime": config.allocator.saturated_regime,
        "max_staleness": config.trainer.max_staleness if config.run.mode == "async" else None,
        "stale_policy": config.trainer.stale_policy if config.run.mode == "async" else None,
        "status": summary["status"],
        "rollout_s": round(rollout_s(config.run.mode, steps), 2),
        "step_rollout_s": [s["rollout_s"] for s in steps],
        "run_s": round(whole_s, 2),
        "trajectories": summary["trajectories_finished"],
        "trajectories_trained": trained,
        "throughput_per_s": round(trained / whole_s, 4) if whole_s > 0 else None,
        "families": families,
        "staleness": staleness,
        "dropped": sum(s["dropped"] for s in steps),
        "role_switches": role_switches,
        "p50_traj_s": round(float(times.quantile(0.5)), 2),
        "p99_traj_s": round(float(times.quantile(0.99)), 2),
        "lower_bound_s": round(lower_bound_s(config, events), 2),
        # the last trajectory of each step, its time by what it was doing (ops.critical_path)
        "critical_path_s": summed(critical_paths(events, config.run.mode)),
        "trajectories_expected": summary["trajectories_expected"],
        "trajectories_lost": summary["trajectories_lost"],
        "incomplete_trajectories": summary["incomplete_trajectories"],
        "wall_s": summary["wall_s"],
        "run_dir": str(out),
        "initial_roles": {e: r.value for e, r in initial_roles(config).items()},
        "truth": None if config.engines.truth.exact else msgspec.to_builtins(config.engines.truth),
        "capacity": config.allocator.capacity if config.runs_allocator else None,
        "learned": learned_capacity(config, events, out),
    }


def learned_capacity(config: Config, events: pl.DataFrame, out: Path) -> dict | None:
    """What a dynamic policy priced with at the end of the first step (its allocations.parquet
    row then), against the figures of the cost model the engines really run (`engines.truth`,
    without the per-engine spread) at the same decode context: {figure: [learned, truth]}, and
    the factors it applied. None for a fixed policy."""
    path = out / "allocations.parquet"
    if not config.runs_allocator or not path.exists():
        return None
    decisions = pl.read_parquet(path)
    finished = events.filter((pl.col("kind") == "finished") & (pl.col("step") == events["step"].min()))
    end_s = float(finished["at_s"].max()) if finished.height else float(decisions["at_s"].max())
    by_then = decisions.filter(pl.col("at_s") <= end_s)
    row = (by_then if by_then.height else decisions).row(-1, named=True)
    truth = CapacityModel(config.engines, config.allocator.decode_tpot_slack, truth=True).at(row["decode_context_tokens"])
    out_figures = {f: [row[f], getattr(truth, f)] for f, _ in MISMATCH_FIGURES if f in row}
    scales = {k: row[f"capacity_{k}_scale"] for k in ("prefill", "decode", "mixed", "kv") if f"capacity_{k}_scale" in row}
    return {"at_s": row["at_s"], "figures": out_figures, "scales": scales}


# --- the suite ---------------------------------------------------------------------------
def prior_case(case: Case) -> Case:
    """The earlier run of `case` whose log `prorsa`'s forecaster starts from
    (`forecaster.prior_log`): the same fleet, workload, engines and mode at workload seed
    PRIOR_SEED, under PRIOR_POLICY."""
    return replace(case, seed=PRIOR_SEED)


def learns_prior(policy: str) -> bool:
    """Whether a policy's allocator reads the forecaster (prorsa and its variants)."""
    return policy.startswith("prorsa")


def _run_dir(out: Path, case: Case, policy: str) -> Path:
    """The folder of one case's run under one policy."""
    return out / "runs" / f"{case.key}-{policy.replace(':', '-')}".replace(" ", "_").replace("=", "-")


def _run_in_order(
    plan: list[tuple[Case, str]], jobs: int, start: Callable[[int], Future], done: Callable[[int, Future], None], after: dict[int, int]
) -> None:
    """Run every (case, policy) of `plan` (`start(i)`; `done(i, future)` once it ends), `jobs`
    at a time, each run i of `after` once run after[i] is done (an oracle after the prorsa run
    whose log it replays, a prorsa run after the earlier run its forecaster learns from); of
    the others, the runs another waits for first, then the allocator's own policies (their
    forecaster makes them the longest: started last, one would run alone at the end). The
    order changes the bench's wall time only: each run is its own process, on its own config."""
    waited_for = set(after.values())
    todo = sorted((i for i in range(len(plan)) if i not in after), key=lambda i: (i not in waited_for, not plan[i][1].startswith("prorsa")))
    unlocked: list[int] = []
    running: dict[Future, int] = {}
    while todo or unlocked or running:
        while len(running) < jobs and (unlocked or todo):
            i = (unlocked or todo).pop(0)
            running[start(i)] = i
        finished, _ = wait(running, return_when=FIRST_COMPLETED)
        for future in sorted(finished, key=running.__getitem__):
            i = running.pop(future)
            done(i, future)
            unlocked += sorted(j for j, first in after.items() if first == i)


def _dependencies(plan: list[tuple[Case, str]], shown: int, prior: bool) -> tuple[dict[int, int], dict[int, int]]:
    """The run each run of `plan` waits for, and of those the earlier runs: an oracle waits for
    the prorsa run of its case (whose log it replays); with `prior`, each of the first `shown`
    runs that learns a prior for the earlier run of its case (and starts from its log)."""
    index = {(c.key, p): i for i, (c, p) in enumerate(plan)}
    replays = {i: index[(c.key, "prorsa")] for i, (c, p) in enumerate(plan) if p == "oracle" and (c.key, "prorsa") in index}
    priors = {i: index[(prior_case(c).key, PRIOR_POLICY)] for i, (c, p) in enumerate(plan[:shown]) if prior and learns_prior(p)}
    return replays | priors, priors


def run_suite(
    suite: Suite,
    out: Path,
    live: bool = False,
    jobs: int = 2,
    tables: tuple[str, ...] = ("main", "sweep", "ablation", "sensitivity"),
    per_gpu: tuple[int, ...] = (),
    modes: tuple[str, ...] = MODES,
    only: tuple[tuple[str, ...], ...] = ((), (), ()),
    policies: tuple[str, ...] = (),
    overrides: dict | None = None,
    seeds: tuple[int, ...] = (),
    prior: bool = True,
) -> list[dict]:
    """Run the suite's cases (of `tables`, in `modes`; only those at `per_gpu` trajectories per
    GPU, of the fleets, workloads and variants in `only`, and the `policies`, where given), each once per
    workload seed in `seeds` (default: the suite's seed). `oracle` replays `prorsa`'s log of
    the same case: run without `prorsa`, it needs that log in `out` from an earlier run
    (ValueError, before anything runs, where one is missing). With `prior`, `prorsa`'s
    forecaster starts from the log of an earlier run of its case (`prior_case`), run first
    and not shown in the results."""
    if seeds and "seed" in (overrides or {}).get("run", {}):
        raise ValueError("give the workload seeds once: --seeds or --set run.seed, not both")
    out.mkdir(parents=True, exist_ok=True)
    fleets, workloads, variants = only
    fresh = ()
    if "generalization" in tables and not seeds:  # seeds nobody tuned on: drawn now, and said
        fresh = tuple(secrets.randbelow(PRIOR_SEED) for _ in range(GENERALIZATION_SEEDS))
        console.print(f"generalization table: workload seeds {', '.join(map(str, fresh))} (drawn for this run)")
    cases = [
        c
        for c in suite.cases(tables, modes, seeds, fresh)
        if (not per_gpu or c.trajectories_per_gpu in per_gpu)
        and (not fleets or c.fleet.name in fleets)
        and (not workloads or c.workload.name in workloads)
        and (not variants or c.variant in variants)
    ]
    plan = [(case, p) for case in cases for p in suite.case_policies(case.fleet, case.table, policies, case.engines)]
    missing = [
        c.key
        for c, p in plan
        if p == "oracle" and (c, "prorsa") not in plan and not (_run_dir(out, c, "prorsa") / "events.parquet").exists()
    ]
    if missing:
        raise ValueError(
            f"oracle replays prorsa's log of the same case, and {out} has none for {', '.join(missing)}: add prorsa to the policies"
        )
    plan = [x for x in plan if x[1] != "oracle"] + [x for x in plan if x[1] == "oracle"]  # the results' order
    shown = len(plan)  # the earlier runs the forecaster learns from are appended, and not shown
    if prior:
        plan += list({prior_case(c).key: (prior_case(c), PRIOR_POLICY) for c, p in plan if learns_prior(p)}.values())
    after, priors = _dependencies(plan, shown, prior)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with (
        Progress(*columns, console=console) as progress,
        ProcessPoolExecutor(max(1, jobs), mp_context=multiprocessing.get_context("spawn")) as pool,
    ):
        bar = progress.add_task(f"rollout bench {suite.name} ({'live' if live else 'virtual time'})", total=len(plan))
        records: dict[int, dict] = {}

        def start(i: int) -> Future:
            case, policy = plan[i]
            run_dir = _run_dir(out, case, policy)
            oracle_log = _run_dir(out, case, "prorsa") / "events.parquet" if policy == "oracle" else None
            prior_log = _run_dir(out, *plan[priors[i]]) if i in priors else None
            config = run_config(suite, case, policy, oracle_log, overrides, prior_log)
            return pool.submit(_run_one, (case, policy, msgspec.json.encode(config), str(run_dir), live))

        def done(i: int, future: Future) -> None:
            case, policy = plan[i]
            records[i] = {**future.result(), "prior_seed": plan[priors[i]][0].seed if i in priors else None}
            progress.update(bar, advance=1, description=f"{case.key}/{policy}")  # the key ends in the mode (and seed)
            (out / "results.partial.json").write_text(json.dumps([records[j] for j in sorted(records) if j < shown], indent=2) + "\n")

        _run_in_order(plan, max(1, jobs), start, done, after)
    results = [records[i] for i in range(shown)]
    add_speedups(results)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "results.md").write_text(results_markdown(results))
    from runners.timeline import plot_timelines

    first_seed = results[0].get("seed") if results else None  # several seeds: the first one's (one file per workload)
    plot_timelines([r for r in results if r["table"] == "main" and r["mode"] == modes[0] and r.get("seed") == first_seed], out)
    return results
