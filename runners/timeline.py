"""Timeline PNGs of the rollout bench: engine roles over time against demand and forecast.

One PNG per workload (the first fleet's `prorsa` run): engines per role (top), prefill
demand in tokens/s (middle) and decoding sequences (bottom), each with the forecast the
allocator acted on (the 5 s horizon, placed at the time it forecast).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import polars as pl  # noqa: E402

from forecasting.series import bin_events, totals  # noqa: E402
from ops.export import load_events  # noqa: E402

BIN_S = 1.0
SMOOTH_BINS = 5
FORECAST_HORIZON_S = 5.0


def role_counts(initial: dict[str, str], events: pl.DataFrame, end_s: float) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Engines per role over time, a point per role change."""
    roles = dict(initial)
    times, counts = [0.0], {r: [sum(v == r for v in roles.values())] for r in ("prefill", "decode", "colocated")}
    switches = events.filter(pl.col("kind") == "role_switched").sort("at_s")
    for row in switches.iter_rows(named=True):
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


def plot_run(run_dir: Path, initial: dict[str, str], title: str, png: Path) -> None:
    events = load_events(run_dir / "events.parquet")
    series = bin_events(events, BIN_S)
    t = np.arange(len(totals(series, "prefill_miss_tokens"))) * BIN_S
    end_s = float(t[-1]) if len(t) else 0.0
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    times, counts = role_counts(initial, events, end_s)
    for role, color in (("prefill", "tab:orange"), ("decode", "tab:blue"), ("colocated", "tab:gray")):
        if counts[role].any():
            axes[0].step(times, counts[role], where="post", label=role, color=color)
    axes[0].set_ylabel("engines")
    axes[0].legend(loc="upper right")
    axes[1].plot(t, _smooth(totals(series, "prefill_miss_tokens")) / BIN_S, label="prefill tokens/s (actual, 5 s mean)", color="tab:orange")
    axes[2].plot(t, totals(series, "decode_active_seqs"), label="decoding sequences (actual)", color="tab:blue")
    forecasts_path = run_dir / "forecasts.parquet"
    if forecasts_path.exists():
        f = pl.read_parquet(forecasts_path).filter(pl.col("horizon_s") == FORECAST_HORIZON_S)
        for ax, target, scale in ((axes[1], "prefill_miss_tokens", True), (axes[2], "decode_active_seqs", False)):
            rows = f.filter(pl.col("target") == target).sort("as_of_s")
            x = rows["as_of_s"].to_numpy() + FORECAST_HORIZON_S
            y = rows["mean"].to_numpy() / (rows["bin_s"].to_numpy() if scale else 1.0)
            ax.plot(x, y, label=f"forecast, {FORECAST_HORIZON_S:.0f} s ahead", color="black", linewidth=0.8, alpha=0.7)
    for ax, label in ((axes[1], "tokens/s"), (axes[2], "sequences")):
        ax.set_ylabel(label)
        ax.legend(loc="upper right")
    steps = events.filter(pl.col("kind") == "step_started")["at_s"].to_list()
    for ax in axes:
        for s in steps:
            ax.axvline(s, color="green", linewidth=0.6, linestyle="--")
    axes[-1].set_xlabel("model time (s); dashed: RL step starts")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def plot_timelines(results: list[dict], out: Path) -> list[Path]:
    written = []
    fleets = list(dict.fromkeys(r["fleet"] for r in results))
    for r in results:
        if r["policy"] != "prorsa" or r["fleet"] != fleets[0]:
            continue
        png = out / f"timeline-{r['fleet']}-{r['workload']}.png"
        title = f"{r['fleet']} fleet, {r['workload']} workload, prorsa: {r['rollout_s']:.0f} s ({r['speedup_vs_colocated']:.2f}x colocated)"
        plot_run(Path(r["run_dir"]), r["initial_roles"], title, png)
        written.append(png)
    return written
