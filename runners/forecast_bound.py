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
from runners.replay import BASELINES, actuals


def score(events: pl.DataFrame, horizons_s: list[float], bin_s: float = 1.0, samples: int = 300) -> pl.DataFrame:
    """Per horizon: the bound's and the naive forecast's MAE on decode tokens, and the ticks scored."""
    end_s = float(np.ceil(float(events["at_s"].max()) / bin_s) * bin_s)  # the last event's bin closed
    actual = actuals(events, CoreConfig(models=("naive",), bin_s=bin_s), end_s)["decode_tokens"]
    d = decodes(events)
    first = int(np.ceil(float(events["at_s"].min()) / bin_s))
    rows = []
    for h in horizons_s:
        ahead = round(h / bin_s)
        ticks = np.arange(max(first, 1), len(actual) - ahead + 1)  # the bin t + ahead - 1 closed
        if len(ticks) == 0:
            raise ValueError(f"the log is too short for a {h:g} s horizon")
        truth = actual[ticks + ahead - 1]
        forecast = bound_forecast(d, ticks * bin_s, h, bin_s, samples)
        naive = actual[ticks - 1]
        rows.append({"horizon_s": h, "ticks": len(ticks), "bound_mae": float(np.abs(truth - forecast).mean()), "naive_mae": float(np.abs(truth - naive).mean())})
    return pl.DataFrame(rows)


def gains(bound: pl.DataFrame, accuracy: pl.DataFrame) -> pl.DataFrame:
    """The bound's and every non-baseline model's MAE gain over the best of ETS/ARIMA, per score
    and horizon of `accuracy` (decode tokens)."""
    rows = []
    table = accuracy.filter(pl.col("target") == "decode_tokens")
    for b in bound.iter_rows(named=True):
        for sc in sorted(set(table["score"]) - {"window"}):
            cell = table.filter((pl.col("score") == sc) & ((pl.col("horizon_s") - b["horizon_s"]).abs() < 1e-9))
            best = cell.filter(pl.col("model").is_in(BASELINES))["mae"].min()
            if best is None:
                continue
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
    parser.add_argument("--accuracy", type=Path, help="runners.replay's accuracy.csv for the same log")
    args = parser.parse_args(argv)
    try:
        events = load_events(args.log)
        bound = score(events, args.horizons, args.bin_s, args.samples)
        accuracy = pl.read_csv(args.accuracy) if args.accuracy else None
    except (EventLogError, ValueError, OSError, pl.exceptions.PolarsError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with pl.Config(tbl_rows=50, float_precision=3):
        print(bound)
        if accuracy is not None:
            if accuracy["log"].n_unique() > 1:
                print(f"error: {args.accuracy} scores several logs; give one log's table", file=sys.stderr)
                return 2
            print(gains(bound, accuracy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
