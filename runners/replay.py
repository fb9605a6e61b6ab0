"""Replay recorded lifecycle logs through forecasting models and score them.

    python -m runners.replay LOG.parquet --models naive ets arima lifecycle hybrid \\
        --horizons 1 5 10 20 30 --bin-s 1 --out DIR
    python -m runners.replay --config configs/forecast-swe.toml configs/forecast-shift.toml \\
        --holdout-seeds 1011 1023 --models ets arima lifecycle --out DIR
    python -m runners.replay --config configs/async.toml --set trainer.steps=12 --holdout-seeds 1011 ...

Each log goes through forecasting.core tick by tick, exactly as the live forecaster actor
runs it. With --holdout-seeds, fresh logs are recorded from each config with each seed
(runners.simulate, virtual time, under DIR/holdout/) and only those are scored: a model
is judged on logs it was not developed against. Writes DIR/accuracy.csv (log, model,
target, horizon_s, mae, smape, mase, pinball, coverage of the published 10-90% interval,
coverage_raw of the model's own before calibration, fallbacks), DIR/gain.csv (the
lifecycle models' MASE gain over the best of ETS/ARIMA, when they ran) and
DIR/forecast_vs_actual.png. Naive always runs: MASE is measured against it. A config's
seeds are pooled into one row per (model, target, horizon). Exit 2, with one line naming
the problem, for a log or config that cannot be used.

`--score` picks what a forecast h seconds ahead is scored on (a `score` column in both
tables): `bin`, the one bin that ends h seconds after the tick (the default), by each
model's point forecast; `median`, the same bin by each model's published (calibrated)
median, which for ETS and ARIMA is not their point (their mean); and
`window`, the mean over the next h seconds, bins 1..h, which is what an allocator with an
h-second horizon sizes on (`actors.allocator.demand.from_forecast` averages the forecast
over its horizon). A window is scored on each model's mean forecast, the figure the
allocator consumes (a flow's per-bin median does not add up to the median of a sum); its
interval columns are empty, since per-bin quantiles do not give a window's.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import polars as pl
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from actors.config import ConfigError, load_config
from actors.forecaster.actor import decode_cost, prefill_cost
from forecasting import metrics, series
from forecasting.core import CoreConfig, ForecastCore, TickResult
from forecasting.models import QUANTILES, TARGETS
from forecasting.models.base import Prediction
from forecasting.series import UNIT_COST, TokenCost
from ops.export import EventLogError, load_events

console = Console(stderr=True)
MIN_SCORED_BINS = 10  # beyond the longest horizon
# the bin h s ahead, by each model's point forecast; the same bin by each model's published
# (calibrated) median; the mean over the next h s (--score)
SCORES = ("bin", "median", "window")


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


def replay(
    events: pl.DataFrame, cfg: CoreConfig, tick_s: float | None = None, progress: bool = False
) -> tuple[list[TickResult], ForecastCore]:
    """Every tick's forecasts for a log sorted by (at_s, event_id) (ops.export.load_events)."""
    tick_s = tick_s or cfg.bin_s
    ticks = tick_bounds(events, cfg, tick_s)
    core = ForecastCore(cfg)
    at_s = events["at_s"].to_numpy()
    cuts = np.searchsorted(at_s, ticks, side="left")
    results: list[TickResult] = []
    bar = Progress(
        TextColumn("replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("ticks"),
        TimeElapsedColumn(),
        console=console,
        disable=not progress,
    )
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
    quantiles: np.ndarray | None  # (len(QUANTILES), n): as published (calibrated); None: a window
    naive: np.ndarray
    raw_quantiles: np.ndarray | None = None  # the model's own, before calibration
    log: str = ""
    score: str = "bin"  # SCORES


def align(results: list[TickResult], cfg: CoreConfig, actual: dict[str, np.ndarray], from_s: float, score: str = "bin") -> list[Scored]:
    """Pair each forecast with the bin it was for (score "bin": the model's point forecast;
    "median": its published median, where calibration is on shifted by the conformal layer as
    for every model), or with the mean of the bins up to it ("window"), for ticks at or after from_s."""
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r} (known: {', '.join(SCORES)})")
    out: list[Scored] = []
    n_bins = len(next(iter(actual.values())))
    for model in cfg.models:
        for target in TARGETS:
            for h_s, hi in zip(cfg.horizons_s, cfg.horizon_index()):
                rows = [(r, round(r.as_of_s / cfg.bin_s) + hi) for r in results if r.as_of_s >= from_s]
                rows = [(r, b) for r, b in rows if b < n_bins]
                if not rows:
                    continue
                if score == "window":
                    out.append(_window(model, target, h_s, hi, rows, actual[target]))
                    continue
                raw = [r.outcomes[model].raw_quantiles for r, _ in rows]
                out.append(
                    Scored(
                        model,
                        target,
                        h_s,
                        actual=np.array([actual[target][b] for _, b in rows]),
                        forecast=np.array([_point(r.outcomes[model].prediction, target, hi, score) for r, _ in rows]),
                        quantiles=np.array(
                            [[r.outcomes[model].prediction.quantiles[target][q, hi] for r, _ in rows] for q in range(len(QUANTILES))]
                        ),
                        naive=np.array([r.outcomes["naive"].prediction.mean[target][hi] for r, _ in rows]),
                        raw_quantiles=None
                        if any(q is None for q in raw)
                        else np.array([[q[target][qi, hi] for q in raw] for qi in range(len(QUANTILES))]),
                        score=score,
                    )
                )
    return out


def _point(prediction: Prediction, target: str, hi: int, score: str) -> float:
    """What MAE scores at horizon index hi: the model's point forecast, or its published median
    (calibrated, unless the replay runs with --no-calibrate)."""
    if score == "median":
        return float(prediction.quantiles[target][QUANTILES.index(0.5), hi])
    return float(prediction.point_forecast(target)[hi])


def _window(model: str, target: str, h_s: float, hi: int, rows: list, actual: np.ndarray) -> Scored:
    """The mean over horizon indices 0..hi (the next h_s seconds) of each tick's mean
    forecast (a prefill's compute as asked for, where the model tells it: `Prediction.window_mean`),
    against the mean of the same bins."""
    return Scored(
        model,
        target,
        h_s,
        actual=np.array([actual[b - hi : b + 1].mean() for _, b in rows]),
        forecast=np.array([r.outcomes[model].prediction.window_mean(target, hi) for r, _ in rows]),
        quantiles=None,
        naive=np.array([r.outcomes["naive"].prediction.window_mean(target, hi) for r, _ in rows]),
        score="window",
    )


def pooled(scored: list[Scored], log: str) -> list[Scored]:
    """The scores of several logs as one per (model, target, horizon): their points joined."""
    groups: dict[tuple[str, str, float, str], list[Scored]] = {}
    for s in scored:
        groups.setdefault((s.model, s.target, s.horizon_s, s.score), []).append(s)

    def join(parts: list[np.ndarray | None], axis: int) -> np.ndarray | None:
        return None if any(p is None for p in parts) else np.concatenate(parts, axis=axis)

    return [
        Scored(
            model,
            target,
            h_s,
            *(np.concatenate([getattr(p, f) for p in parts]) for f in ("actual", "forecast")),
            quantiles=join([p.quantiles for p in parts], 1),
            naive=np.concatenate([p.naive for p in parts]),
            raw_quantiles=join([p.raw_quantiles for p in parts], 1),
            log=log,
            score=score,
        )
        for (model, target, h_s, score), parts in groups.items()
    ]


def accuracy_table(scored: list[Scored], fallbacks: dict[str, int]) -> pl.DataFrame:
    lo, hi = QUANTILES.index(0.1), QUANTILES.index(0.9)
    rows = [
        {
            "log": s.log,
            "score": s.score,
            "model": s.model,
            "target": s.target,
            "horizon_s": s.horizon_s,
            "points": len(s.actual),
            "mae": metrics.mae(s.actual, s.forecast),
            "smape": metrics.smape(s.actual, s.forecast),
            "mase": metrics.mase(s.actual, s.forecast, s.naive),
            "pinball": metrics.pinball(s.actual, s.quantiles, QUANTILES) if s.quantiles is not None else float("nan"),
            "coverage": metrics.coverage(s.actual, s.quantiles[lo], s.quantiles[hi]) if s.quantiles is not None else float("nan"),
            "coverage_raw": metrics.coverage(s.actual, s.raw_quantiles[lo], s.raw_quantiles[hi])
            if s.raw_quantiles is not None
            else float("nan"),
            "fallbacks": fallbacks.get(s.model, 0),
        }
        for s in scored
    ]
    return pl.DataFrame(rows)


BASELINES = ("ets", "arima")


def gain_table(table: pl.DataFrame) -> pl.DataFrame:
    """Per log, score, target and horizon: each non-baseline model's MASE gain over the best
    of ETS/ARIMA, 1 - MASE / min(MASE of ETS, ARIMA) (empty unless a baseline ran)."""
    keys = ["log", "score", "target", "horizon_s"]
    base = table.filter(pl.col("model").is_in(BASELINES)).group_by(keys).agg(pl.col("mase").min().alias("best_baseline_mase"))
    if base.height == 0:
        return pl.DataFrame()
    others = table.filter(~pl.col("model").is_in([*BASELINES, "naive"])).select(*keys, "model", "mase", "coverage")
    gains = others.join(base, on=keys).with_columns((1 - pl.col("mase") / pl.col("best_baseline_mase")).alias("gain"))
    return gains.sort("log", "score", "model", "target", "horizon_s")


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


def score_log(
    log: Path, cfg: CoreConfig, name: str = "", tick_s: float | None = None, scores: tuple[str, ...] = ("bin",)
) -> tuple[list[Scored], dict[str, int]]:
    """One log's scores (and each model's fallbacks)."""
    events = load_events(log)
    span_s = float(events["at_s"].max() - events["at_s"].min()) if events.height else 0.0
    needed_s = max(cfg.horizons_s) + MIN_SCORED_BINS * cfg.bin_s
    if events.height == 0:
        raise ReplayError(f"{log}: the log is empty: no events to replay")
    if span_s < needed_s:
        raise ReplayError(
            f"{log}: too short to score: {events.height} events over {span_s:.1f} s; need >= {needed_s:g} s (longest horizon + {MIN_SCORED_BINS} bins)"
        )
    results, core = replay(events, cfg, tick_s, progress=True)
    actual = actuals(events, cfg, results[-1].as_of_s)
    scored = [s for score in scores for s in align(results, cfg, actual, float(events["at_s"].min()), score)]
    for s in scored:
        s.log = name or log.stem
    return scored, dict(core.fallbacks)


def actuals(events: pl.DataFrame, cfg: CoreConfig, end_s: float) -> dict[str, np.ndarray]:
    """Each target's true value per bin of the log up to `end_s`."""
    frame = series.bin_events(events, cfg.bin_s, end_s=end_s, cost=cfg.prefill_cost, decode_cost=cfg.decode_cost)
    actual = {t: np.array(series.totals(frame, t)) for t in TARGETS if t != series.LIVE_KV}
    bins = len(actual["decode_tokens"])
    actual[series.LIVE_KV] = series.live_context_by_bin(events.filter(pl.col("at_s") < bins * cfg.bin_s), cfg.bin_s, bins)
    return actual


def with_overrides(config, overrides: list[str]):
    """`config` with each `SECTION.KEY=VALUE` set (VALUE in TOML: 12, "hold", {dp = 4, ep = 4}),
    validated as the config file would be: a variant of a config without another file."""
    import tomllib

    import msgspec

    from actors.config import Config

    raw = msgspec.to_builtins(config)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: want SECTION.KEY=VALUE")
        try:
            parsed = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            parsed = value  # a bare word: a string
        *path, last = key.strip().split(".")
        node = raw
        for part in path:
            node = node.setdefault(part, {})
        node[last] = parsed
    try:
        return msgspec.convert(raw, Config)
    except (msgspec.ValidationError, ValueError) as err:
        raise ConfigError(f"--set {' '.join(overrides)}: {err}") from None


def record_holdout(config_path: Path, seeds: list[int], out: Path, overrides: list[str] = ()) -> tuple[list[Path], Costs]:
    """Fresh logs of `config_path` (with `overrides`, see with_overrides) with each seed, in
    virtual time (runners.simulate), and the config's prefill and decode costs."""
    import msgspec

    from runners.simulate import run as simulate

    config = with_overrides(load_config(config_path), list(overrides))
    logs = []
    for seed in seeds:
        if seed == config.run.seed:
            raise ReplayError(f"{config_path}: seed {seed} is the config's own: not held out")
        where = out / "holdout" / f"{config.run.name}-seed{seed}"
        console.print(f"recording {config_path} with seed {seed} → {where}")
        summary = simulate(msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, seed=seed)), where, show_progress=False)
        if summary["status"] != "completed":
            raise ReplayError(f"{config_path} with seed {seed}: the simulation {summary['status']}")
        logs.append(where / "events.parquet")
    return logs, (prefill_cost(config), decode_cost(config))


Costs = tuple[TokenCost, TokenCost]  # a log's prefill and decode costs (CoreConfig.prefill_cost, decode_cost)


def preset_cost(name: str) -> Costs:
    from actors.engine.emulated.costmodel import PRESETS

    if name not in PRESETS:
        raise ReplayError(f"unknown cost-model preset {name!r} (known: {', '.join(sorted(PRESETS))})")
    return TokenCost.prefill_of(PRESETS[name]), TokenCost.decode_of(PRESETS[name])


def run(
    logs: list[tuple[str, list[Path], Costs]], cfg: CoreConfig, out: Path, tick_s: float | None = None, scores: tuple[str, ...] = ("bin",)
) -> pl.DataFrame:
    """Score each group of logs (a name, its logs pooled, their prefill and decode costs) and write the
    tables and the plot."""
    scored: list[Scored] = []
    fallbacks: dict[str, int] = {}
    for name, paths, (cost, dcost) in logs:
        group = []
        for path in paths:
            part, falls = score_log(path, replace(cfg, prefill_cost=cost, decode_cost=dcost), name, tick_s, scores)
            group += part
            for model, n in falls.items():
                fallbacks[model] = fallbacks.get(model, 0) + n
        scored += pooled(group, name) if len(paths) > 1 else group
    table = accuracy_table(scored, fallbacks)
    out.mkdir(parents=True, exist_ok=True)
    table.write_csv(out / "accuracy.csv", float_precision=4)
    gains = gain_table(table)
    if gains.height:
        gains.write_csv(out / "gain.csv", float_precision=4)
    first = [s for s in scored if s.log == scored[0].log and s.score == scored[0].score]
    plot(
        out / "forecast_vs_actual.png",
        first,
        horizon_s=sorted(cfg.horizons_s)[len(cfg.horizons_s) // 2],
        targets=("prefill_engine_s", "decode_active_seqs"),
    )
    return table


def wide(table: pl.DataFrame, value: str) -> pl.DataFrame:
    """One row per (log, model, target), one column per horizon."""
    return table.pivot(on="horizon_s", index=["log", "score", "model", "target"], values=value).sort("log", "score", "target", "model")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.replay", description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, nargs="?", help="a recorded events.parquet (or --config with --holdout-seeds)")
    parser.add_argument("--config", type=Path, nargs="+", default=[], help="configs to record held-out logs from")
    parser.add_argument("--holdout-seeds", type=int, nargs="+", default=[], help="record and score only fresh logs with these seeds")
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="SECTION.KEY=VALUE", help="override config keys for the held-out logs (TOML values)"
    )
    parser.add_argument("--models", nargs="+", default=["moving_average", "ets", "arima", "lifecycle", "hybrid"])
    parser.add_argument("--horizons", nargs="+", type=float, default=[1.0, 5.0, 10.0, 20.0, 30.0], help="seconds")
    parser.add_argument("--bin-s", type=float, default=1.0)
    parser.add_argument(
        "--preset",
        help="a LOG's cost-model preset, for prefill_engine_s and decode_engine_s (default: 1 s per token); --config gives its own",
    )
    parser.add_argument("--tick-s", type=float, default=None, help="default: one tick per bin")
    parser.add_argument("--no-calibrate", action="store_true", help="publish the models' own quantiles")
    parser.add_argument(
        "--score",
        nargs="+",
        choices=SCORES,
        default=["bin"],
        help="bin: the bin h s ahead, by each model's point forecast; median: the same bin by each model's published "
        "(calibrated) median; window: the mean over the next h s (what an allocator with that horizon sizes on)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import logging

    logging.basicConfig(level=logging.WARNING, format="note: %(message)s", stream=sys.stderr)
    if (args.log is None) == (not args.holdout_seeds) or bool(args.config) != bool(args.holdout_seeds) or (args.set and not args.config):
        print("error: give a LOG, or --config CONFIG... with --holdout-seeds SEED...", file=sys.stderr)
        return 2
    try:
        cfg = CoreConfig(
            models=tuple(dict.fromkeys(["naive", *args.models])),
            bin_s=args.bin_s,
            horizons_s=tuple(args.horizons),
            calibrate=not args.no_calibrate,
        )
        if args.log is not None:
            cost = preset_cost(args.preset) if args.preset else (UNIT_COST, UNIT_COST)
            logs = [(args.log.stem if args.log.stem != "events" else args.log.parent.name, [args.log], cost)]
        else:
            logs = [(path.stem, *record_holdout(path, args.holdout_seeds, args.out, args.set)) for path in args.config]
        table = run(logs, cfg, args.out, args.tick_s, tuple(dict.fromkeys(args.score)))
    except (EventLogError, ReplayError, ConfigError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # a bad flag value (unknown model, horizon not a multiple of the bin)
        print(f"error: {err}", file=sys.stderr)
        return 2
    with pl.Config(tbl_rows=200, tbl_cols=12, float_precision=3, tbl_width_chars=160):
        print("MASE (vs naive; < 1 is better)")
        print(wide(table, "mase"))
        if "bin" in args.score:
            print("coverage of the published 10-90% interval (target 0.75-0.85)")
            print(wide(table.filter(pl.col("model") != "naive", pl.col("score") == "bin"), "coverage"))
        gains = gain_table(table)
        if gains.height:
            print("MASE gain over the best of ETS/ARIMA")
            print(wide(gains, "gain"))
    print(f"wrote {args.out / 'accuracy.csv'} and {args.out / 'forecast_vs_actual.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
