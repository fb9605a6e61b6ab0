"""The lifecycle model (the hybrid that corrects its residuals: forecasting.models.hybrid).

For every live trajectory (forecasting.live): from its phase and the time already spent in
it, the probability that the phase ends in each future slot (a fine grid of bin_s/substeps),
then the chain of phases that follows — PRE → DEC → TOOL → PRE … — by convolving the
family's learned duration distributions; at each decode completion the trajectory goes on
with the family's turn-continuation probability. That gives, per slot, the expected

    prefill arrivals (TOOL ends)   × observation tokens (and cache-missed tokens, and their
                                     prefill engine-seconds, each counted when the prefill is
                                     done: the arrivals moved by the family's queued-to-done
                                     delays, weighted by size, `SizedDelays`; the window the
                                     allocator sizes on counts them as asked, `Prediction.asked`)
    decode starts and completions  → decode sequences active; × generation tokens
    plus the start bursts of the RL cadence, in the log's mode (forecasting.live.Cadence):
    sync: the running step's trajectories not started yet (as many as the step before had,
    launched with the learned spread after step_started), and between steps the next step's
    (the learned trainer gap, then that spread); async (no steps): the wave each batch
    opens (as many as a batch consumed, at the learned offset after batch_ready: the
    training time under hold, whose gate opens with the new version), for the running
    cycle and for the next ones, each a learned batch gap after the one before. Families
    in the shares of the cycle before. A start queues its prompt (prompt tokens); its
    first PRE uses the turn-0 queue distribution (a burst queues longer), and its later
    turns are like any other's.

Trajectories that share (family, phase, elapsed slot, turn) share their vectors, so the cost
grows with those groups, not with the number of trajectories; the chains of phases are
walked as spectra (`forecasting.models.chain`). Uncertainty: a compound Poisson spread per slot (variance =
Σ p · E[size²]); the next step's burst arrives as a block (variance N² p (1-p) · size²);
quantiles are normal on that spread. The flows (prefill new and cache-missed tokens, prefill
engine-seconds, decode tokens and engine-seconds) instead take the compound Poisson
distribution itself (forecasting.compound: arrivals per family × its learned sizes, scaled
to the mean where a trajectory's own context prices its next prefill or its decodes): a
per-bin flow is often zero and heavy-tailed, so its point forecast is the median (the one
that minimises the absolute error; `median_flows`), and the quantiles are its own.

Decode engine-seconds are linear in the context a decode reads, so the chains are also
walked with each trajectory weighted by its context (`chain.shared`); the KV footprint
(live_kv_tokens) is the KV of now plus the expected changes those walks give (a decode start
adds its turn's new tokens, a decode end its generated ones or, where the trajectory
finishes, its whole context). The prefill work each live trajectory will ask for, and a
run's opening, are priced in forecasting.models.prefill_work; what the model adds up per
slot is in forecasting.models.slots.
"""

from __future__ import annotations

from typing import Self

import numpy as np

from forecasting.compound import compound_poisson_quantiles
from forecasting.empirical import Empirical
from forecasting.live import DEC, ENGINE_COLUMN, MISS_COLUMN, POOLED, PRE, TOOL, FamilyStats, LiveState, stage_durations, stat
from forecasting.models.base import QUANTILES, FitError, Forecaster, History, Prediction, register
from forecasting.models.chain import PhaseChain, ahead, shared, truncated
from forecasting.models.prefill_work import Opening, next_prefill, opening, waiting, waiting_prefills
from forecasting.models.slots import Block, Flows, SlotDemand
from forecasting.models.timeseries import Naive
from forecasting.series import LIVE_KV

MAX_CYCLES_AHEAD = 4  # async: batch cycles followed within the horizon


def _walked(chain: PhaseChain, ends_by_phase: dict[int, np.ndarray]) -> Flows:
    """The flows that follow the ends of each phase, given as `chain.shared`'s four blocks of rows
    (counts, contexts, finishing counts, finishing contexts), walked along the chain."""
    rows = chain.cycles + 1
    flows_hat = sum(chain.spectrum(phase, ends[:rows]) for phase, ends in ends_by_phase.items())
    decode_hat = sum(
        np.array([chain.spectrum(phase, ends[b * rows : (b + 1) * rows])[DEC] for b in (1, 2, 3)]) for phase, ends in ends_by_phase.items()
    )
    return Flows.of(chain.inverse(flows_hat), chain.inverse(decode_hat))


def _pmf(stage: Empirical, step_s: float, slots: int) -> np.ndarray:
    """The stage's centred pmf on the slot grid, kept until the stage learns a new sample
    (none: a stage never seen to end, `Empirical.survival`)."""
    return stage.memo(("centred_pmf", step_s, slots), lambda: stage.centred_pmf(step_s, slots))


@register
class Lifecycle(Forecaster):
    """substeps: slots per bin; cycles: turns followed ahead; censoring: running stages count
    at risk; median_flows: the point forecast (`Prediction.point`) of each flow (tokens,
    engine-seconds) is its median (in `exact_bins`); `mean` stays its expected value, which
    is what the allocator sizes on."""

    name = "lifecycle"

    def __init__(self, substeps: int = 4, cycles: int = 8, censoring: bool = True, median_flows: bool = True) -> None:
        self.median_flows = median_flows
        # bin indices whose flow distributions are computed exactly (the core sets the ones it
        # publishes and scores; None: every bin); elsewhere the quantiles are normal
        self.exact_bins: tuple[int, ...] | None = None
        self.substeps = substeps
        self.censoring = censoring
        self.cycles = cycles
        self._history: History | None = None
        self._opening: Opening | None = None  # set by update while no decode has started

    def update(self, history: History) -> Self:
        live = history.live
        self._history = self._opening = None  # a failed update leaves nothing to predict from
        if live is None:
            raise FitError("lifecycle: needs the live trajectory state")
        if live.stats[POOLED].stage_s[PRE].n == 0:  # a run's opening: no decode has started yet
            self._opening = opening(live, history.now_s)
            if self._opening is None:
                raise FitError("lifecycle: no prefill finished yet")
        self._history = history
        return self

    def predict(self, horizon_bins: int) -> Prediction:
        if self._history is None:
            raise FitError("lifecycle: predict before update")
        h, live = self._history, self._history.live
        step_s, slots = h.bin_s / self.substeps, horizon_bins * self.substeps
        demand = SlotDemand(slots, live.decode_cost, kv_now=float(live.live_context_tokens()))
        if self._opening is not None:
            self._add_opening(demand, self._opening, step_s)
            self._add_starts(demand, live, step_s, h.now_s)
            return self._to_bins(demand, horizon_bins)
        alive = np.flatnonzero(live.alive)
        family_of = live.family[alive]
        for family in np.flatnonzero(np.bincount(family_of)):
            self._add_family(demand, live, alive[family_of == family], live.family_stats(int(family)), step_s, h.now_s)
        self._add_starts(demand, live, step_s, h.now_s)
        return self._to_bins(demand, horizon_bins)

    # --- per family --------------------------------------------------------------------------
    def _add_family(
        self, demand: SlotDemand, live: LiveState, members: np.ndarray, stats: FamilyStats, step_s: float, now_s: float
    ) -> None:
        pooled = live.stats[POOLED]
        stages = stage_durations(stats, pooled)
        turns = stat(stats, pooled, "turns")
        weights, finishing = ahead(turns.continue_prob(live.turn[members]), self.cycles)
        prompt_pre = stat(stats, pooled, "prompt_pre_s")
        obs, gen = stat(stats, pooled, "obs_tokens"), stat(stats, pooled, "gen_tokens")
        ends_by_phase: dict[int, np.ndarray] = {}  # chains from the same phase add up before the walk (`chain.shared`'s blocks)
        phase_of, turn_of = live.phase[members], live.turn[members]
        groups = [
            (PRE, (phase_of == PRE) & (turn_of == 0), prompt_pre),
            (PRE, (phase_of == PRE) & (turn_of != 0), stages[PRE]),
            (DEC, phase_of == DEC, stages[DEC]),
            (TOOL, phase_of == TOOL, stages[TOOL]),
        ]
        for phase, mask, stage in groups:
            sel = members[mask]
            if len(sel) == 0:
                continue
            elapsed_s = np.maximum(now_s - live.entered_s[sel], 0.0)  # also: the stages still running (censored)
            bucket = np.minimum(np.floor(elapsed_s / step_s).astype(np.int64), 20 * demand.slots)
            first_turn = live.turn[sel] + (1 if phase == TOOL else 0)
            # the context the next decode reads: the history, and this turn's new tokens (a
            # trajectory in a tool call: the observation it will get)
            context = live.context[sel] + (obs.mean() if phase == TOOL else live.queued_new[sel])
            rows = shared(bucket, first_turn, weights, finishing, context, gen.mean() + obs.mean())
            ends = stage.residual_sums(*rows, step_s, demand.slots, elapsed_s if self.censoring else None)
            ends_by_phase[phase] = ends_by_phase[phase] + ends if phase in ends_by_phase else ends
            if phase == DEC:
                demand.decode_active += len(sel)
            if phase == PRE:  # prefills queued now but not yet computed: their compute lands when they are done
                queued = waiting(live, sel)
                engine_s, miss = waiting_prefills(live, stats, pooled, queued)
                waited_s = now_s - live.entered_s[queued]
                delays = stat(stats, pooled, "prompt_delays" if stage is prompt_pre else "prefill_delays")
                landed = delays.residuals({MISS_COLUMN: miss, ENGINE_COLUMN: engine_s}, waited_s, step_s, demand.slots)
                demand.add_prefill(
                    landed[MISS_COLUMN],
                    landed[ENGINE_COLUMN],
                    demand.now(miss.sum()),
                    demand.now(engine_s.sum()),
                )
                # the KV this turn adds by its decode: its new tokens unless prefilled already
                # (in place of the family's mean observation, which the chain adds at every PRE end)
                own = np.where(live.prefilled[sel], 0.0, live.queued_new[sel]) - obs.mean()
                demand.kv_delta += stage.residual_sums(bucket, own[None, :], step_s, demand.slots, elapsed_s if self.censoring else None)[0]
            if phase == TOOL and stat(stats, pooled, "cached_share").n:  # the next prefill: on this trajectory's context
                engine_s, miss = next_prefill(live, stats, pooled, sel, obs.mean(), obs.second_moment())
                own = np.array([engine_s - stat(stats, pooled, "engine_s").mean(), miss - stat(stats, pooled, "miss_tokens").mean()])
                first = stage.residual_sums(bucket, own, step_s, demand.slots, elapsed_s if self.censoring else None)
                delays = stat(stats, pooled, "prefill_delays")  # ... computed when its prefill is done
                # in place of the family's mean size for the first arrival
                demand.add_prefill(
                    delays.lagged(MISS_COLUMN, first[1], step_s), delays.lagged(ENGINE_COLUMN, first[0], step_s), first[1], first[0]
                )
        chain = PhaseChain(np.array([_pmf(st, step_s, demand.slots) for st in stages]), self.cycles)
        self._add_sizes(demand, _walked(chain, ends_by_phase), stats, pooled, step_s, turn0=False)

    def _add_sizes(
        self, demand: SlotDemand, flows: Flows, stats: FamilyStats, pooled: FamilyStats, step_s: float, turn0: bool, block: float = 0.0
    ) -> None:
        """block > 0: the arrivals come as blocks of that many (a start burst), so each
        flow's distribution has blocks, not single arrivals, as its items."""
        obs = stat(stats, pooled, "prompt_tokens" if turn0 else "obs_tokens")
        miss = stat(stats, pooled, "prompt_miss_tokens" if turn0 else "miss_tokens")
        engine = stat(stats, pooled, "prompt_engine_s" if turn0 else "engine_s")
        gen = stat(stats, pooled, "gen_tokens")
        decode_s = stat(stats, pooled, "decode_engine_s")  # its sizes; its mean from each decode's context:
        a, k = demand.decode_cost.per_token_s, demand.decode_cost.per_token_pair_s  # E = a·E[g] + k·(C·E[g] + E[g²]/2)
        demand.new_tokens += flows.arrivals * obs.mean()
        # a prefill's compute counts when it is done: its arrival moved by its size's delay
        delays = stat(stats, pooled, "prompt_delays" if turn0 else "prefill_delays")
        done = {column: delays.lagged(column, flows.arrivals, step_s) for column in (MISS_COLUMN, ENGINE_COLUMN)}
        # a wave's prompts are queued as one block, but done one by one as the queue drains
        demand.compound["prefill_new_tokens"].append((flows.arrivals / block, Block(obs, block)) if block > 0 else (flows.arrivals, obs))
        demand.compound["prefill_miss_tokens"].append((done[MISS_COLUMN], miss))
        demand.compound["prefill_engine_s"].append((done[ENGINE_COLUMN], engine))
        demand.compound["decode_tokens"].append((flows.ends, gen))
        demand.compound["decode_engine_s"].append((flows.ends, decode_s))
        demand.add_prefill(
            done[MISS_COLUMN] * miss.mean(),
            done[ENGINE_COLUMN] * engine.mean(),
            flows.arrivals * miss.mean(),
            flows.arrivals * engine.mean(),
        )
        demand.decode_tokens += flows.ends * gen.mean()
        demand.decode_engine_s += flows.ends * (a * gen.mean() + k * gen.second_moment() / 2.0) + flows.ends_context * k * gen.mean()
        # the live KV: a decode start adds its turn's new tokens, a decode end its generated
        # ones, or lets the whole context go where the trajectory finishes
        going_on = flows.ends - flows.finishes
        demand.kv_delta += flows.starts * obs.mean() + going_on * gen.mean() - flows.finish_context
        let_go_squared = np.divide(flows.finish_context**2, flows.finishes, out=np.zeros(demand.slots), where=flows.finishes > 1e-12)
        demand.var[LIVE_KV] += flows.starts * obs.second_moment() + np.abs(going_on) * gen.second_moment() + let_go_squared
        occupancy = np.cumsum(flows.starts - flows.ends)
        demand.decode_active += occupancy
        demand.var["prefill_new_tokens"] += flows.arrivals * obs.second_moment()
        demand.var["prefill_miss_tokens"] += done[MISS_COLUMN] * miss.second_moment()
        demand.var["prefill_engine_s"] += done[ENGINE_COLUMN] * engine.second_moment()
        demand.var["decode_tokens"] += flows.ends * gen.second_moment()
        demand.var["decode_engine_s"] += flows.ends * decode_s.second_moment()
        demand.var["decode_active_seqs"] += np.abs(occupancy)

    # --- a run's opening ------------------------------------------------------------------------
    @staticmethod
    def _add_opening(demand: SlotDemand, queue: Opening, step_s: float) -> None:
        """Before the first decode starts (`prefill_work.opening`): every prompt queued now starts
        decoding when the queue has drained, and none ends within the horizon (no decode has
        been seen to end); the waiting prefills are done, and their prompts held, evenly
        until the queue drains."""
        first = int(queue.drain_s / step_s)
        if first < demand.slots:
            demand.decode_active[first:] += queue.queued
        draining = np.arange(demand.slots) <= first
        demand.add_prefill(
            draining * queue.waiting_miss_tokens / (first + 1),
            draining * queue.waiting_engine_s / (first + 1),
            demand.now(queue.waiting_miss_tokens),
            demand.now(queue.waiting_engine_s),
        )
        demand.kv_delta[draining] += queue.waiting_new_tokens / (first + 1)

    # --- start bursts: sync steps or async batch cycles (LiveState.cadence) ---------------------
    def _add_starts(self, demand: SlotDemand, live: LiveState, step_s: float, now_s: float) -> None:
        """Trajectories still to start: the running cycle's pending ones, then the next
        cycles' (sync: the next step, once the rollout is done; async: each batch's wave, the
        batches' gap apart), in the families' shares of the cycle before."""
        cad = live.cadence(now_s)
        if cad.pending and cad.offsets.n:
            waited = np.array([int(cad.since_anchor_s / step_s)])
            p = cad.pending_chance * cad.offsets.residual_sums(waited, np.ones((1, 1)), step_s, demand.slots)[0]
            self._add_burst(demand, live, cad.pending, cad.pending_mix, p, step_s, cad.waves)
        if cad.next_waited_s is None or cad.gap.n == 0 or cad.next_size == 0:
            return
        waited = np.array([int(cad.next_waited_s / step_s)])
        anchor = cad.gap.residual_sums(waited, np.ones((1, 1)), step_s, demand.slots)[0]  # P(next anchor in slot j)
        anchor = anchor * cad.next_chance  # ... that brings starts
        for _ in range(MAX_CYCLES_AHEAD if cad.waves else 1):
            p = np.convolve(anchor, cad.offsets.centred_pmf(step_s, demand.slots))[: demand.slots] if cad.offsets.n else anchor
            self._add_burst(demand, live, cad.next_size, cad.next_mix, p, step_s, cad.waves)
            anchor = truncated(anchor, _pmf(cad.gap, step_s, demand.slots))  # the cycle after: one more gap
            if anchor.sum() < 1e-3:
                break

    def _add_burst(
        self, demand: SlotDemand, live: LiveState, size: float, mix: dict[int, float], p: np.ndarray, step_s: float, wave: bool
    ) -> None:
        """`size` trajectories that start in each slot with probability p, in the families'
        shares `mix` (pooled statistics where it is empty); `wave`: all at once (async)."""
        pooled = live.stats[POOLED]
        prompt_new = prompt_miss = prompt_engine_s = 0.0  # a start's expected prompt and its prefill compute
        for key, share in ({live.families[f]: share for f, share in mix.items()} or {POOLED: 1.0}).items():
            stats = live.stats[key]
            self._add_family_starts(demand, stats, pooled, size * share, p, step_s, wave)
            prompt_new += share * stat(stats, pooled, "prompt_tokens").mean()
            prompt_miss += share * stat(stats, pooled, "prompt_miss_tokens").mean()
            prompt_engine_s += share * stat(stats, pooled, "prompt_engine_s").mean()
        burst_var = size**2 * p * (1 - np.minimum(p, 1.0))
        delays = pooled.prompt_delays  # the burst's compute is done as its queue drains
        demand.var["prefill_new_tokens"] += burst_var * prompt_new**2
        demand.var["prefill_miss_tokens"] += delays.lagged(MISS_COLUMN, burst_var, step_s) * prompt_miss**2
        demand.var["prefill_engine_s"] += delays.lagged(ENGINE_COLUMN, burst_var, step_s) * prompt_engine_s**2

    def _add_family_starts(
        self, demand: SlotDemand, stats: FamilyStats, pooled: FamilyStats, size: float, p: np.ndarray, step_s: float, wave: bool
    ) -> None:
        stages = stage_durations(stats, pooled)
        turns = stat(stats, pooled, "turns")
        weights, finish = (w[:, 0] for w in ahead(turns.continue_prob(np.zeros(0, np.int64)), self.cycles))
        chain = PhaseChain(np.array([_pmf(st, step_s, demand.slots) for st in stages]), self.cycles)
        prompt_pre = stat(stats, pooled, "prompt_pre_s")
        first_pre = _pmf(prompt_pre, step_s, demand.slots) if prompt_pre.n else _pmf(stages[PRE], step_s, demand.slots)
        # a start queues its prompt (an arrival of prompt size); its first PRE is the prompt's
        first_ends = size * truncated(p, first_pre)
        prompt, obs = stat(stats, pooled, "prompt_tokens").mean(), stat(stats, pooled, "obs_tokens").mean()
        read = prompt + (stat(stats, pooled, "gen_tokens").mean() + obs) * np.arange(len(weights))  # the m-th decode's context
        blocks = np.vstack([w[:, None] * first_ends for w in (weights, weights * read, finish, finish * read)])  # as `chain.shared`'s
        self._add_sizes(demand, _walked(chain, {PRE: blocks}), stats, pooled, step_s, turn0=False)
        demand.kv_delta += first_ends * (prompt - obs)  # the first decode start adds the prompt, not an observation
        # a wave's prompts arrive together: one block of `size` with probability p
        self._add_sizes(demand, Flows.none(size * p), stats, pooled, step_s, turn0=True, block=size if wave else 0.0)

    # --- slots → bins ------------------------------------------------------------------------
    def _to_bins(self, d: SlotDemand, horizon_bins: int) -> Prediction:
        def flow(x: np.ndarray) -> np.ndarray:
            return x.reshape(horizon_bins, self.substeps).sum(axis=1)

        def level(x: np.ndarray) -> np.ndarray:
            return x.reshape(horizon_bins, self.substeps).mean(axis=1)

        def at_end(x: np.ndarray) -> np.ndarray:
            return x.reshape(horizon_bins, self.substeps)[:, -1]

        mean = {
            LIVE_KV: d.kv_now + at_end(np.cumsum(d.kv_delta)),
            "prefill_new_tokens": flow(d.new_tokens),
            "prefill_miss_tokens": flow(d.miss_tokens),
            "prefill_engine_s": flow(d.engine_s),
            "decode_active_seqs": level(d.decode_active),
            "decode_tokens": flow(d.decode_tokens),
            "decode_engine_s": flow(d.decode_engine_s),
        }
        var = {t: level(v) if t == "decode_active_seqs" else at_end(np.cumsum(v)) if t == LIVE_KV else flow(v) for t, v in d.var.items()}
        prediction = Prediction.normal(mean, {t: np.sqrt(np.maximum(v, 0.0)) for t, v in var.items()})
        prediction.asked.update(
            {"prefill_miss_tokens": np.maximum(flow(d.miss_asked), 0.0), "prefill_engine_s": np.maximum(flow(d.engine_s_asked), 0.0)}
        )
        bins = np.arange(horizon_bins) if self.exact_bins is None else np.array([b for b in self.exact_bins if b < horizon_bins], np.int64)
        for target, sources in d.compound.items():  # the compound Poisson distribution of items × sizes
            if not sources or not len(bins):
                continue
            rates = np.array([flow(r)[bins] for r, _ in sources])
            quantiles = compound_poisson_quantiles(rates, [sizes.values() for _, sizes in sources], QUANTILES)
            # sized by the family means; the mean also has each trajectory's own next prefill
            # (its context) and the prefills waiting now: scale to it
            family_mean = sum(r * sizes.mean() for r, sizes in zip(rates, (z for _, z in sources)))
            want = mean[target][bins]
            scale = np.divide(want, family_mean, out=np.ones_like(family_mean), where=family_mean > 1e-12)
            prediction.quantiles[target][:, bins] = np.where(family_mean > 1e-12, quantiles * scale, want)
            if self.median_flows:  # the median where it was computed, the mean elsewhere
                point = mean[target].copy()
                point[bins] = prediction.quantiles[target][QUANTILES.index(0.5), bins]
                prediction.point[target] = point
        return prediction


__all__ = ["Lifecycle", "Naive"]
