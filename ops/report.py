"""A finished run as pictures and a short report.

    python -m ops.report RUN_DIR [--out DIR]

Reads `RUN_DIR/events.parquet` and `RUN_DIR/summary.json` (what `ops.launch` and
`runners.simulate` write), and `forecasts.parquet` and `config.json` where the run has
them, and writes into `RUN_DIR/report/` (or `--out`):

* `roles.png`: engines per role over time, against prefill demand (tokens/s) and decode
  demand (sequences decoding), each with the forecast where the run recorded one;
* `completion_cdf.png`: the trajectory completion-time CDF, from each trajectory's start
  and from its step's start (the rollout's tail), per task family;
* `step_times.png`: rollout (and training) time per RL step;
* `report.md` and `report.html`: the figures with the run's numbers, and what ended each
  step: its last trajectory's time by what it was doing (`ops.critical_path`).

`plot_roles` is the plotting code for any run folder (the rollout bench's timelines can
call it with their own title).
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import polars as pl

from bus_schemas.eventlog import EventLogError, load_events
from forecasting.series import bin_events, totals
from ops.critical_path import critical_paths, markdown_lines

BIN_S = 1.0
SMOOTH_BINS = 5
FORECAST_HORIZON_S = 5.0
ROLE_COLORS = {"prefill": "tab:orange", "decode": "tab:blue", "colocated": "tab:gray"}
FIGURES = ("roles.png", "completion_cdf.png", "step_times.png")
_ENGINE_KINDS = ("prefill_started", "prefill_done", "decode_queued", "kv_transfer_done", "decode_started", "decode_done", "decode_migrated")
_DYNAMIC_OR_COLOCATED = ("colocated", "colocated-sticky", "reactive", "prorsa", "oracle")


class ReportError(ValueError):
    """A run folder the report cannot use; the message says why in one line."""


# --- reading ---------------------------------------------------------------------------------
def read_run(run_dir: Path) -> tuple[pl.DataFrame, dict, pl.DataFrame | None]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir}: no such run folder")
    try:
        events = load_events(run_dir / "events.parquet")
    except EventLogError as err:
        raise ReportError(str(err)) from None
    if events.height == 0:
        raise ReportError(f"{run_dir / 'events.parquet'}: the log is empty")
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except FileNotFoundError:
        raise ReportError(f"{run_dir / 'summary.json'}: no such file (is the run finished?)") from None
    except ValueError as err:
        raise ReportError(f"{run_dir / 'summary.json'}: not JSON: {err}") from None
    forecasts = None
    if (run_dir / "forecasts.parquet").exists():
        forecasts = pl.read_parquet(run_dir / "forecasts.parquet")
    return events, summary, forecasts


def initial_roles(run_dir: Path, events: pl.DataFrame, policy: str = "") -> dict[str, str]:
    """Each engine's role at the start: from the run's config.json where it has one, else
    from the log (the role an engine stamps on its first turn event before any switch; an
    engine that switched before serving anything is taken to have started colocated under a
    dynamic or colocated policy, which holds unless `allocator.start_prefill_engines` was set)."""
    config_path = Path(run_dir) / "config.json"
    if config_path.exists():
        from actors.config import ConfigError, load_config
        from actors.config import initial_roles as config_roles

        try:
            return {e: r.value for e, r in config_roles(load_config(config_path)).items()}
        except ConfigError:
            pass
    roles: dict[str, str] = {}
    engine_events = events.filter((pl.col("engine_id") != "") & (pl.col("role") != "")).sort("at_s")
    first_switch = {
        r["engine_id"]: r["at_s"]
        for r in engine_events.filter(pl.col("kind") == "role_switched")
        .group_by("engine_id")
        .agg(pl.col("at_s").min())
        .iter_rows(named=True)
    }
    own = engine_events.filter(pl.col("kind").is_in(_ENGINE_KINDS) & (pl.col("actor_id") == pl.col("engine_id")))
    for row in own.group_by("engine_id").agg(pl.col("at_s").first(), pl.col("role").first()).iter_rows(named=True):
        if row["at_s"] < first_switch.get(row["engine_id"], float("inf")):
            roles[row["engine_id"]] = row["role"]
    base = policy.split("-")[0] if policy.startswith("static-") else policy
    for engine_id in first_switch:
        roles.setdefault(engine_id, "colocated" if base in _DYNAMIC_OR_COLOCATED else "")
    return {e: r for e, r in sorted(roles.items()) if r}


def role_counts(initial: dict[str, str], events: pl.DataFrame, start_s: float, end_s: float) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Engines per role over time, a point per role change."""
    roles = dict(initial)
    times, counts = [start_s], {r: [sum(v == r for v in roles.values())] for r in ROLE_COLORS}
    for row in events.filter(pl.col("kind") == "role_switched").sort("at_s").iter_rows(named=True):
        roles[row["engine_id"]] = row["role"]
        times.append(row["at_s"])
        for r in counts:
            counts[r].append(sum(v == r for v in roles.values()))
    times.append(end_s)
    for r in counts:
        counts[r].append(counts[r][-1])
    return np.array(times), {r: np.array(c) for r, c in counts.items()}


def _smooth(values: list[float]) -> np.ndarray:
    kernel = np.ones(SMOOTH_BINS) / SMOOTH_BINS
    return np.convolve(np.asarray(values, dtype=float), kernel, mode="same")


# --- figures ---------------------------------------------------------------------------------
def plot_roles(events: pl.DataFrame, initial: dict[str, str], png: Path, title: str, forecasts: pl.DataFrame | None = None) -> Path:
    """Engines per role (top), prefill demand in tokens/s (middle), decoding sequences
    (bottom), each demand with the forecast `FORECAST_HORIZON_S` ahead placed at the time
    it forecast; dashed lines: RL step starts."""
    series = bin_events(events, BIN_S)
    t = np.arange(len(totals(series, "prefill_miss_tokens"))) * BIN_S
    start_s = float(events["at_s"].min())
    end_s = float(t[-1]) if len(t) else start_s
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    times, counts = role_counts(initial, events, start_s, end_s)
    for role, color in ROLE_COLORS.items():
        if counts[role].any():
            axes[0].step(times, counts[role], where="post", label=role, color=color)
    axes[0].set_ylabel("engines")
    axes[0].yaxis.get_major_locator().set_params(integer=True)
    axes[0].legend(loc="upper right")
    axes[1].plot(
        t,
        _smooth(totals(series, "prefill_miss_tokens")) / BIN_S,
        label=f"prefill tokens/s (actual, {SMOOTH_BINS} s mean)",
        color="tab:orange",
    )
    axes[2].plot(t, totals(series, "decode_active_seqs"), label="decoding sequences (actual)", color="tab:blue")
    if forecasts is not None and forecasts.height:
        f = forecasts.filter(pl.col("horizon_s") == FORECAST_HORIZON_S)
        for ax, target, per_s in ((axes[1], "prefill_miss_tokens", True), (axes[2], "decode_active_seqs", False)):
            rows = f.filter(pl.col("target") == target).sort("as_of_s")
            x = rows["as_of_s"].to_numpy() + FORECAST_HORIZON_S
            y = rows["mean"].to_numpy() / (rows["bin_s"].to_numpy() if per_s else 1.0)
            ax.plot(x, y, label=f"forecast, {FORECAST_HORIZON_S:.0f} s ahead", color="black", linewidth=0.8, alpha=0.7)
    for ax, label in ((axes[1], "tokens/s"), (axes[2], "sequences")):
        ax.set_ylabel(label)
        ax.legend(loc="upper right")
    for ax in axes:
        for s in events.filter(pl.col("kind") == "step_started")["at_s"].to_list():
            ax.axvline(s, color="green", linewidth=0.6, linestyle="--")
        ax.set_xlim(max(0.0, start_s - BIN_S), end_s)
    axes[-1].set_xlabel("model time (s); dashed: RL step starts")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def completion_times(events: pl.DataFrame) -> pl.DataFrame:
    """Per finished trajectory: its family, step, seconds from its (last) start and from its step's start to its finish."""
    started = events.filter(pl.col("kind") == "started").group_by("trajectory_id").agg(pl.col("at_s").max().alias("started_s"))
    finished = (
        events.filter(pl.col("kind") == "finished")
        .group_by("trajectory_id")
        .agg(pl.col("at_s").min().alias("finished_s"), pl.col("task_family").first(), pl.col("step").first())
    )
    steps = events.filter(pl.col("kind") == "step_started").group_by("step").agg(pl.col("at_s").min().alias("step_s"))
    out = finished.join(started, on="trajectory_id", how="left").join(steps, on="step", how="left")
    return out.with_columns(
        (pl.col("finished_s") - pl.col("started_s")).alias("completion_s"),
        (pl.col("finished_s") - pl.col("step_s")).alias("since_step_s"),
    ).sort("trajectory_id")


def _cdf(ax, values: np.ndarray, label: str, **kw) -> None:
    values = np.sort(values[~np.isnan(values)])
    if len(values):
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=f"{label} (n={len(values)})", **kw)


def plot_completion_cdf(times: pl.DataFrame, png: Path, title: str) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, column, xlabel in (
        (axes[0], "completion_s", "trajectory completion time, from its start (model s)"),
        (axes[1], "since_step_s", "finish time, from its RL step's start (model s)"),
    ):
        _cdf(ax, times[column].cast(pl.Float64).fill_null(float("nan")).to_numpy(), "all", color="black", linewidth=1.6)
        for family in sorted(set(times["task_family"].to_list())):
            rows = times.filter(pl.col("task_family") == family)
            _cdf(ax, rows[column].cast(pl.Float64).fill_null(float("nan")).to_numpy(), family, linewidth=1.0)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    axes[0].set_ylabel("share of trajectories")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def step_times(events: pl.DataFrame, summary: dict) -> list[dict]:
    """Per step: rollout_s and train_s from the summary, else from the log's step events."""
    if summary.get("steps"):
        return [
            {
                "step": s["step"],
                "rollout_s": float(s["rollout_s"]),
                "train_s": float(s.get("train_s", 0.0)),
                "mean_reward": s.get("mean_reward"),
            }
            for s in summary["steps"]
        ]
    starts = events.filter(pl.col("kind") == "step_started").group_by("step").agg(pl.col("at_s").min().alias("a"))
    dones = events.filter(pl.col("kind") == "rollout_done").group_by("step").agg(pl.col("at_s").max().alias("b"))
    rows = starts.join(dones, on="step").sort("step")
    return [{"step": r["step"], "rollout_s": r["b"] - r["a"], "train_s": 0.0, "mean_reward": None} for r in rows.iter_rows(named=True)]


def plot_step_times(steps: list[dict], png: Path, title: str) -> Path:
    fig, ax = plt.subplots(figsize=(max(5.0, 1.0 + 0.6 * len(steps)), 4.0))
    x = np.array([s["step"] for s in steps])
    rollout = np.array([s["rollout_s"] for s in steps])
    train = np.array([s["train_s"] for s in steps])
    ax.bar(x, rollout, color="tab:purple", label="rollout")
    if train.any():
        ax.bar(x, train, bottom=rollout, color="tab:olive", alpha=0.6, label="training")
    for xi, r, tr in zip(x, rollout, train):
        ax.annotate(f"{r:.1f} s", (xi, r + tr), ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xlabel("RL step")
    ax.set_ylabel("model seconds")
    ax.set_xticks(x)
    ax.set_ylim(0, max(1e-9, float((rollout + train).max())) * 1.25)
    ax.legend(loc="upper left", ncols=2, frameon=False)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


# --- the report ------------------------------------------------------------------------------
def _pct(values: np.ndarray, q: float) -> float | None:
    values = values[~np.isnan(values)]
    return float(np.percentile(values, q)) if len(values) else None


def facts(events: pl.DataFrame, summary: dict, times: pl.DataFrame, steps: list[dict]) -> dict:
    """The report's figures (also written as report.json)."""
    completion = times["completion_s"].cast(pl.Float64).fill_null(float("nan")).to_numpy()
    switches = events.filter(pl.col("kind") == "role_switched")
    return {
        "policy": summary.get("policy", "?"),
        "backend": summary.get("backend", "?"),
        "status": summary.get("status", "?"),
        "trajectories_finished": summary.get("trajectories_finished", times.height),
        "trajectories_expected": summary.get("trajectories_expected"),
        "trajectories_lost": summary.get("trajectories_lost"),
        "invalid_messages": summary.get("invalid_messages"),
        "events": events.height,
        "wall_s": summary.get("wall_s"),
        "time_scale": summary.get("time_scale"),
        "role_switches": switches.height,
        "switch_cost_s": round(float(switches["duration_s"].sum()), 3) if switches.height else 0.0,
        "completion_p50_s": _pct(completion, 50),
        "completion_p90_s": _pct(completion, 90),
        "completion_p99_s": _pct(completion, 99),
        "rollout_s_total": round(sum(s["rollout_s"] for s in steps), 3),
        "steps": steps,
        "critical_paths": critical_paths(events, summary.get("mode", "sync")),
    }


def _fmt(x, nd: int = 1) -> str:
    return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def write_markdown(f: dict, title: str, path: Path, forecasts_note: str) -> Path:
    lines = [
        f"# {title}",
        "",
        f"{f['status']}: policy `{f['policy']}`, backend `{f['backend']}`; {f['trajectories_finished']}/{_fmt(f['trajectories_expected'])} "
        f"trajectories finished ({_fmt(f['trajectories_lost'])} lost), {f['events']} lifecycle events, "
        f"{_fmt(f['invalid_messages'])} malformed messages; {_fmt(f['wall_s'], 2)} s wall at {_fmt(f['time_scale'], 0)}x.",
        "",
        f"Role switches: {f['role_switches']} ({f['switch_cost_s']:.2f} model s spent switching). "
        f"Trajectory completion time p50 {_fmt(f['completion_p50_s'])} s, p90 {_fmt(f['completion_p90_s'])} s, "
        f"p99 {_fmt(f['completion_p99_s'])} s; rollout {f['rollout_s_total']:.1f} s over {len(f['steps'])} steps (model time).",
        "",
        "| step | rollout (s) | training (s) | mean reward |",
        "| ---: | ---: | ---: | ---: |",
        *(f"| {s['step']} | {s['rollout_s']:.1f} | {s['train_s']:.1f} | {_fmt(s['mean_reward'], 3)} |" for s in f["steps"]),
        "",
        *markdown_lines(f["critical_paths"]),
        "## Engine roles against demand and forecast",
        "",
        "![roles](roles.png)",
        "",
        forecasts_note,
        "",
        "## Trajectory completion time",
        "",
        "![completion CDF](completion_cdf.png)",
        "",
        "## Rollout time per step",
        "",
        "![step times](step_times.png)",
        "",
    ]
    path.write_text("\n".join(lines))
    return path


def write_html(markdown_path: Path, path: Path, title: str) -> Path:
    """The markdown as a small self-contained page (images referenced next to it)."""
    body = []
    table: list[str] = []

    def flush_table() -> None:
        if table:
            rows = [r.strip("|").split("|") for r in table if not set(r.replace("|", "").strip()) <= {"-", ":", " "}]
            head, *rest = rows
            body.append("<table><tr>" + "".join(f"<th>{html.escape(c.strip())}</th>" for c in head) + "</tr>")
            body.extend("<tr>" + "".join(f"<td>{html.escape(c.strip())}</td>" for c in r) + "</tr>" for r in rest)
            body.append("</table>")
            table.clear()

    for line in markdown_path.read_text().splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        flush_table()
        if line.startswith("# "):
            body.append(f"<h1>{html.escape(line[2:])}</h1>")
        elif line.startswith("## "):
            body.append(f"<h2>{html.escape(line[3:])}</h2>")
        elif line.startswith("!["):
            alt, src = line[2:].split("](", 1)
            body.append(f'<p><img src="{html.escape(src.rstrip(")"))}" alt="{html.escape(alt)}" style="max-width:100%"></p>')
        elif line.strip():
            body.append(f"<p>{html.escape(line).replace('`', '')}</p>")
    flush_table()
    style = "body{font-family:sans-serif;max-width:1100px;margin:2em auto}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}"
    path.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>{style}</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )
    return path


def report(run_dir: Path, out: Path | None = None) -> dict:
    """Write the figures and the report; return {name: path} of what was written."""
    run_dir = Path(run_dir)
    events, summary, forecasts = read_run(run_dir)
    out = Path(out) if out is not None else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    title = f"{run_dir.name}: {summary.get('policy', '?')} on {summary.get('backend', '?')}"
    initial = initial_roles(run_dir, events, summary.get("policy", ""))
    times = completion_times(events)
    steps = step_times(events, summary)
    written = {
        "roles.png": plot_roles(events, initial, out / "roles.png", title, forecasts),
        "completion_cdf.png": plot_completion_cdf(times, out / "completion_cdf.png", title),
        "step_times.png": plot_step_times(steps, out / "step_times.png", title),
    }
    note = (
        f"Forecast: the forecaster's {FORECAST_HORIZON_S:.0f} s-ahead mean, from `forecasts.parquet`."
        if forecasts is not None
        else "No forecast line: this run folder has no `forecasts.parquet` (`runners.simulate` records one)."
    )
    f = facts(events, summary, times, steps)
    written["report.md"] = write_markdown(f, title, out / "report.md", note)
    written["report.html"] = write_html(out / "report.md", out / "report.html", title)
    (out / "report.json").write_text(json.dumps(f, indent=2) + "\n")
    written["report.json"] = out / "report.json"
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, help="where to write (default RUN_DIR/report)")
    args = parser.parse_args(argv)
    try:
        written = report(args.run_dir, args.out)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    folder = next(iter(written.values())).parent
    print(f"wrote {', '.join(written)} to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
