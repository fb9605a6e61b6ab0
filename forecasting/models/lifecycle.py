"""The lifecycle model, and a hybrid that corrects its residuals with a time-series model.

For every live trajectory (forecasting.live): from its phase and the time already spent in
it, the probability that the phase ends in each future slot (a fine grid of bin_s/substeps),
then the chain of phases that follows — PRE → DEC → TOOL → PRE … — by convolving the
family's learned duration distributions; at each decode completion the trajectory goes on
with the family's turn-continuation probability. That gives, per slot, the expected

    prefill arrivals (TOOL ends)   × observation tokens (and cache-missed tokens)
    decode starts and completions  → decode sequences active; × generation tokens
    plus the sync-RL steps' start bursts: the running step's trajectories not started yet
    (as many as the step before had, launched with the learned spread after step_started),
    and between steps the next step's (the learned trainer gap, then that spread). A
    prompt's first PRE uses the turn-0 queue distribution: a burst queues longer.

Trajectories that share (family, phase, elapsed slot) share their vectors, so the cost
grows with those groups, not with the number of trajectories. Uncertainty: a compound
Poisson spread per slot (variance = Σ p · E[size²]); the next step's burst arrives as a
block (variance N² p (1-p) · size²). Quantiles are normal on that spread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Self

import numpy as np

from forecasting.live import DEC, POOLED, PRE, TOOL, FamilyStats, LiveState
from forecasting.models.base import TARGETS, FitError, Forecaster, History, Prediction, register
from forecasting.models.timeseries import Naive


@dataclass(slots=True)
class _Demand:
    """Expected demand per fine slot, and its variance."""

    slots: int
    new_tokens: np.ndarray = field(init=False)
    miss_tokens: np.ndarray = field(init=False)
    decode_tokens: np.ndarray = field(init=False)
    decode_active: np.ndarray = field(init=False)
    var: dict[str, np.ndarray] = field(init=False)

    def __post_init__(self) -> None:
        for name in ("new_tokens", "miss_tokens", "decode_tokens", "decode_active"):
            setattr(self, name, np.zeros(self.slots))
        self.var = {t: np.zeros(self.slots) for t in TARGETS}


@dataclass(slots=True)
class _Flows:
    arrivals: np.ndarray
    starts: np.ndarray
    ends: np.ndarray


def _chain(phase: int, ends_by_cycle: np.ndarray, pmfs: list[np.ndarray], slots: int, first_pre: np.ndarray | None = None) -> _Flows:
    """Walk the phase chain from `phase`: ends_by_cycle[m] is the current phase's end mass
    weighted by the probability of going on through m more decode completions. The first
    PRE entered uses `first_pre` where given (a new trajectory's prompt)."""
    flows = _Flows(np.zeros(slots), np.zeros(slots), np.zeros(slots))
    kernel: np.ndarray | None = None
    m, stage = 0, phase
    if first_pre is not None:
        pmfs = list(pmfs)
        pmfs[PRE], later_pre = first_pre, pmfs[PRE]
    while m < len(ends_by_cycle):
        mass = ends_by_cycle[m] if kernel is None else np.convolve(ends_by_cycle[m], kernel)[:slots]
        if stage == PRE:
            flows.starts += mass
        elif stage == DEC:
            flows.ends += mass
            m += 1  # past a decode completion only the continuing share goes on
        else:
            flows.arrivals += mass
        stage = (stage + 1) % 3
        kernel = pmfs[stage] if kernel is None else np.convolve(kernel, pmfs[stage])[:slots]
        if stage == PRE and first_pre is not None:
            pmfs[PRE] = later_pre
    return flows


def _continuation_weights(cont: np.ndarray, first_turn: np.ndarray, cycles: int) -> np.ndarray:
    """(cycles + 1, n): W[m] = P(the trajectory goes on past its next m decode completions)."""
    top = len(cont) - 1
    weights = np.ones((cycles + 1, len(first_turn)))
    for m in range(1, cycles + 1):
        weights[m] = weights[m - 1] * cont[np.minimum(first_turn + m - 1, top)]
    return weights


def _stat(stats: FamilyStats, pooled: FamilyStats, name: str):
    own = getattr(stats, name)
    return own if own.n else getattr(pooled, name)


@register
class Lifecycle(Forecaster):
    name = "lifecycle"

    def __init__(self, substeps: int = 4, cycles: int = 8, censoring: bool = True) -> None:
        self.substeps = substeps
        self.censoring = censoring
        self.cycles = cycles
        self._history: History | None = None

    def update(self, history: History) -> Self:
        live = history.live
        if live is None:
            raise FitError("lifecycle: needs the live trajectory state")
        pooled = live.stats[POOLED]
        if min(e.n for e in pooled.stage_s) == 0:
            raise FitError("lifecycle: no completed prefill, decode and tool phase seen yet")
        self._history = history
        return self

    def predict(self, horizon_bins: int) -> Prediction:
        if self._history is None:
            raise FitError("lifecycle: predict before update")
        h, live = self._history, self._history.live
        step_s, slots = h.bin_s / self.substeps, horizon_bins * self.substeps
        demand = _Demand(slots)
        alive = np.flatnonzero(live.alive)
        for family in np.unique(live.family[alive]):
            members = alive[live.family[alive] == family]
            self._add_family(demand, live, members, live.family_stats(int(family)), step_s, h.now_s)
        self._add_starts(demand, live, step_s, h.now_s)
        return self._to_bins(demand, horizon_bins)

    # --- per family --------------------------------------------------------------------------
    def _add_family(self, demand: _Demand, live: LiveState, members: np.ndarray, stats: FamilyStats, step_s: float, now_s: float) -> None:
        pooled = live.stats[POOLED]
        stages = [st if st.n else pooled.stage_s[i] for i, st in enumerate(stats.stage_s)]
        pmfs = [st.centred_pmf(step_s, demand.slots) for st in stages]
        turns = stats.turns if stats.turns.n else pooled.turns
        cont = turns.continue_prob(live.turn[members])
        prompt_pre = _stat(stats, pooled, "prompt_pre_s")
        flows = _Flows(np.zeros(demand.slots), np.zeros(demand.slots), np.zeros(demand.slots))
        groups = [(PRE, (live.phase[members] == PRE) & (live.turn[members] == 0), prompt_pre),
                  (PRE, (live.phase[members] == PRE) & (live.turn[members] != 0), stages[PRE]),
                  (DEC, live.phase[members] == DEC, stages[DEC]), (TOOL, live.phase[members] == TOOL, stages[TOOL])]  # fmt: skip
        for phase, mask, stage in groups:
            sel = members[mask]
            if len(sel) == 0:
                continue
            elapsed_s = np.maximum(now_s - live.entered_s[sel], 0.0)  # also: the stages still running (censored)
            bucket = np.minimum(np.floor(elapsed_s / step_s).astype(np.int64), 20 * demand.slots)
            first_turn = live.turn[sel] + (1 if phase == TOOL else 0)
            weights = _continuation_weights(cont, first_turn, self.cycles)
            ends = stage.residual_sums(bucket, weights, step_s, demand.slots, elapsed_s if self.censoring else None)
            part = _chain(phase, ends, pmfs, demand.slots)
            flows.arrivals += part.arrivals
            flows.starts += part.starts
            flows.ends += part.ends
            if phase == DEC:
                demand.decode_active += len(sel)
            if phase == PRE:  # prefills queued now but not yet computed: their miss lands next
                waiting = int((~live.prefilled[sel]).sum())
                demand.miss_tokens[0] += waiting * _stat(stats, pooled, "miss_tokens").mean()
        self._add_sizes(demand, flows, stats, pooled, turn0=False)

    def _add_sizes(self, demand: _Demand, flows: _Flows, stats: FamilyStats, pooled: FamilyStats, turn0: bool) -> None:
        obs = _stat(stats, pooled, "prompt_tokens" if turn0 else "obs_tokens")
        miss = _stat(stats, pooled, "prompt_miss_tokens" if turn0 else "miss_tokens")
        gen = _stat(stats, pooled, "gen_tokens")
        demand.new_tokens += flows.arrivals * obs.mean()
        demand.miss_tokens += flows.arrivals * miss.mean()
        demand.decode_tokens += flows.ends * gen.mean()
        occupancy = np.cumsum(flows.starts - flows.ends)
        demand.decode_active += occupancy
        demand.var["prefill_new_tokens"] += flows.arrivals * obs.second_moment()
        demand.var["prefill_miss_tokens"] += flows.arrivals * miss.second_moment()
        demand.var["decode_tokens"] += flows.ends * gen.second_moment()
        demand.var["decode_active_seqs"] += np.abs(occupancy)

    # --- sync-RL start bursts ----------------------------------------------------------------
    def _add_starts(self, demand: _Demand, live: LiveState, step_s: float, now_s: float) -> None:
        """Trajectories still to start: the running step's pending ones, or the next step's."""
        pending = live.pending_starts()
        offsets = live.start_offset_s
        if pending and offsets.n:
            waited = np.array([int(max(now_s - live.step_started_s, 0.0) / step_s)])
            self._add_burst(demand, live, pending, offsets.residual_sums(waited, np.ones((1, 1)), step_s, demand.slots)[0], step_s)
        size = live.last_step_size()
        if live.step_pending_since_s is None or live.step_gap_s.n == 0 or size == 0:
            return
        waited = np.array([int(max(now_s - live.step_pending_since_s, 0.0) / step_s)])
        p = live.step_gap_s.residual_sums(waited, np.ones((1, 1)), step_s, demand.slots)[0]
        if offsets.n:
            p = np.convolve(p, offsets.centred_pmf(step_s, demand.slots))[: demand.slots]
        self._add_burst(demand, live, size, p, step_s)

    def _add_burst(self, demand: _Demand, live: LiveState, size: int, p: np.ndarray, step_s: float) -> None:
        pooled = live.stats[POOLED]
        cont = pooled.turns.continue_prob(np.zeros(0, np.int64))
        weights = _continuation_weights(cont, np.zeros(1, np.int64), self.cycles)[:, 0]
        ends = size * weights[:, None] * p[None, :]
        pmfs = [st.centred_pmf(step_s, demand.slots) for st in pooled.stage_s]
        first_pre = pooled.prompt_pre_s.centred_pmf(step_s, demand.slots) if pooled.prompt_pre_s.n else None
        flows = _chain(TOOL, ends, pmfs, demand.slots, first_pre)  # a start is an arrival, like a tool end
        self._add_sizes(demand, flows, pooled, pooled, turn0=True)
        burst_var = size**2 * p * (1 - np.minimum(p, 1.0))
        demand.var["prefill_new_tokens"] += burst_var * pooled.prompt_tokens.mean() ** 2
        demand.var["prefill_miss_tokens"] += burst_var * pooled.prompt_miss_tokens.mean() ** 2

    # --- slots → bins ------------------------------------------------------------------------
    def _to_bins(self, d: _Demand, horizon_bins: int) -> Prediction:
        def flow(x: np.ndarray) -> np.ndarray:
            return x.reshape(horizon_bins, self.substeps).sum(axis=1)

        def level(x: np.ndarray) -> np.ndarray:
            return x.reshape(horizon_bins, self.substeps).mean(axis=1)

        mean = {
            "prefill_new_tokens": flow(d.new_tokens),
            "prefill_miss_tokens": flow(d.miss_tokens),
            "decode_active_seqs": level(d.decode_active),
            "decode_tokens": flow(d.decode_tokens),
        }
        var = {t: (level if t == "decode_active_seqs" else flow)(v) for t, v in d.var.items()}
        return Prediction.normal(mean, {t: np.sqrt(np.maximum(v, 0.0)) for t, v in var.items()})


@register
class Hybrid(Forecaster):
    """Lifecycle forecast + per-(target, horizon) exponentially smoothed residual (ETS(A,N,N))."""

    name = "hybrid"

    def __init__(self, alpha: float = 0.1, **lifecycle_params) -> None:
        self.alpha = alpha
        self.base = Lifecycle(**lifecycle_params)
        self._issued: dict[int, Prediction] = {}  # closed-bin count at issue -> base prediction
        self._bias: dict[str, np.ndarray] = {}
        self._seen = 0
        self._base_ok = False

    def update(self, history: History) -> Self:
        self._learn_residuals(history)
        self._seen = history.n_bins
        self.base.update(history)
        return self

    def _learn_residuals(self, history: History) -> None:
        for closed in range(self._seen, history.n_bins):  # bin index `closed` just got its value
            for issued_at, pred in list(self._issued.items()):
                h = closed - issued_at  # issued when `issued_at` bins were closed: bin issued_at is h=1
                horizon = len(next(iter(pred.mean.values())))
                if h < 0 or h >= horizon:
                    continue
                for t in TARGETS:
                    bias = self._bias.setdefault(t, np.zeros(horizon))
                    if len(bias) < horizon:
                        bias = self._bias[t] = np.concatenate([bias, np.zeros(horizon - len(bias))])
                    residual = history.series[t][closed] - pred.mean[t][h]
                    bias[h] += self.alpha * (residual - bias[h])
        oldest = history.n_bins - max((len(next(iter(p.mean.values()))) for p in self._issued.values()), default=0)
        for issued_at in [k for k in self._issued if k < oldest]:
            del self._issued[issued_at]

    def predict(self, horizon_bins: int) -> Prediction:
        base = self.base.predict(horizon_bins)
        self._issued[self._seen] = base
        mean, quantiles = {}, {}
        for t in TARGETS:
            shift = self._bias.get(t, np.zeros(horizon_bins))[:horizon_bins]
            shift = np.pad(shift, (0, horizon_bins - len(shift)))
            mean[t] = np.maximum(base.mean[t] + shift, 0.0)
            quantiles[t] = np.maximum(base.quantiles[t] + shift[None, :], 0.0)
        return Prediction(mean, quantiles)


__all__ = ["Hybrid", "Lifecycle", "Naive"]
