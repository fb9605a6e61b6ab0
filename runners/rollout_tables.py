"""The rollout bench's tables (pure): speedups against colocated, prorsa against the best of
each baseline family per row, and the markdown the bench writes (runners/rollout.py)."""

from __future__ import annotations


def _case_key(r: dict) -> tuple:
    return (r["table"], r["fleet"], r["workload"], r["trajectories_per_gpu"], r["variant"])


def add_speedups(results: list[dict]) -> None:
    base = {_case_key(r): r["rollout_s"] for r in results if r["policy"] == "colocated"}
    for r in results:
        b = base.get(_case_key(r))
        r["speedup_vs_colocated"] = round(b / r["rollout_s"], 3) if b and r["rollout_s"] > 0 else None


def best_of(rows: list[dict], family: str) -> dict | None:
    """The fastest run of a policy family: `static` (any split) or a colocated baseline in any layout."""
    if family == "static":
        pick = [r for r in rows if r["policy"].startswith("static-")]
    else:
        pick = [r for r in rows if r["policy"].split("@")[0] == family]
    return min(pick, key=lambda r: r["rollout_s"], default=None)


def comparisons(results: list[dict]) -> list[dict]:
    """Per case: prorsa against the best colocated, colocated-sticky (either layout), the best
    static split (hindsight) and oracle; ratios > 1 mean prorsa is faster."""
    out = []
    for key in dict.fromkeys(_case_key(r) for r in results):
        rows = [r for r in results if _case_key(r) == key]
        by = {r["policy"]: r for r in rows}
        if "prorsa" not in by:
            continue
        p = by["prorsa"]["rollout_s"]
        row = dict(zip(("table", "fleet", "workload", "trajectories_per_gpu", "variant"), key))
        row["prorsa_s"] = p
        for family in ("colocated", "colocated-sticky", "static"):
            best = best_of(rows, family)
            row[f"vs_{family}"] = round(best["rollout_s"] / p, 3) if best else None
            row[f"best_{family}"] = best["policy"] if best else None
        row["vs_reactive"] = round(by["reactive"]["rollout_s"] / p, 3) if "reactive" in by else None
        row["of_oracle"] = round(by["oracle"]["rollout_s"] / p, 3) if "oracle" in by else None
        sticky, static = best_of(rows, "colocated-sticky"), best_of(rows, "static")
        row["static_vs_sticky"] = round(sticky["rollout_s"] / static["rollout_s"], 3) if sticky and static else None
        row["prorsa_switches"] = by["prorsa"]["role_switches"]
        out.append(row)
    return out


def results_markdown(results: list[dict]) -> str:
    lines = [
        "| table | fleet | workload | traj/GPU | variant | policy | rollout s | vs colocated | switches | p50 traj s | p99 traj s | rollout / bound |",
        "| --- | --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        bound = r["rollout_s"] / r["lower_bound_s"] if r["lower_bound_s"] else float("nan")
        speedup = f"{r['speedup_vs_colocated']:.3f}x" if r["speedup_vs_colocated"] else "-"
        lines.append(
            f"| {r['table']} | {r['fleet']} | {r['workload']} | {r['trajectories_per_gpu']} | {r['variant']} | {r['policy']} | "
            f"{r['rollout_s']:.1f} | {speedup} | {r['role_switches']} | {r['p50_traj_s']:.1f} | {r['p99_traj_s']:.1f} | {bound:.2f} |"
        )
    lines += ["", "prorsa against the others (ratio > 1: prorsa faster; colocated baselines: the better layout):", "",
              "| table | fleet | workload | traj/GPU | variant | vs colocated | vs colocated-sticky | vs best static | best static vs sticky | vs reactive | of oracle | prorsa switches |",
              "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip

    def cell(x: float | None) -> str:
        return f"{x:.3f}x" if x else "-"

    for c in comparisons(results):
        lines.append(
            f"| {c['table']} | {c['fleet']} | {c['workload']} | {c['trajectories_per_gpu']} | {c['variant']} | {cell(c['vs_colocated'])} | "
            f"{cell(c['vs_colocated-sticky'])} | {cell(c['vs_static'])} ({c['best_static']}) | {cell(c['static_vs_sticky'])} | "
            f"{cell(c['vs_reactive'])} | {cell(c['of_oracle'])} | {c['prorsa_switches']} |"
        )
    return "\n".join(lines) + "\n"
