"""Replay a recorded lifecycle log through forecasting models and score them.

    python -m runners.replay LOG.parquet --models naive ets arima lifecycle hybrid \\
        --horizons 1 5 10 20 30 --bin-s 1 --out DIR

The log goes through forecasting.core tick by tick, exactly as the live forecaster actor
runs it. Writes DIR/accuracy.csv (model, target, horizon_s, mae, smape, mase, pinball,
coverage, fallbacks) and DIR/forecast_vs_actual.png. Naive always runs: MASE is measured
against it. Exit 2, with one line naming the problem, for a log that cannot be used.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from forecasting import metrics, series
from forecasting.core import CoreConfig, ForecastCore, TickResult
from forecasting.models import QUANTILES, TARGETS
from ops.export import EventLogError, load_events

console = Console(stderr=True)
MIN_SCORED_BINS = 10  # beyond the longest horizon


class ReplayError(ValueError):
    """A log that is too small to replay or score; the message says what it has."""


def tick_bounds(events: pl.DataFrame, cfg: CoreConfig, tick_s: float, end_s: float | None = None) -> list[float]:
    """Tick times tick_s, 2·tick_s, … up to the first tick after the last event."""
    if events.height == 0:
        raise ReplayError("the log is empty: no events to replay")
    ratio = tick_s / cfg.bin_s
    if tick_s <= 0 or abs(ratio - round(ratio)) > 1e-9:
        raise ReplayError(f"tick_s = {tick_s} is not a positive multiple of bin_s = {cfg.bin_s}")
    last_s = float(events["at_s"].max()) if end_s is None else end_s
    n = int(last_s // tick_s) + 1
    return [tick_s * (k + 1) for k in range(n)]


def replay(events: pl.DataFrame, cfg: CoreConfig, tick_s: float | None = None, progress: bool = False) -> tuple[list[TickResult], ForecastCore]:
    """Every tick's forecasts for a log sorted by (at_s, event_id) (ops.export.load_events)."""
    tick_s = tick_s or cfg.bin_s
    ticks = tick_bounds(events, cfg, tick_s)
    core = ForecastCore(cfg)
    at_s = events["at_s"].to_numpy()
    cuts = np.searchsorted(at_s, ticks, side="left")
    results: list[TickResult] = []
    bar = Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TextColumn("ticks"), TimeElapsedColumn(), console=console, disable=not progress)
    with bar:
        task = bar.add_task("ticks", total=len(ticks))
        start = 0
        for until_s, cut in zip(ticks, cuts):
            results.append(core.tick(events.slice(start, cut - start), until_s))
            start = cut
            bar.advance(task)
    return results, core


@dataclass(slots=True)
class Scored:
    model: str
    target: str
    horizon_s: float
    actual: np.ndarray
    forecast: np.ndarray
    quantiles: np.ndarray  # (len(QUANTILES), n)
    naive: np.ndarray


def align(results: list[TickResult], cfg: CoreConfig, actual: dict[str, np.ndarray], from_s: float) -> list[Scored]:
    """Pair each forecast with the bin it was for, for ticks at or after from_s."""
    out: list[Scored] = []
    n_bins = len(next(iter(actual.values())))
    for model in cfg.models:
        for target in TARGETS:
            for h_s, hi in zip(cfg.horizons_s, cfg.horizon_index()):
                rows = [(r, round(r.as_of_s / cfg.bin_s) + hi) for r in results if r.as_of_s >= from_s]
                rows = [(r, b) for r, b in rows if b < n_bins]
                if not rows:
                    continue
                out.append(Scored(
                    model, target, h_s,
                    actual=np.array([actual[target][b] for _, b in rows]),
                    forecast=np.array([r.outcomes[model].prediction.point_forecast(target)[hi] for r, _ in rows]),
                    quantiles=np.array([[r.outcomes[model].prediction.quantiles[target][q, hi] for r, _ in rows] for q in range(len(QUANTILES))]),
                    naive=np.array([r.outcomes["naive"].prediction.mean[target][hi] for r, _ in rows]),
                ))  # fmt: skip
    return out


def accuracy_table(scored: list[Scored], fallbacks: dict[str, int]) -> pl.DataFrame:
    lo, hi = QUANTILES.index(0.1), QUANTILES.index(0.9)
    rows = [
        {
            "model": s.model, "target": s.target, "horizon_s": s.horizon_s, "points": len(s.actual),
            "mae": metrics.mae(s.actual, s.forecast), "smape": metrics.smape(s.actual, s.forecast),
            "mase": metrics.mase(s.actual, s.forecast, s.naive),
            "pinball": metrics.pinball(s.actual, s.quantiles, QUANTILES),
            "coverage": metrics.coverage(s.actual, s.quantiles[lo], s.quantiles[hi]),
            "fallbacks": fallbacks.get(s.model, 0),
        }
        for s in scored
    ]  # fmt: skip
    return pl.DataFrame(rows)


def plot(path: Path, scored: list[Scored], horizon_s: float, targets: tuple[str, ...]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(targets), 1, figsize=(14, 3.5 * len(targets)), sharex=True)
    for ax, target in zip(np.atleast_1d(axes), targets):
        rows = [s for s in scored if s.target == target and s.horizon_s == horizon_s]
        if rows:
            ax.plot(rows[0].actual, color="black", linewidth=1.2, label="actual")
        for s in rows:
            ax.plot(s.forecast, linewidth=0.8, label=s.model)
        ax.set_title(f"{target}: forecast {horizon_s:g} s ahead vs actual")
        ax.legend(loc="upper right", fontsize=8)
    np.atleast_1d(axes)[-1].set_xlabel("forecast (tick) index")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run(log: Path, models: list[str], horizons_s: list[float], bin_s: float, tick_s: float | None, out: Path) -> pl.DataFrame:
    events = load_events(log)
    cfg = CoreConfig(models=tuple(dict.fromkeys(["naive", *models])), bin_s=bin_s, horizons_s=tuple(horizons_s))
    span_s = float(events["at_s"].max() - events["at_s"].min()) if events.height else 0.0
    needed_s = max(horizons_s) + MIN_SCORED_BINS * bin_s
    if events.height == 0:
        raise ReplayError(f"{log}: the log is empty: no events to replay")
    if span_s < needed_s:
        raise ReplayError(f"{log}: too short to score: {events.height} events over {span_s:.1f} s; need >= {needed_s:g} s (longest horizon + {MIN_SCORED_BINS} bins)")
    results, core = replay(events, cfg, tick_s, progress=True)
    actual_frame = series.bin_events(events, bin_s, end_s=results[-1].as_of_s)
    actual = {t: np.array(series.totals(actual_frame, t)) for t in TARGETS}
    scored = align(results, cfg, actual, from_s=float(events["at_s"].min()))
    table = accuracy_table(scored, core.fallbacks)
    out.mkdir(parents=True, exist_ok=True)
    table.write_csv(out / "accuracy.csv", float_precision=4)
    plot(out / "forecast_vs_actual.png", scored, horizon_s=sorted(horizons_s)[len(horizons_s) // 2], targets=("prefill_new_tokens", "decode_active_seqs"))
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--models", nargs="+", default=["moving_average", "ets", "arima", "lifecycle", "hybrid"])
    parser.add_argument("--horizons", nargs="+", type=float, default=[1.0, 5.0, 10.0, 20.0, 30.0], help="seconds")
    parser.add_argument("--bin-s", type=float, default=1.0)
    parser.add_argument("--tick-s", type=float, default=None, help="default: one tick per bin")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="note: %(message)s", stream=sys.stderr)
    try:
        table = run(args.log, args.models, args.horizons, args.bin_s, args.tick_s, args.out)
    except (EventLogError, ReplayError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # a bad flag value (unknown model, horizon not a multiple of the bin)
        print(f"error: {err}", file=sys.stderr)
        return 2
    with pl.Config(tbl_rows=200, tbl_cols=12, float_precision=3):
        print(table.filter(pl.col("target").is_in(["prefill_new_tokens", "decode_active_seqs"])).sort("target", "horizon_s", "model"))
    print(f"wrote {args.out / 'accuracy.csv'} and {args.out / 'forecast_vs_actual.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
