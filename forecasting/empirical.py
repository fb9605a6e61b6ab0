"""Distributions learned online from the lifecycle log: durations, token counts, turns.

`Empirical` keeps the most recent samples (a sliding reservoir) and answers in vectors on
a fine time grid: the probability that a stage that has already lasted `elapsed_s` ends in
each future slot. Its survival function is mixed with an exponential tail of the same
mean (weight w/(n+w), w = `tail_weight`, 1 by default; with stages still running, the
censored mean, `_tail_mean_s`), so a stage that has outlasted every sample still ends
somewhere and a family seen once still forecasts (one never seen to end does not end); a
near-regular duration (the trainer's gap between steps) uses a small w. `TurnHazard` estimates, per task family, the
probability that a trajectory goes on after turn n (Kaplan–Meier over finished
trajectories, live ones censored at their current turn, shrunk towards the mean).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np

T = TypeVar("T")


class Ring:
    """The most recent `capacity` rows added (values, or rows of `width`), in no order; the
    oldest are overwritten first."""

    def __init__(self, capacity: int, width: int | None = None) -> None:
        self._rows = np.zeros(capacity if width is None else (capacity, width))
        self._next = 0  # where the next row goes
        self.count = 0

    def add_many(self, rows: np.ndarray) -> None:
        """Add rows in order (at least one)."""
        capacity = len(self._rows)
        rows = rows[-capacity:]
        at = (self._next + np.arange(len(rows))) % capacity
        self._rows[at] = rows
        self._next = int((at[-1] + 1) % capacity)
        self.count = min(capacity, self.count + len(rows))

    def array(self) -> np.ndarray:
        return self._rows[: self.count]

    @property
    def full(self) -> bool:
        """Whether rows may have been overwritten (it holds `capacity`)."""
        return self.count == len(self._rows)


class Empirical:
    def __init__(self, max_samples: int = 2000, tail_weight: float = 1.0) -> None:
        self._samples = Ring(max_samples)
        self._sorted: np.ndarray | None = None
        self._memo: dict = {}  # derived tables, dropped when a sample is added
        self.tail_weight = tail_weight

    def add(self, value: float) -> None:
        self.add_many(np.array([float(value)]))

    def add_many(self, values: np.ndarray) -> None:
        """Add values in order (the oldest drop out first, as with add)."""
        if len(values):
            self._samples.add_many(np.asarray(values, float))
            self._changed()

    def _changed(self) -> None:
        self._sorted = None
        self._memo.clear()

    def memo(self, key, compute: Callable[[], T]) -> T:
        """compute(), remembered under `key` until the samples change."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    @property
    def n(self) -> int:
        return self._samples.count

    def values(self) -> np.ndarray:
        """The samples kept, sorted."""
        if self._sorted is None:
            self._sorted = np.sort(self._samples.array())
        return self._sorted

    def holds_every_sample(self) -> bool:
        """Whether no sample added has been dropped yet."""
        return not self._samples.full

    def mean(self) -> float:
        return self.memo("mean", lambda: float(self.values().mean()) if self.n else 0.0)

    def second_moment(self) -> float:
        return self.memo("second_moment", lambda: float((self.values() ** 2).mean()) if self.n else 0.0)

    def survival(self, t_s: np.ndarray, censored: np.ndarray | None = None) -> np.ndarray:
        """P(duration > t), smoothed with an exponential tail of the same mean. `censored`:
        durations still running (lasted at least that long), counted at risk (Kaplan–Meier),
        so the long stages still under way are not left out of the estimate. With no sample,
        1: a duration never seen to end is not forecast to end (a run's first seconds, before
        any decode or tool call has ended; a mean learned from nothing would be a guess)."""
        x = self.values()
        n = len(x)
        if n == 0:
            return np.ones(np.shape(t_s))
        mean_s = max(self._tail_mean_s(censored), 1e-6)
        tail = np.exp(-np.maximum(t_s, 0.0) / mean_s)
        if censored is None or len(censored) == 0:
            emp = 1.0 - np.searchsorted(x, t_s, side="right") / n
        else:
            c = np.sort(censored)
            at_risk = (n - np.arange(n)) + (len(c) - np.searchsorted(c, x, side="left"))
            km = np.r_[1.0, np.cumprod(1.0 - 1.0 / at_risk)]
            emp = km[np.searchsorted(x, t_s, side="right")]
            beyond = t_s > x[-1]  # past every completed sample: the KM level decays like the tail
            emp = np.where(beyond, km[-1] * np.exp(-(t_s - x[-1]) / mean_s), emp)
        return (n * emp + self.tail_weight * tail) / (n + self.tail_weight)

    def _tail_mean_s(self, censored: np.ndarray | None) -> float:
        """The mean of the exponential tail: the samples' mean, or with stages still running
        the censored maximum-likelihood mean, (completed durations + time the running ones
        have lasted) / completions. The samples' mean alone is what finished first: early in
        a run's first step the few decodes done are the short ones, and a tail of their mean
        ends every long decode still running within seconds (docs/forecasting.md)."""
        running_s = float(np.sum(censored)) if censored is not None else 0.0
        return (float(self.values().sum()) + running_s) / self.n  # survival asks only with samples

    def residual_mass(self, elapsed_s: np.ndarray, step_s: float, slots: int) -> np.ndarray:
        """(len(elapsed), slots): P(end in ((j)·step, (j+1)·step] from now | lasted elapsed)."""
        grid = elapsed_s[:, None] + step_s * np.arange(slots + 1)[None, :]
        surv = self.survival(grid)
        return (surv[:, :-1] - surv[:, 1:]) / np.maximum(surv[:, :1], 1e-300)

    def residual_sums(
        self, bucket: np.ndarray, weights: np.ndarray, step_s: float, slots: int, censored: np.ndarray | None = None
    ) -> np.ndarray:
        """(len(weights), slots): Σ_i weights[m, i] · P(end in slot j | lasted bucket[i]·step_s).

        One survival curve on the grid, the weights summed per bucket, then one matrix
        product with the residual end masses of the buckets in use: O(buckets · slots)
        however many trajectories share the buckets."""
        b_max = int(bucket.max()) if len(bucket) else 0
        surv = self.survival(step_s * np.arange(b_max + slots + 1), censored)
        d_surv = surv[:-1] - surv[1:]
        rows = len(weights)
        per_bucket = np.bincount((bucket + (b_max + 1) * np.arange(rows)[:, None]).ravel(), np.ravel(weights), rows * (b_max + 1))
        used = np.flatnonzero(np.bincount(bucket, minlength=b_max + 1))
        a = per_bucket.reshape(rows, b_max + 1)[:, used] / np.maximum(surv[used], 1e-300)
        return a @ d_surv[used[:, None] + np.arange(slots)]

    def centred_pmf(self, step_s: float, slots: int) -> np.ndarray:
        """P(duration in ((j-½)·step, (j+½)·step]): convolving these keeps the mean in place."""
        surv = self.survival(step_s * (np.arange(slots + 1) - 0.5))
        return surv[:-1] - surv[1:]

    def pmf(self, step_s: float, slots: int) -> np.ndarray:
        """P(duration in (j·step, (j+1)·step]) for a stage that starts now."""
        return self.residual_mass(np.zeros(1), step_s, slots)[0]


class SizedDelays:
    """Delays paired with the sizes they carry: a prefill's time from queued to done, with the
    tokens it computed and their engine-seconds. `shape` is where a flow's mass lands after
    its arrival, each delay weighted by its size: a prefill that misses the cache computes
    its whole context and lands seconds after a hit would, so its tokens land late while the
    hits' land at once (the flow targets count a prefill's compute when it is done)."""

    def __init__(self, columns: int, max_samples: int = 2000) -> None:
        self._rows = Ring(max_samples, 1 + columns)  # each delay and its sizes
        self._memo: dict = {}

    @property
    def n(self) -> int:
        return self._rows.count

    def add_many(self, delays_s: np.ndarray, sizes: np.ndarray) -> None:
        """`sizes`: (len(delays_s), columns); the most recent `max_samples` are kept."""
        if len(delays_s) == 0:
            return
        self._rows.add_many(np.column_stack([np.maximum(delays_s, 0.0), sizes]))  # a delay is never negative
        self._memo.clear()

    def _array(self) -> np.ndarray:
        """(n, 1 + columns): each delay and its sizes."""
        return self._rows.array()

    def shape(self, column: int, step_s: float, slots: int) -> np.ndarray:
        """(slots,): the share of column's mass that lands j slots after its arrival (a delay
        d in slot round(d / step)); what lands past the horizon is left out. No sample, or
        no mass: all of it at once."""
        key = (column, step_s, slots)
        if key not in self._memo:
            rows = self._array()
            weight = np.maximum(rows[:, 1 + column], 0.0)
            out = np.eye(1, slots)[0]
            if weight.sum() > 0:
                slot = np.rint(rows[:, 0] / step_s).astype(np.int64)
                inside = slot < slots
                out = np.bincount(slot[inside], weight[inside], minlength=slots)[:slots] / weight.sum()
            self._memo[key] = out
        return self._memo[key]

    def residual(self, column: int, waited_s: np.ndarray, amounts: np.ndarray, step_s: float, slots: int) -> np.ndarray:
        """(slots,): `amounts` (column's mass) of prefills queued `waited_s` ago and not done
        yet, where they land: each spread as the delays longer than its wait are, from now;
        one waiting longer than any delay seen lands now."""
        return self.residuals({column: amounts}, waited_s, step_s, slots)[column]

    def residuals(self, amounts: dict[int, np.ndarray], waited_s: np.ndarray, step_s: float, slots: int) -> dict[int, np.ndarray]:
        """`residual` of several columns' amounts for the same waits: the delays longer than
        each wait, and the slots they land in, found once for every column."""
        out = {column: np.zeros(slots) for column in amounts}
        if len(waited_s) == 0:
            return out
        rows = self._array()
        delay = rows[:, 0]
        weights = {column: np.maximum(rows[:, 1 + column], 0.0) for column in amounts}
        waited_s = np.maximum(waited_s, 0.0)
        bucket = np.floor(waited_s / step_s).astype(np.int64)
        for b in np.unique(bucket):
            mine = bucket == b
            wait_s = float(waited_s[mine].mean())  # the bucket's waits, as one
            later = delay > wait_s
            slot = None
            for column, column_amounts in amounts.items():
                amount = float(column_amounts[mine].sum())
                later_weight = weights[column][later]
                later_total = later_weight.sum()
                if later_total <= 0:
                    out[column][0] += amount
                    continue
                if slot is None:  # slot j: (j, j+1] steps from now
                    slot = np.minimum(np.floor((delay[later] - wait_s) / step_s).astype(np.int64), slots)
                out[column] += amount * np.bincount(slot, later_weight, minlength=slots + 1)[:slots] / later_total
        return out

    def lagged(self, column: int, arrivals: np.ndarray, step_s: float) -> np.ndarray:
        """`arrivals` (per slot, in units of column's mass) moved to where they land."""
        if self.n == 0:
            return arrivals
        return np.convolve(arrivals, self.shape(column, step_s, len(arrivals)))[: len(arrivals)]


class TurnHazard:
    """P(a trajectory of a family continues after its turn n) for n = 0, 1, …"""

    def __init__(self, max_turns: int = 256, prior_weight: float = 2.0) -> None:
        self.last_turn_counts = np.zeros(max_turns)  # finished trajectories by their last turn index
        self.prior_weight = prior_weight

    def add_finished(self, last_turn: int) -> None:
        self.add_finished_many(np.array([last_turn]))

    def add_finished_many(self, last_turns: np.ndarray) -> None:
        np.add.at(self.last_turn_counts, np.clip(last_turns, 0, len(self.last_turn_counts) - 1), 1)

    @property
    def n(self) -> int:
        return int(self.last_turn_counts.sum())

    def continue_prob(self, live_turns: np.ndarray) -> np.ndarray:
        """c[n] for every n; `live_turns` are the current turns of live trajectories (censored)."""
        size = len(self.last_turn_counts)
        deaths = self.last_turn_counts
        finished_at_or_after = deaths[::-1].cumsum()[::-1]  # finished with last turn >= n
        live = np.bincount(np.clip(live_turns, 0, size - 1), minlength=size)[:size]
        live_beyond = live[::-1].cumsum()[::-1]  # live at a turn >= n ...
        live_after = np.concatenate([live_beyond[1:], [0]])  # ... > n: they survived turn n
        at_risk = finished_at_or_after + live_after
        # the prior: one hazard for every turn, its maximum likelihood with the live ones censored,
        # deaths / turns at risk (a finished trajectory was at risk at turns 0..last, a live one
        # has survived turns 0..turn-1); from the finished alone, early in a run it would be the
        # short trajectories' (the first to finish) and end every trajectory past the live turns
        exposure = float((deaths * (np.arange(size) + 1)).sum()) + float(np.clip(live_turns, 0, None).sum())
        q0 = deaths.sum() / exposure if deaths.sum() > 0 else 0.1  # a death means exposure >= 1
        q = (deaths + self.prior_weight * q0) / (at_risk + self.prior_weight)
        return 1.0 - np.clip(q, 0.0, 1.0)
