"""The ceiling on decode-token bin forecasts without output lengths (`forecasting.bound`).

    python -m runners.forecast_bound LOG.parquet --horizons 5 10 [--accuracy DIR/accuracy.csv]

Scores the bound's forecast on the log's own `decode_tokens` bins, at one tick per bin
from the log's first event (as `runners.replay` ticks), and prints its MAE beside the naive
forecast's. With `--accuracy` (a `runners.replay` table of the same log, with ETS and ARIMA)
it prints the bound's gain over the best of ETS/ARIMA and each other model's, by every score
the table has (`bin`: the models' point forecasts; `median`: their published medians): what
the best forecast that does not know lengths would gain, next to what the models do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import polars as pl

from forecasting.bound import bound_forecast, decodes
from forecasting.core import CoreConfig
from ops.export import EventLogError, load_events
from runners.replay import BASELINES, actuals, tick_bounds


def score(events: pl.DataFrame, horizons_s: list[float], bin_s: float = 1.0, samples: int = 300) -> pl.DataFrame:
    """Per horizon: the bound's and the naive forecast's MAE on decode tokens, and the ticks
    scored: the ticks and bins `runners.replay` scores with one tick per bin."""
    if samples < 1:
        raise ValueError(f"--samples {samples}: want at least 1 draw per tick")
    cfg = CoreConfig(models=("naive",), bin_s=bin_s, horizons_s=tuple(horizons_s))  # checks each horizon is whole bins
    ticks_s = np.array(tick_bounds(events, cfg, bin_s))  # (refuses an empty log)
    actual = actuals(events, cfg, float(ticks_s[-1]))["decode_tokens"]
    ticks_s = ticks_s[ticks_s >= float(events["at_s"].min())]  # as `replay.align` scores them
    at = np.round(ticks_s / bin_s).astype(np.int64)  # each tick's bin index
    d = decodes(events)
    rows = []
    for h_s, ahead in zip(cfg.horizons_s, (i + 1 for i in cfg.horizon_index())):
        keep = at + ahead - 1 < len(actual)
        if not keep.any():
            raise ValueError(f"the log is too short for a {h_s:g} s horizon")
        truth = actual[at[keep] + ahead - 1]
        forecast = bound_forecast(d, ticks_s[keep], ahead * bin_s, bin_s, samples)
        naive = actual[at[keep] - 1]
        rows.append(
            {
                "horizon_s": h_s,
                "ticks": int(keep.sum()),
                "bound_mae": float(np.abs(truth - forecast).mean()),
                "naive_mae": float(np.abs(truth - naive).mean()),
            }
        )
    return pl.DataFrame(rows)


def gains(bound: pl.DataFrame, accuracy: pl.DataFrame) -> pl.DataFrame:
    """The bound's and every non-baseline model's MAE gain over the best of ETS/ARIMA, per score
    and horizon of `accuracy` (decode tokens). A cell must have scored the bound's ticks (one
    log, one tick per bin, the same bins): else the gains compare different points."""
    missing = {"log", "score", "model", "target", "horizon_s", "points", "mae"} - set(accuracy.columns)
    if missing:
        raise ValueError(f"the accuracy table lacks {', '.join(sorted(missing))}: want runners.replay's accuracy.csv")
    if accuracy["log"].n_unique() > 1:
        raise ValueError("the accuracy table scores several logs; give one log's table")
    rows = []
    table = accuracy.filter(pl.col("target") == "decode_tokens")
    for b in bound.iter_rows(named=True):
        for sc in sorted(set(table["score"]) - {"window"}):
            cell = table.filter((pl.col("score") == sc) & ((pl.col("horizon_s") - b["horizon_s"]).abs() < 1e-9))
            base = cell.filter(pl.col("model").is_in(BASELINES))
            if base.height == 0:
                continue
            points = set(cell["points"].to_list())
            if points != {b["ticks"]}:
                raise ValueError(
                    f"the accuracy table scored {sorted(points)} points at {b['horizon_s']:g} s, the bound {b['ticks']} ticks: "
                    "not the same log, bins or ticks (one log, --tick-s = --bin-s)"
                )
            best = base["mae"].min()
            row = {"score": sc, "horizon_s": b["horizon_s"], "best_baseline_mae": best, "bound": 1 - b["bound_mae"] / best}
            for model, mae in cell.filter(~pl.col("model").is_in([*BASELINES, "naive"])).select("model", "mae").iter_rows():
                row[model] = 1 - mae / best
            rows.append(row)
    return pl.DataFrame(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.forecast_bound", description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="a recorded events.parquet")
    parser.add_argument("--horizons", nargs="+", type=float, default=[5.0, 10.0], help="seconds")
    parser.add_argument("--bin-s", type=float, default=1.0)
    parser.add_argument("--samples", type=int, default=300, help="Monte Carlo draws per tick")
    parser.add_argument("--accuracy", type=Path, help="runners.replay's accuracy.csv for the same log (one tick per bin)")
    args = parser.parse_args(argv)
    try:
        accuracy = pl.read_csv(args.accuracy) if args.accuracy else None
        events = load_events(args.log)
        bound = score(events, args.horizons, args.bin_s, args.samples)
        table = gains(bound, accuracy) if accuracy is not None else None
    except (EventLogError, ValueError, OSError, pl.exceptions.PolarsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with pl.Config(tbl_rows=50, float_precision=3):
        print(bound)
        if table is not None:
            print(table if table.height else "no ETS or ARIMA rows for decode tokens in the accuracy table: no gains to give")
    return 0


if __name__ == "__main__":
    sys.exit(main())
