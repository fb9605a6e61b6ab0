"""The one way forecasting tests bring a log to a moment: ticked bin by bin through a
forecast core, as the forecaster does."""

from __future__ import annotations

import polars as pl

from forecasting.core import CoreConfig, ForecastCore
from forecasting.models import History


def history_at(log: pl.DataFrame, now_s: int, prior: pl.DataFrame | None = None) -> History:
    """The history a model sees at `now_s`: the log's events ticked in 1 s bins (after
    learning from an earlier run's log, `prior`)."""
    core = ForecastCore(CoreConfig(models=("naive",)))
    if prior is not None:
        core.live.learn_from(prior)
    at_s = log["at_s"].to_numpy()
    for until_s in range(1, now_s + 1):
        core.tick(log.filter((at_s >= until_s - 1) & (at_s < until_s)), float(until_s))
    return History(1.0, float(now_s), {t: s.view() for t, s in core.series.items()}, core.live)
