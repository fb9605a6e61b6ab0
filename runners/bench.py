"""Benchmarks that print figures.

python -m runners.bench calibration --out DIR    cost model vs published figures (fitting and validation sets)
python -m runners.bench rollout [--suite paper] [--mode sync|async|both] [--seeds A,B,C|published] [--out DIR] [--live] [--jobs N]
                                                 every policy side by side, sync and async RL (runners.rollout)
python -m runners.bench simulation [--engines 64 256 1024] [--turns-max 5] [--out DIR]
                                                 simulation wall time vs fleet size (runners.simscale)
python -m runners.bench bus [--out DIR]          lifecycle events/s and control latency on the real server (runners.bench_bus)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


def calibration(out: Path) -> int:
    from runners.calibration import TOLERANCE, report

    result = report()
    console = Console(width=220)
    for key, title in (
        ("fitting", f"fitting set: the figures the constants were derived from (regression guard, tolerance {TOLERANCE:.0%})"),
        ("validation", "validation set: published H100/H200 figures that set no constant"),
    ):
        table = Table(title=title)
        for column in ("point", "predicted", "published", "unit", "time error", "source"):
            table.add_column(column, justify="right" if column in ("predicted", "published", "time error") else "left")
        for r in result[key]:
            ok = abs(r["time_error"]) <= (TOLERANCE if key == "fitting" else 0.20)
            table.add_row(
                r["point"],
                f"{r['predicted']:.4g}",
                f"{r['published']:.4g}",
                r["unit"],
                f"[{'green' if ok else 'red'}]{r['time_error']:+.1%}",
                r["source"],
            )
        console.print(table)
    s = result["validation_summary"]
    console.print(
        f"validation (H100/H200, {s['points']} points): median |time error| {s['median_abs_time_error']:.1%} "
        f"(target {s['median_target']:.0%}), max {s['max_abs_time_error']:.1%} (target {s['max_target']:.0%})"
    )
    from runners.lockstep_check import PUBLISHED_LOSS, check, grid

    lockstep = check()
    result["lockstep_check"] = {"loss": round(lockstep.loss, 3), "published_range": list(PUBLISHED_LOSS), "grid": grid()}
    console.print(
        f"lockstep check ({lockstep.preset}, DP attention, sglang): desynchronised prefill loses {lockstep.loss:.1%} of input "
        f"throughput (published {PUBLISHED_LOSS[0]:.0%}-{PUBLISHED_LOSS[1]:.0%}); by client concurrency and output length:"
    )
    grid_table = Table()
    for column in ("concurrency per rank", "output tokens", "loss, sglang", "loss, ideal"):
        grid_table.add_column(column, justify="right")
    for row in result["lockstep_check"]["grid"]:
        grid_table.add_row(str(row["concurrency"]), str(row["output_tokens"]), f"{row['sglang']:.1%}", f"{row['ideal']:.1%}")
    console.print(grid_table)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'calibration.json'}")
    return 0 if all(abs(r["time_error"]) <= TOLERANCE for r in result["fitting"]) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.bench")
    sub = parser.add_subparsers(dest="bench", required=True)
    cal = sub.add_parser("calibration", help="cost model vs published figures")
    cal.add_argument("--out", type=Path, default=Path("runs/calibration"))
    roll = sub.add_parser("rollout", help="every allocation policy on the same workloads")
    roll.add_argument("--suite", default="paper", help="paper (default) or smoke")
    roll.add_argument("--out", type=Path, default=None, help="default runs/rollout-<suite>")
    roll.add_argument("--live", action="store_true", help="run on a real nats-server in real time (slow) instead of virtual time")
    roll.add_argument("--jobs", type=int, default=2, help="runs at once (virtual time: one core each)")
    roll.add_argument(
        "--tables",
        default="main,sweep,ablation,sensitivity",
        help="which of the suite's tables to run (comma-separated: main, sweep, ablation, sensitivity, mismatch, generalization)",
    )
    roll.add_argument("--mode", choices=("sync", "async", "both"), default="both", help="RL mode(s) to run every policy in (default both)")
    roll.add_argument("--fleets", default="", help="only these fleets (comma-separated; default every fleet of the suite)")
    roll.add_argument("--workloads", default="", help="only these workloads (comma-separated; default every workload)")
    roll.add_argument("--per-gpu", default="", help="only the cases at these trajectories per GPU (comma-separated)")
    roll.add_argument(
        "--variants", default="", help="only these rows of the ablation, sensitivity and mismatch tables (comma-separated variant names)"
    )
    roll.add_argument(
        "--policies",
        default="",
        help="only these policies (comma-separated, e.g. colocated-sticky,static-3:1; any static-P:D that fits a fleet runs on it; oracle without prorsa needs prorsa's runs in --out)",
    )
    roll.add_argument(
        "--no-prior",
        action="store_true",
        help="prorsa's forecaster starts from nothing, instead of from an earlier run of each case (another workload seed, colocated-sticky)",
    )
    roll.add_argument(
        "--seeds",
        default="",
        help="run every case once per workload seed (comma-separated, e.g. 2026,2,3; 'published': the seeds of the docs' tables); the tables then add each row's spread across seeds",
    )
    roll.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SECTION.KEY=JSON",
        help="override a config value in every run, e.g. allocator.saturated_regime=true (repeatable)",
    )
    sim = sub.add_parser("simulation", help="how simulation wall time grows with the fleet")
    sim.add_argument("--engines", type=int, nargs="+", default=[64, 256, 1024])
    sim.add_argument("--turns-max", type=int, default=5, help="cap SWE episodes at this many turns (0: the full profile)")
    sim.add_argument("--out", type=Path, default=Path("runs/simscale"))
    bus = sub.add_parser("bus", help="lifecycle events per second and control latency on the real nats-server")
    bus.add_argument("--out", type=Path, default=Path("runs/bench-bus"))
    bus.add_argument("--events", type=int, default=100_000, help="lifecycle events, fsync off")
    bus.add_argument("--fsync-events", type=int, default=20_000, help="lifecycle events, sync_interval always")
    bus.add_argument("--switches", type=int, default=200, help="role switches timed")
    bus.add_argument("--engines", type=int, default=64, help="engines whose heartbeats flow meanwhile")
    bus.add_argument("--heartbeat-wall-s", type=float, default=0.05, help="their heartbeat period (a 20x run's)")
    gw = sub.add_parser("gateway", help="the OpenAI-compatible gateway's time per turn, the turn itself left out")
    gw.add_argument("--sessions", type=int, default=64)
    gw.add_argument("--turns", type=int, default=10, help="turns per session (each request carries the whole conversation)")
    gw.add_argument("--concurrent", type=int, default=1, help="sessions driven at once")
    args = parser.parse_args(argv)
    if args.bench == "gateway":
        import asyncio

        from runners.bench_gateway import bench as gateway_bench

        print(json.dumps(asyncio.run(gateway_bench(args.sessions, args.turns, args.concurrent))))
        return 0
    if args.bench == "bus":
        import asyncio

        from runners.bench_bus import bench

        result = asyncio.run(bench(args.out, args.events, args.fsync_events, args.switches, args.engines, args.heartbeat_wall_s))
        print(json.dumps({k: v for k, v in result.items() if k != "measured"}))
        print(f"wrote {args.out / 'bus.json'}")
        return 0 if result["lost"] == 0 else 1
    if args.bench == "calibration":
        return calibration(args.out)
    if args.bench == "simulation":
        from runners.simscale import run

        rows = run(args.engines, args.turns_max or None, args.out)
        return 0 if all(r["status"] == "completed" for r in rows) else 1
    if args.bench == "rollout":
        tables = tuple(t.strip() for t in args.tables.split(",") if t.strip())
        out = args.out or Path("runs") / f"rollout-{args.suite}"
        per_gpu = tuple(int(n) for n in args.per_gpu.split(",") if n.strip())
        modes = ("sync", "async") if args.mode == "both" else (args.mode,)
        only = tuple(tuple(x for x in arg.split(",") if x) for arg in (args.fleets, args.workloads, args.variants))
        policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
        overrides = parse_sets(args.set)
        if overrides is None:
            return 2
        try:
            seeds = parse_seeds(args.seeds, args.suite)
        except ValueError:
            print(f"error: --seeds {args.seeds!r}: expected integers, e.g. 2026,2,3, or 'published'", file=sys.stderr)
            return 2
        jobs = 1 if args.live else args.jobs
        return rollout(args.suite, out, args.live, jobs, tables, per_gpu, modes, only, policies, overrides, seeds, not args.no_prior)
    return 2


def parse_sets(sets: list[str]) -> dict | None:
    """--set SECTION.KEY=VALUE items as {section: {key: value}} (VALUE read as JSON, else kept as
    a string); None, having said why, where one is malformed."""
    out: dict[str, dict] = {}
    for item in sets:
        key, eq, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not (eq and dot and section and name):
            print(f"error: --set {item!r}: expected SECTION.KEY=VALUE, e.g. allocator.saturated_regime=true", file=sys.stderr)
            return None
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value  # a bare string: engines.kv_writeback=store
        out.setdefault(section, {})[name] = parsed
    return out


def parse_seeds(text: str, suite_name: str) -> tuple[int, ...]:
    """--seeds: integers, or "published" for the seeds the docs' tables were run on (the suite's
    `published_seeds`). ValueError for anything else."""
    if text.strip() == "published":
        from runners.rollout import SUITES

        return SUITES[suite_name].published_seeds if suite_name in SUITES else ()
    return tuple(dict.fromkeys(int(n) for n in text.split(",") if n.strip()))


def rollout(
    suite_name: str,
    out: Path,
    live: bool,
    jobs: int,
    tables: tuple[str, ...] = ("main", "sweep", "ablation", "sensitivity"),
    per_gpu: tuple[int, ...] = (),
    modes: tuple[str, ...] = ("sync", "async"),
    only: tuple[tuple[str, ...], ...] = ((), (), ()),
    policies: tuple[str, ...] = (),
    overrides: dict | None = None,
    seeds: tuple[int, ...] = (),
    prior: bool = True,
) -> int:
    from runners.rollout import SUITES, TABLES, run_suite

    if suite_name not in SUITES:
        print(f"error: unknown suite {suite_name!r} (known: {', '.join(SUITES)})", file=sys.stderr)
        return 2
    unknown = set(tables) - set(TABLES)
    if unknown:
        print(f"error: unknown table(s) {', '.join(sorted(unknown))} (known: {', '.join(TABLES)})", file=sys.stderr)
        return 2
    suite = SUITES[suite_name]
    variants = {c.variant for c in suite.cases(tables)}
    fleets, workloads, asked_variants = only
    unknown = (
        {*fleets} - {f.name for f in suite.fleets}
        | {*workloads} - {w.name for w in (*suite.workloads, *suite.generalization)}
        | {*asked_variants} - variants
    )
    if unknown:
        print(
            f"error: suite {suite_name!r} has no fleet, workload or variant {', '.join(sorted(unknown))} in those tables", file=sys.stderr
        )
        return 2
    known = {p for case in suite.cases(tables) for p in suite.case_policies(case.fleet, case.table, policies)}
    if set(policies) - known:
        print(
            f"error: the tables asked for run no policy {', '.join(sorted(set(policies) - known))} (they run: {', '.join(sorted(known))})",
            file=sys.stderr,
        )
        return 2
    if overrides:
        import msgspec

        from actors.config import Config

        try:
            msgspec.convert(overrides, Config)
        except msgspec.ValidationError as err:
            print(f"error: --set: {err}", file=sys.stderr)
            return 2
    try:
        results = run_suite(suite, out, live, jobs, tables, per_gpu, modes, only, policies, overrides, seeds, prior)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print((out / "results.md").read_text())
    print(f"wrote {out / 'results.json'}, {out / 'results.md'} and the timelines in {out}")
    bad = [r for r in results if r["status"] != "completed" or r["trajectories_lost"] or r["incomplete_trajectories"]]
    for r in bad:
        print(
            f"error: {r['fleet']}/{r['workload']}/{r['mode']}/{r['policy']}: {r['status']}, "
            f"{r['trajectories_lost']} lost, {r['incomplete_trajectories']} incomplete",
            file=sys.stderr,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
