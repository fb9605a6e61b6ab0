"""Timeline PNGs of the rollout bench: engine roles over time against demand and forecast.

One PNG per workload (the first fleet's `prorsa` run), drawn by `ops.report.plot_roles`
(the same figure as a run report's `roles.png`): engines per role (top), prefill demand in
tokens/s (middle) and decoding sequences (bottom), each with the forecast the allocator
acted on (the 5 s horizon, placed at the time it forecast).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl

from ops.export import load_events
from ops.report import plot_roles


def plot_run(run_dir: Path, initial: dict[str, str], title: str, png: Path) -> None:
    forecasts_path = run_dir / "forecasts.parquet"
    forecasts = pl.read_parquet(forecasts_path) if forecasts_path.exists() else None
    plot_roles(load_events(run_dir / "events.parquet"), initial, png, title, forecasts)


def plot_timelines(results: list[dict], out: Path) -> list[Path]:
    written = []
    fleets = list(dict.fromkeys(r["fleet"] for r in results))
    for r in results:
        if r["policy"] != "prorsa" or r["fleet"] != fleets[0]:
            continue
        png = out / f"timeline-{r['fleet']}-{r['workload']}.png"
        speedup = r["speedup_vs_colocated"]  # None where colocated did not run (`--policies`)
        versus = f" ({speedup:.2f}x colocated)" if speedup else ""
        title = f"{r['fleet']} fleet, {r['workload']} workload, prorsa: {r['rollout_s']:.0f} s{versus}"
        plot_run(Path(r["run_dir"]), r["initial_roles"], title, png)
        written.append(png)
    return written
