"""The rollout bench's tables (pure): speedups against colocated, prorsa against the best of
each baseline family per row and mode, async throughput against sync, and the markdown the
bench writes (runners/rollout.py).

The baselines: `colocated` (naive: the seed's baseline), `colocated-sticky` (its better layout),
and `colocated-best`, the strongest colocated baseline and the headline's: the fastest of the
row's colocated-sticky runs over every layout (`@i`) and PrefillDelayer setting (`+delayer`),
named by the run that won (records from before the delayer runs: the best colocated-sticky).

Times are model seconds. `rollout_s` (per mode, runners.rollout.rollout_s): sync, the sum over
steps of first assignment to last finished trajectory; async, first assignment to the forming
of the last batch. `run_s`: first assignment to the last policy published, in both modes;
throughput = trained trajectories / run_s.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from ops.critical_path import BUCKETS, BUCKETS_ALIGN, BUCKETS_HEADER

ROW = ("table", "fleet", "workload", "trajectories_per_gpu", "variant")


def _row_key(r: dict) -> tuple:
    """A row of a table, for one workload seed (records before seeds were recorded: None)."""
    return (*(r[k] for k in ROW), r.get("seed"))


def _case_key(r: dict) -> tuple:
    return (*_row_key(r), r.get("mode", "sync"))


COLOCATED_BEST = "colocated-best"
DELAYER = "+delayer"  # a colocated-sticky run with SGLang's PrefillDelayer (runners.rollout)


def _ratio(base: float | None, run_s: float) -> float | None:
    return round(base / run_s, 3) if base and run_s > 0 else None


def colocated_best_s(results: list[dict]) -> dict[tuple, float]:
    """Per case (row and mode): colocated-best's rollout time (`best_of`)."""
    out = {}
    for key in dict.fromkeys(_case_key(r) for r in results):
        best = best_of([r for r in results if _case_key(r) == key], COLOCATED_BEST)
        if best:
            out[key] = best["rollout_s"]
    return out


def add_speedups(results: list[dict]) -> None:
    """`speedup_vs_colocated`: colocated's (naive) rollout time over the run's, in the same mode;
    `speedup_vs_colocated_best`: colocated-best's."""
    base = {_case_key(r): r["rollout_s"] for r in results if r["policy"] == "colocated"}
    best = colocated_best_s(results)
    for r in results:
        r["speedup_vs_colocated"] = _ratio(base.get(_case_key(r)), r["rollout_s"])
        r["speedup_vs_colocated_best"] = _ratio(best.get(_case_key(r)), r["rollout_s"])


def best_of(rows: list[dict], family: str, key: str = "rollout_s") -> dict | None:
    """The fastest run of a policy family by `key` (lower is better): `static` (any split),
    `colocated-best` (colocated-sticky in any layout, with or without the PrefillDelayer) or a
    colocated baseline in any layout (without the delayer)."""
    if family == "static":
        pick = [r for r in rows if r["policy"].startswith("static-")]
    elif family == COLOCATED_BEST:
        pick = [r for r in rows if r["policy"].split("@")[0].removesuffix(DELAYER) == "colocated-sticky"]
    else:
        pick = [r for r in rows if r["policy"].split("@")[0] == family]
    return min(pick, key=lambda r: r[key], default=None)


def comparisons(results: list[dict]) -> list[dict]:
    """Per case (row and mode): prorsa against the best colocated, colocated-sticky (either
    layout), colocated-best (which run won: `best_colocated-best`), the best static split
    (hindsight) and oracle, by rollout_s; ratios > 1 mean prorsa is faster."""
    out = []
    for key in dict.fromkeys(_case_key(r) for r in results):
        rows = [r for r in results if _case_key(r) == key]
        by = {r["policy"]: r for r in rows}
        if "prorsa" not in by:
            continue
        p = by["prorsa"]["rollout_s"]
        row = dict(zip((*ROW, "seed", "mode"), key))
        row["prorsa_s"] = p
        for family in ("colocated", "colocated-sticky", COLOCATED_BEST, "static"):
            best = best_of(rows, family)
            row[f"vs_{family}"] = round(best["rollout_s"] / p, 3) if best else None
            row[f"best_{family}"] = best["policy"] if best else None
            row[f"{family}_s"] = best["rollout_s"] if best else None
        row["vs_reactive"] = round(by["reactive"]["rollout_s"] / p, 3) if "reactive" in by else None
        row["oracle_s"] = by["oracle"]["rollout_s"] if "oracle" in by else None
        row["of_oracle"] = round(by["oracle"]["rollout_s"] / p, 3) if "oracle" in by else None
        sticky, static = best_of(rows, "colocated-sticky"), best_of(rows, "static")
        row["static_vs_sticky"] = round(sticky["rollout_s"] / static["rollout_s"], 3) if sticky and static else None
        best = best_of(rows, COLOCATED_BEST)
        row["static_vs_colocated_best"] = round(best["rollout_s"] / static["rollout_s"], 3) if best and static else None
        row["prorsa_switches"] = by["prorsa"]["role_switches"]
        out.append(row)
    return out


def mode_comparisons(results: list[dict]) -> list[dict]:
    """Per row and policy run in both modes: throughput (trained trajectories per model second
    of the whole loop) async against sync; ratios > 1 mean async is faster. The families
    (colocated, colocated-sticky, colocated-best, static) are each the best of their runs in that mode.
    `same_tasks` says whether both modes started the same trajectories per task family."""
    out = []
    for key in dict.fromkeys(_row_key(r) for r in results):
        rows = [r for r in results if _row_key(r) == key]
        sync = [r for r in rows if r.get("mode", "sync") == "sync"]
        async_ = [r for r in rows if r.get("mode") == "async"]
        if not sync or not async_:
            continue
        for name in ("colocated", "colocated-sticky", COLOCATED_BEST, "static", "prorsa"):
            s = best_of(sync, name, "run_s") if name != "prorsa" else next((r for r in sync if r["policy"] == "prorsa"), None)
            a = best_of(async_, name, "run_s") if name != "prorsa" else next((r for r in async_ if r["policy"] == "prorsa"), None)
            if s is None or a is None:
                continue
            out.append(
                {
                    **dict(zip((*ROW, "seed"), key)),
                    "policy": name,
                    "sync_policy": s["policy"],
                    "async_policy": a["policy"],
                    "sync_run_s": s["run_s"],
                    "async_run_s": a["run_s"],
                    "sync_throughput": s["throughput_per_s"],
                    "async_throughput": a["throughput_per_s"],
                    "async_vs_sync": round(a["throughput_per_s"] / s["throughput_per_s"], 3),
                    # False: the two modes rolled out different task families (not like for like)
                    "same_tasks": s.get("families") == a.get("families"),
                }
            )
    return out


SPREAD = {
    "vs_colocated-best": "colocated-best_s",
    "vs_colocated": "colocated_s",
    "vs_colocated-sticky": "colocated-sticky_s",
    "vs_static": "static_s",
    "of_oracle": "oracle_s",
}


def _median_range(ratios: list[float]) -> tuple[float, float, float]:
    """(median, lowest, highest) of ratios, each rounded to 3 places."""
    return round(statistics.median(ratios), 3), round(min(ratios), 3), round(max(ratios), 3)


def _ratio_spreads(runs: list[dict]) -> dict:
    """Each of prorsa's ratios (`SPREAD`) over `runs` as (median, lowest, highest), from the
    seconds rather than the rounded ratios; None where any run lacks that baseline."""
    out = {}
    for name, other in SPREAD.items():
        ratios = [c[other] / c["prorsa_s"] for c in runs if c.get(other) and c["prorsa_s"] > 0]
        out[name] = _median_range(ratios) if ratios and len(ratios) == len(runs) else None
    return out


def seed_spread(compared: list[dict]) -> list[dict]:
    """Per row and mode run at more than one workload seed: each of prorsa's ratios
    (`comparisons`) as its median over the seeds, with the lowest and the highest; and on how
    many seeds prorsa is at least as fast as that seed's best static split."""

    def key(c: dict) -> tuple:  # the row and mode, whatever the seed
        return (*(c[k] for k in ROW), c["mode"])

    out = []
    for row_key in dict.fromkeys(map(key, compared)):
        runs = [c for c in compared if key(c) == row_key]
        if len({c["seed"] for c in runs}) < 2:
            continue
        row = {**dict(zip((*ROW, "mode"), row_key)), "seeds": [c["seed"] for c in runs], **_ratio_spreads(runs)}
        row["static_at_least"] = sum(1 for c in runs if c["static_s"] >= c["prorsa_s"]) if row["vs_static"] else None
        out.append(row)
    return out


def fleet_summary(compared: list[dict], table: str = "main") -> list[dict]:
    """Per fleet and mode of `table`: each of prorsa's ratios over every workload and seed of
    that fleet (one ratio per row and seed) as (median, lowest, highest), with the workloads
    and seeds it covers, and which colocated-sticky runs were its colocated-best. The README's
    results table."""
    out = []
    runs_of = [c for c in compared if c["table"] == table]
    for fleet, mode in dict.fromkeys((c["fleet"], c["mode"]) for c in runs_of):
        runs = [c for c in runs_of if (c["fleet"], c["mode"]) == (fleet, mode)]
        workloads, seeds = list(dict.fromkeys(c["workload"] for c in runs)), list(dict.fromkeys(c["seed"] for c in runs))
        won = list(dict.fromkeys(c[f"best_{COLOCATED_BEST}"] for c in runs if c.get(f"best_{COLOCATED_BEST}")))
        out.append(
            {
                "table": table,
                "fleet": fleet,
                "mode": mode,
                "workloads": workloads,
                "seeds": seeds,
                **_ratio_spreads(runs),
                "colocated_best": won,
            }
        )
    return out


def _spread(x: tuple[float, float, float] | None) -> str:
    return f"{x[0]:.2f}x [{x[1]:.2f}–{x[2]:.2f}]" if x else "-"


ROW_HEADER, ROW_ALIGN = "| table | fleet | workload | traj/GPU | variant | ", "| --- | --- | --- | ---: | --- | "


def _row(r: dict) -> str:
    """The cells every table starts a row with: the row's `ROW` (under `ROW_HEADER`)."""
    return "| " + " | ".join(str(r[k]) for k in ROW) + " | "


def _section(caption: str, header: str, align: str) -> list[str]:
    """A table's lead-in: a blank line, its caption, a blank line, its header row and alignment
    row (each after the row's own columns, `ROW_HEADER`)."""
    return ["", caption, "", ROW_HEADER + header, ROW_ALIGN + align]


def _x(x: float | None) -> str:
    return f"{x:.3f}x" if x else "-"


def _s(x: float | None) -> str:
    return f"{x:.1f}" if x is not None else "-"


def critical_path_lines(results: list[dict], mode: Callable[[dict], str]) -> list[str]:
    """The table of what ends each row: its steps' last trajectories' time by what they were
    doing (`ops.critical_path`; records from before it are left out)."""
    rows = [r for r in results if r.get("critical_path_s")]
    if not rows:
        return []
    lines = _section(
        "what ends each row: the last trajectory of each step (async: of the run), its model s from the step's start by what it was doing, summed over the steps, together the rollout s (no arrangement changes the tool calls):",
        "mode | policy | rollout s | " + BUCKETS_HEADER,
        "--- | --- | ---: | " + BUCKETS_ALIGN,
    )
    for r in rows:
        cells = " | ".join(f"{r['critical_path_s'][b]:.1f}" for b in BUCKETS)
        lines.append(_row(r) + f"{mode(r)} | {r['policy']} | {r['rollout_s']:.1f} | {cells} |")
    return lines


def best_fixed(rows: list[dict]) -> dict | None:
    """The best fixed arrangement in hindsight: the faster of colocated-best and every static split."""
    picks = [r for r in (best_of(rows, COLOCATED_BEST), best_of(rows, "static")) if r]
    return min(picks, key=lambda r: r["rollout_s"], default=None)


def _learned_errors(r: dict | None) -> dict[str, float]:
    """Each capacity figure the run priced with at its first step's end, against the truth's:
    learned / truth - 1."""
    figures = ((r or {}).get("learned") or {}).get("figures", {})
    return {name: learned / truth - 1.0 for name, (learned, truth) in figures.items() if truth}


MISMATCH_FIGURES = (
    ("prefill_s_per_token", "prefill"),
    ("colocated_prefill_s_per_token", "colocated prefill"),
    ("decode_kv_step_s", "decode step"),
)


def _error_cell(measured: float | None, model: float | None) -> str:
    if measured is None:
        return "-"
    return f"{measured:+.1%}" + (f" / {model:+.1%}" if model is not None else "")


MISMATCH_SPREAD = ("vs best fixed", "+model vs best fixed", "measured over model", "of oracle")


def _mismatch_case(rows: list[dict]) -> dict | None:
    """One mismatch row at one seed: prorsa's run (measured), prorsa+model's, the best fixed
    arrangement, prorsa's ratios `MISMATCH_SPREAD` from the seconds (None where a run is
    missing), and the capacity errors each pricing had at the first step's end; None without
    a prorsa run."""
    by = {r["policy"]: r for r in rows}
    measured, model, oracle, fixed = by.get("prorsa"), by.get("prorsa+model"), by.get("oracle"), best_fixed(rows)
    if measured is None:
        return None

    def over(base: dict | None, run: dict | None) -> float | None:
        return base["rollout_s"] / run["rollout_s"] if base and run and base["rollout_s"] and run["rollout_s"] > 0 else None

    ratios = (over(fixed, measured), over(fixed, model), over(model, measured), over(oracle, measured))
    return {"measured": measured, "fixed": fixed, **dict(zip(MISMATCH_SPREAD, ratios))} | {
        "errors": _learned_errors(measured),
        "model errors": _learned_errors(model),
    }


def _x3(ratio: float | None) -> str:
    return _x(round(ratio, 3) if ratio is not None else None)


def mismatch_lines(results: list[dict]) -> list[str]:
    """The mismatch table: per row (engines whose truth differs from their prior), prorsa priced
    by measurement and by the cost model alone against the best fixed arrangement in hindsight
    and oracle (given the truth), and how far each priced the engines from the truth at the
    end of the first step."""
    keys = [k for k in dict.fromkeys(_case_key(r) for r in results) if k[0] == "mismatch"]
    if not keys:
        return []
    lines = _section(
        "engines unlike their prior (mismatch): prorsa with measured capacities and priced by the cost model alone (+model), against the best fixed arrangement in hindsight "
        "(the faster of colocated-best and every static split) and oracle (given the truth), ratio > 1: prorsa faster; capacity error: what it priced with at the first step's end over the truth, measured / model:",
        "mode | best fixed | prorsa s | vs best fixed | +model vs best fixed | measured over model | of oracle | "
        + " | ".join(f"{label} error" for _, label in MISMATCH_FIGURES)
        + " |",
        "--- | --- | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in MISMATCH_FIGURES) + " |",
    )
    for key in keys:
        case = _mismatch_case([r for r in results if _case_key(r) == key])
        if case is None:
            continue
        fixed = case["fixed"]
        errors = [_error_cell(case["errors"].get(n), case["model errors"].get(n)) for n, _ in MISMATCH_FIGURES]
        seed = f", seed {key[5]}" if key[5] is not None else ""
        lines.append(
            _row(case["measured"])
            + f"{key[6]}{seed} | {_s(fixed['rollout_s'] if fixed else None)} ({fixed['policy'] if fixed else '-'}) | {case['measured']['rollout_s']:.1f} | "
            + " | ".join(_x3(case[name]) for name in MISMATCH_SPREAD)
            + " | "
            + " | ".join(errors)
            + " |"
        )
    return lines


def mismatch_spread_lines(results: list[dict]) -> list[str]:
    """The mismatch table across workload seeds: per row and mode run at more than one seed,
    each of prorsa's ratios as median [lowest-highest] over the seeds (those with every run),
    on how many seeds it is at least 0.98x the seed's best fixed arrangement, and each
    capacity error at the first step's end (measured) as median [lowest-highest]."""
    keys = [k for k in dict.fromkeys(_case_key(r) for r in results) if k[0] == "mismatch"]
    rows: dict[tuple, list[tuple[int, dict]]] = {}
    for key in keys:
        case = _mismatch_case([r for r in results if _case_key(r) == key])
        if case is not None and all(case[name] is not None for name in MISMATCH_SPREAD):
            rows.setdefault((*key[:5], key[6]), []).append((key[5], case))
    rows = {k: v for k, v in rows.items() if len(v) > 1}
    if not rows:
        return []
    lines = _section(
        "engines unlike their prior, across workload seeds: each ratio's median over the seeds [lowest-highest] (ratio > 1: prorsa faster); "
        "at least 0.98x: seeds where prorsa is at least 0.98x that seed's best fixed arrangement; capacity errors measured, at the first step's end:",
        "mode | seeds | "
        + " | ".join(MISMATCH_SPREAD)
        + " | at least 0.98x | "
        + " | ".join(f"{label} error" for _, label in MISMATCH_FIGURES)
        + " |",
        "--- | --- | " + " | ".join("---:" for _ in MISMATCH_SPREAD) + " | ---: | " + " | ".join("---:" for _ in MISMATCH_FIGURES) + " |",
    )
    for (*row, mode), seeded in rows.items():
        seeds, runs = [s for s, _ in seeded], [r for _, r in seeded]
        cells = [_spread(_median_range([r[name] for r in runs])) for name in MISMATCH_SPREAD]
        at_least = sum(1 for r in runs if r["vs best fixed"] >= 0.98)
        spreads = [
            _median_range([r["errors"][n] for r in runs]) if all(n in r["errors"] for r in runs) else None for n, _ in MISMATCH_FIGURES
        ]
        error_cells = [f"{x[0]:+.1%} [{x[1]:+.1%}–{x[2]:+.1%}]" if x else "-" for x in spreads]
        lines.append(
            "| "
            + " | ".join(map(str, row))
            + f" | {mode} | {', '.join(map(str, seeds))} | "
            + " | ".join(cells)
            + f" | {at_least} of {len(runs)} | "
            + " | ".join(error_cells)
            + " |"
        )
    return lines


def fleet_lines(compared: list[dict]) -> list[str]:
    """The per-fleet table of the main table's rows (`fleet_summary`), the README's results."""
    summary = fleet_summary(compared)
    if not summary:
        return []
    lines = [
        "",
        "prorsa per fleet (main table), headline vs colocated-best (the fastest colocated-sticky run of each row: any layout, PrefillDelayer on or off; "
        "colocated (naive): the seed's baseline): each ratio's median over every workload and seed [lowest-highest] (ratio > 1: prorsa faster):",
        "",
        "| fleet | mode | workloads | seeds | vs colocated-best | colocated-best runs | vs colocated (naive) | vs colocated-sticky | vs best static | of oracle |",
        "| --- | --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for f in summary:
        lines.append(
            f"| {f['fleet']} | {f['mode']} | {', '.join(f['workloads'])} | {', '.join(map(str, f['seeds']))} | "
            f"{_spread(f['vs_colocated-best'])} | {', '.join(f['colocated_best']) or '-'} | {_spread(f['vs_colocated'])} | "
            f"{_spread(f['vs_colocated-sticky'])} | {_spread(f['vs_static'])} | {_spread(f['of_oracle'])} |"
        )
    return lines


def results_markdown(results: list[dict]) -> str:
    seeded = len({r.get("seed") for r in results}) > 1  # several workload seeds: say each row's

    def mode(r: dict) -> str:
        return f"{r.get('mode', 'sync')}, seed {r.get('seed')}" if seeded else r.get("mode", "sync")

    best = colocated_best_s(results)  # from the runs themselves: records from before it have no field for it
    lines = [
        ROW_HEADER
        + "mode | policy | rollout s | run s | traj | traj / s | vs colocated (naive) | vs colocated-best | switches | p50 traj s | p99 traj s | rollout / bound |",
        ROW_ALIGN + "--- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        bound = r["rollout_s"] / r["lower_bound_s"] if r["lower_bound_s"] else float("nan")
        lines.append(
            _row(r) + f"{mode(r)} | "
            f"{r['policy']} | {r['rollout_s']:.1f} | {_s(r.get('run_s'))} | {r.get('trajectories', '-')} | "
            f"{r['throughput_per_s'] if r.get('throughput_per_s') else '-'} | {_x(r['speedup_vs_colocated'])} | "
            f"{_x(_ratio(best.get(_case_key(r)), r['rollout_s']))} | {r['role_switches']} | "
            f"{r['p50_traj_s']:.1f} | {r['p99_traj_s']:.1f} | {bound:.2f} |"
        )
    lines += _section(
        "prorsa against the others, per mode, by rollout s (ratio > 1: prorsa faster; colocated (naive) and colocated-sticky: the better layout; "
        "colocated-best: the fastest colocated-sticky run, any layout, PrefillDelayer on or off, the headline baseline):",
        "mode | colocated (naive) | colocated-sticky | colocated-best | best static | prorsa | oracle | vs colocated-best | vs colocated (naive) | "
        "vs colocated-sticky | vs best static | best static vs sticky | best static vs colocated-best | vs reactive | of oracle | prorsa switches |",
        "--- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    )
    compared = comparisons(results)
    for c in compared:
        won = f" ({c['best_colocated-best']})" if c["best_colocated-best"] else ""
        lines.append(
            _row(c) + f"{mode(c)} | "
            f"{_s(c['colocated_s'])} | {_s(c['colocated-sticky_s'])} | {_s(c['colocated-best_s'])}{won} | "
            f"{_s(c['static_s'])} ({c['best_static']}) | {_s(c['prorsa_s'])} | {_s(c['oracle_s'])} | "
            f"{_x(c['vs_colocated-best'])} | {_x(c['vs_colocated'])} | {_x(c['vs_colocated-sticky'])} | {_x(c['vs_static'])} | "
            f"{_x(c['static_vs_sticky'])} | {_x(c['static_vs_colocated_best'])} | {_x(c['vs_reactive'])} | {_x(c['of_oracle'])} | "
            f"{c['prorsa_switches']} |"
        )
    spread = seed_spread(compared)
    if spread:
        lines += _section(
            "prorsa across workload seeds: each ratio's median over the seeds [lowest-highest]; best static: each seed's own, in hindsight:",
            "mode | seeds | vs colocated-best | vs colocated (naive) | vs colocated-sticky | vs best static | at least best static | of oracle |",
            "--- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        )
        for c in spread:
            at_least = f"{c['static_at_least']} of {len(c['seeds'])}" if c["static_at_least"] is not None else "-"
            lines.append(
                _row(c) + f"{c['mode']} | "
                f"{', '.join(map(str, c['seeds']))} | {_spread(c['vs_colocated-best'])} | {_spread(c['vs_colocated'])} | "
                f"{_spread(c['vs_colocated-sticky'])} | "
                f"{_spread(c['vs_static'])} | {at_least} | {_spread(c['of_oracle'])} |"
            )
    lines += fleet_lines(compared)
    lines += mismatch_lines(results)
    lines += mismatch_spread_lines(results)
    lines += critical_path_lines(results, mode)
    modes = mode_comparisons(results)
    if modes:
        lines += _section(
            "async against sync: trained trajectories per model second of the whole loop (first assignment to the last policy published; ratio > 1: async faster; each family the best of its runs in that mode; (other tasks): the modes rolled out different task families):",
            "policy | sync run s | async run s | sync traj/s | async traj/s | async vs sync |",
            "--- | ---: | ---: | ---: | ---: | ---: |",
        )
        for m in modes:
            name = m["policy"] if m["sync_policy"] == m["async_policy"] else f"{m['policy']} ({m['sync_policy']} / {m['async_policy']})"
            name = f"{name}, seed {m['seed']}" if seeded else name
            lines.append(
                _row(m) + f"{name} | "
                f"{m['sync_run_s']:.1f} | {m['async_run_s']:.1f} | {m['sync_throughput']:.4f} | {m['async_throughput']:.4f} | "
                f"{_x(m['async_vs_sync'])}{'' if m['same_tasks'] else ' (other tasks)'} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Merge the results.json of several bench folders (e.g. one per workload seed) and write
    their tables: `python -m runners.rollout_tables DIR [DIR ...] --out DIR`."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m runners.rollout_tables", description=main.__doc__)
    parser.add_argument("folders", type=Path, nargs="+", help="rollout bench output folders (each with a results.json)")
    parser.add_argument("--out", type=Path, required=True, help="where to write the merged results.json and results.md")
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.folders if not (f / "results.json").is_file()]
    if missing:
        print(f"no results.json in {', '.join(missing)}")
        return 2
    results = [r for f in args.folders for r in json.loads((f / "results.json").read_text())]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "results.md").write_text(results_markdown(results))
    print(f"wrote {args.out / 'results.md'} ({len(results)} runs from {len(args.folders)} folders)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
