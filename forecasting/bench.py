"""Per-tick compute time of the forecaster at 1k and 10k live trajectories.

    python -m forecasting.bench [--models lifecycle hybrid] [--trajectories 1000 10000]

A synthetic log (forecasting.synthetic) with every trajectory started in the first 10 s and
long enough (>= 20 turns) that none has finished by the end is replayed tick by tick (1 s
bins, horizons up to 30 s, calibration on); the ticks after 15 s, when all are live, are
timed: the whole tick (binning + ingest + models + calibration; wall time, median and best,
and the process's CPU time, which a busy shared machine inflates less) and the models alone.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from forecasting.core import CoreConfig, ForecastCore
from forecasting.synthetic import synthetic_log


def bench(trajectories: int, models: tuple[str, ...], timed_ticks: int = 10) -> dict[str, float]:
    events = synthetic_log(trajectories, seed=0, spread_s=10.0, min_turns=20, max_turns=24, until_s=16.0 + timed_ticks)
    core = ForecastCore(CoreConfig(models=models))
    at_s = events["at_s"].to_numpy()
    start, tick_ms, cpu_ms, live = 0, [], [], []
    for until_s in range(1, 16 + timed_ticks):
        cut = int(np.searchsorted(at_s, until_s))
        began, began_cpu = time.perf_counter(), time.process_time()
        result = core.tick(events.slice(start, cut - start), float(until_s))
        if until_s > 15:
            tick_ms.append((time.perf_counter() - began) * 1e3)
            cpu_ms.append((time.process_time() - began_cpu) * 1e3)
            live.append(result.live_trajectories)
        start = cut
    model_ms = []
    for _ in range(timed_ticks):
        began = time.perf_counter()
        for model in core.models.values():
            model.predict(core.config.horizon_bins)
        model_ms.append((time.perf_counter() - began) * 1e3)
    return {
        "live": float(np.mean(live)),
        "tick_ms": float(np.median(tick_ms)),
        "tick_best_ms": float(np.min(tick_ms)),
        "tick_cpu_ms": float(np.median(cpu_ms)),
        "predict_ms": float(np.median(model_ms)),
        "events_per_tick": float((at_s.searchsorted(16 + timed_ticks) - at_s.searchsorted(16)) / timed_ticks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m forecasting.bench")
    parser.add_argument("--models", nargs="+", default=["lifecycle"])
    parser.add_argument("--trajectories", nargs="+", type=int, default=[1000, 10000])
    parser.add_argument("--ticks", type=int, default=10, help="ticks timed")
    args = parser.parse_args()
    for n in args.trajectories:
        r = bench(n, tuple(args.models), args.ticks)
        print(
            f"{'+'.join(args.models)}: {r['live']:.0f} live trajectories, {r['events_per_tick']:.0f} events/tick: "
            f"tick {r['tick_ms']:.1f} ms (median; best {r['tick_best_ms']:.1f}; CPU {r['tick_cpu_ms']:.1f}), "
            f"of which predict {r['predict_ms']:.1f} ms"
        )


if __name__ == "__main__":
    main()
