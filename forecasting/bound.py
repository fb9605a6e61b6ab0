"""How well any bin forecast of decode tokens can do without knowing output lengths (pure).

`decode_tokens` counts, per bin, the tokens of the decodes that end in it. A decode's length
is known only when it ends (its end-of-sequence), so a forecast of which running decodes end
in a bin a few seconds ahead, and with how many tokens, is a bet on lengths. This module
forecasts the bins with everything else a recorded log can tell, more than any live
forecaster has, and so gives a ceiling for one that does not know lengths:

* each running decode's own pace over its whole life (its duration over its length in the
  log), and so its tokens so far at the tick and the pace it keeps to its end;
* the true length distribution of its task family (every decode of that family in the log),
  from which its length is drawn given that it has outlasted its tokens so far (the
  emulated workload samples each turn's length independently, `actors/environment/workloads.py`);
* the exact tokens of every decode that starts after the tick and ends in the bin.

The running decodes' tokens in the bin are drawn `samples` times (Monte Carlo) from the
other decodes of their family (each decode's own length left out of its pool), and the point
forecast is the median of known + drawn: the point that minimises the expected absolute
error when lengths are drawn independently per family, independent of pace (as the emulated
workload draws them). Up to the draws' noise (about 1–2% of the MAE at 300 draws) and the
luck of one log, no forecast with less information scores a lower MAE.
Made for emulated logs, where a decode_started event starts each decode once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl

KEYS = ["trajectory_id", "turn", "attempt"]


@dataclass(frozen=True, slots=True)
class Decodes:
    """Every decode of a log that both started and ended in it."""

    started_s: np.ndarray
    done_s: np.ndarray
    tokens: np.ndarray  # generated
    family: np.ndarray  # task family names

    @property
    def pace_s_per_token(self) -> np.ndarray:
        return np.maximum(self.done_s - self.started_s, 1e-9) / np.maximum(self.tokens, 1.0)


def decodes(events: pl.DataFrame) -> Decodes:
    """The log's decodes, each decode_started joined to its decode_done (by trajectory, turn
    and attempt)."""
    started = events.filter(pl.col("kind") == "decode_started").select(*KEYS, pl.col("at_s").alias("started_s"))
    done = events.filter(pl.col("kind") == "decode_done").select(*KEYS, pl.col("at_s").alias("done_s"), "generated_tokens", "task_family")
    # in a fixed order (a join's is not), so the Monte Carlo's draws fall the same every run
    joined = done.join(started.unique(subset=KEYS, keep="first"), on=KEYS, how="inner").sort("started_s", *KEYS)
    return Decodes(
        joined["started_s"].to_numpy(),
        joined["done_s"].to_numpy(),
        joined["generated_tokens"].to_numpy().astype(float),
        joined["task_family"].to_numpy(),
    )


def bound_forecast(d: Decodes, ticks_s: np.ndarray, horizon_s: float, bin_s: float = 1.0, samples: int = 300, seed: int = 0) -> np.ndarray:
    """Per tick t, the bound's point forecast of decode tokens in the bin that ends
    `horizon_s` after t, [t + horizon_s - bin_s, t + horizon_s)."""
    rng = np.random.default_rng(seed)
    pace = d.pace_s_per_token
    lengths = {f: np.sort(d.tokens[d.family == f]) for f in np.unique(d.family)}
    out = np.empty(len(ticks_s))
    for i, t in enumerate(ticks_s):
        lo_s, hi_s = t + horizon_s - bin_s, t + horizon_s
        later = (d.started_s > t) & (d.done_s >= lo_s) & (d.done_s < hi_s)
        known = float(d.tokens[later].sum())
        running = np.flatnonzero((d.started_s <= t) & (d.done_s > t))
        drawn = np.zeros(samples)
        for k in running:
            so_far = (t - d.started_s[k]) / pace[k]
            pool = lengths[d.family[k]]
            first = np.searchsorted(pool, so_far, side="right")
            own = int(np.searchsorted(pool, d.tokens[k]))  # one copy of its own length, left out
            left_out = 1 if own >= first else 0  # (a decode past its own length: none to leave)
            if first >= len(pool) - left_out:
                continue  # no other decode of its family as long: no length left to draw
            drawn_at = rng.integers(first, len(pool) - left_out, samples)
            g = pool[drawn_at + (left_out & (drawn_at >= own))]
            ends_s = d.started_s[k] + g * pace[k]
            drawn += np.where((ends_s >= lo_s) & (ends_s < hi_s), g, 0.0)
        out[i] = known + float(np.median(drawn))
    return out
