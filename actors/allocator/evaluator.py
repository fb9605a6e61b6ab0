"""The evaluator (pure): for every arrangement, the time to finish the work left, and the best.

`allocator.decision = "evaluator"`. Candidates: every engine colocated (index 0) and every
P:D split (index P, 1 .. n-1). For the arrangement now, c, and each candidate a:

    finish_s(a) = h x pace(a) / pace(c)  +  (remaining_s - h) x pace'(a) / pace'(c)  +  switch_engine_s(c -> a) / n

* remaining_s: the live trajectories' mean model seconds of work left at the pace of now
  (`Demand.remaining_s`, the forecaster's; the horizon where it is not known yet). The
  oracle's are a recorded run's, timed in that run's arrangement: c is then that arrangement
  in the paces (`Inputs.timed_in`), and stays the fleet's in the switch costs;
* h: the forecast horizon's seconds of it (at most remaining_s), paced at the horizon's
  demand; pace': the rest, paced at the live trajectories' mean demand while their work
  lasts (`Demand.over_work_left`, Little's law: a step's opening burst is the horizon's, not
  the step's). Where that mean is not known (a turn not timed, an append's size not
  measured) or the fleet is saturated, pace' = pace;
* pace(a): how long a turn takes in a, relative to now:
  - a saturated fleet (throughput.py: its live KV past what the fleet holds, engines that
    queue what does not fit), 1 / the decode tokens per second a turns over;
  - elsewhere, where a turn's stages have been timed (`Inputs.stage_s`: queued and prefilling,
    decoding, in its tool call), each stage scaled from c to a: a prefill token's wait and
    compute as a single-server queue, s / (1 - u) (`prefill_latency`); a decode token's step
    at the batch a holds, stretched by DP-attention lockstep or vLLM's eager mixed step
    (`tpot`); the tool call unchanged;
  - before any turn is timed, max(1, utilisation of a's busiest stage) (loads.py, at the
    measured capacities): headroom is no saving, so a split never buys it;
* switch_engine_s: drains, reconfiguration and the KV a split relocates (loads.py), in
  engine-seconds, spread over the fleet's n engines.

`best` is the candidate that finishes first, the arrangement of now on a tie; whether to
move there (another best for several decisions, a net gain of at least the switch's cost,
and a resize's way back, `return_engine_s`) is the policy's (`Split._evaluate`). A split whose decode side cannot hold what it must keep
(without queueing admission) is no candidate: it would preempt and recompute without end.
Every figure of a decision is in `Evaluation.note()`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from actors.allocator.capacity import Capacity
from actors.allocator.loads import bottleneck, colocated_load, decode_side_holds, relocation_s, resize_cost_s, stage_loads
from actors.allocator.state import Demand

# a stage's utilisation is read at most this high: past it the queue model's wait has no bound [A]
MAX_UTILISATION = 0.95


@dataclass(frozen=True, slots=True)
class Inputs:
    """What one evaluation reads: the demand as each arrangement would see it (its prefill work
    per new token, `Split._as_in`), the capacities, and the fleet."""

    colocated_demand: Demand
    split_demand: Demand
    cap: Capacity
    n: int
    current: int  # prefill engines now (0: colocated)
    util: float  # allocator.prefill_target_util
    drain_s: float  # allocator.drain_deadline_s
    remaining_s: float
    # a turn's seconds queued and prefilling, decoding, in its tool call, as measured now (0s: not known)
    stage_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # saturated fleets: decode tokens per second per candidate (index as above), else None
    rates: list[float] | None = None
    colocation: bool = True  # False: `allocator.colocation = "never"`, colocation is no candidate
    # the demand after the horizon, as each arrangement would see it (colocated, split): the
    # live trajectories' mean while their work left lasts (`Demand.over_work_left`); None:
    # the horizon's demand stands for all of it
    later: tuple[Demand, Demand] | None = None
    horizon_s: float = 0.0  # the forecast horizon `colocated_demand` and `split_demand` are of
    # the arrangement `stage_s` and `remaining_s` were timed in (-1: `current`; the oracle's are
    # a recorded run's, `Demand.stages_timed_in`)
    timed_in: int = -1

    @property
    def now_ruled_out(self) -> bool:
        """The fleet is colocated where the operator ruled colocation out: it leaves at once."""
        return self.current == 0 and not self.colocation

    @property
    def timed(self) -> int:
        """The arrangement the paces are scaled from and the work left is timed in: where the
        stages were timed (the arrangement of now, unless given), or now's for a saturated
        fleet's rates, which are not scaled from a timing."""
        return self.current if self.timed_in < 0 or self.rates is not None else self.timed_in

    def after_horizon(self) -> Inputs | None:
        """These inputs at the demand after the horizon; None where the horizon's stands for
        all the work left (no later demand, a saturated fleet's rates, no work past the horizon)."""
        if self.later is None or self.rates is not None or self.remaining_s <= self.horizon_s:
            return None
        return dataclasses.replace(self, colocated_demand=self.later[0], split_demand=self.later[1], later=None)


@dataclass(frozen=True, slots=True)
class Evaluation:
    finish_s: list[float]  # per candidate (inf: not a candidate)
    pace: list[float]
    cost_s: list[float]  # engine-seconds of the switch from now
    current: int
    remaining_s: float

    @property
    def best(self) -> int:
        return min(range(len(self.finish_s)), key=lambda a: (self.finish_s[a], a != self.current))

    def gain_engine_s(self, n: int) -> float:
        """Engine-seconds the best saves over staying."""
        return (self.finish_s[self.current] - self.finish_s[self.best]) * n

    def note(self) -> str:
        def name(a: int) -> str:
            return "colocated" if a == 0 else f"{a}:{len(self.finish_s) - a}"

        shown = [a for a in range(len(self.finish_s)) if math.isfinite(self.finish_s[a])]
        return f"over {self.remaining_s:.0f} s left: " + ", ".join(
            f"{name(a)} {self.finish_s[a]:.0f} s (pace {self.pace[a] / self.pace[self.current]:.2f}, switch {self.cost_s[a]:.0f} engine-s)"
            for a in shown
        )


def pace(inputs: Inputs, a: int) -> float:
    """How long the work takes in arrangement `a`, relative to its own pace (module docstring)."""
    if inputs.rates is not None:
        rate = inputs.rates[a]
        return 1.0 / rate if rate > 0 else math.inf
    prefill_s, decode_s, tool_s = inputs.stage_s
    if prefill_s + decode_s > 0:  # a turn's stages as measured, each scaled from where they were timed to `a`
        c = inputs.timed
        return prefill_s * prefill_latency(inputs, a) / prefill_latency(inputs, c) + decode_s * tpot(inputs, a) / tpot(inputs, c) + tool_s
    if a == 0:
        return max(1.0, colocated_load(inputs.colocated_demand, inputs.cap, inputs.util, inputs.n) / inputs.n)
    return max(1.0, bottleneck(stage_loads(inputs.split_demand, inputs.cap, inputs.util), a, inputs.n))


def tpot(inputs: Inputs, a: int) -> float:
    """Seconds per decode token of a sequence in arrangement `a`: its engine's step at the batch
    it holds (the decoding sequences over the engines that decode; past the KV-bound batch the
    rest wait their turn), held while a rank of a lockstep group prefills ((1 - p)^R of the
    time decodes, p a rank's prefill share; without lockstep a mixed step's eager penalty)."""
    cap = inputs.cap
    colocated = a == 0
    demand = inputs.colocated_demand if colocated else inputs.split_demand
    engines = inputs.n if colocated else inputs.n - a
    full = cap.colocated_kv_seqs if colocated else cap.decode_kv_seqs
    batch = max(1.0, demand.decode_seqs / engines)
    step_s = cap.kv_step_s_at(min(batch, full), colocated) * max(1.0, batch / full)
    # the flow of prefill work: the backlog of now is queued once, not a share of every step
    if colocated:
        tokens_s, s_per_token, ranks = (
            demand.prefill_flow_tokens_per_s,
            cap.prefill_s_at(demand.prefill_attention_tokens, True),
            cap.colocated_lockstep_ranks,
        )
    else:  # a decode engine prefills the appends that stay where their KV is
        tokens_s, s_per_token, ranks = (
            demand.prefill_flow_tokens_per_s * (1.0 - demand.remote_share),
            cap.decode_prefill_s_per_token,
            cap.decode_lockstep_ranks,
        )
    share = min(MAX_UTILISATION, tokens_s * s_per_token / engines)
    if ranks > 1:
        return step_s / (1.0 - share) ** ranks
    return step_s * (1.0 + (cap.colocated_mixed_penalty if colocated else 0.0) * share)


def prefill_latency(inputs: Inputs, a: int) -> float:
    """Seconds a prefill token waits and computes in arrangement `a`: its cost on the engines
    that prefill it, over their idle share (a single-server queue's 1 / (1 - u))."""
    cap = inputs.cap
    if a == 0:
        demand, engines = inputs.colocated_demand, inputs.n
        s_per_token, tokens_s = cap.prefill_s_at(demand.prefill_attention_tokens, True), demand.prefill_flow_tokens_per_s
    else:
        demand, engines = inputs.split_demand, a
        s_per_token, tokens_s = cap.prefill_s_at(demand.prefill_attention_tokens), demand.prefill_flow_tokens_per_s * demand.remote_share
    busy = min(MAX_UTILISATION, tokens_s * s_per_token / engines)
    return s_per_token / (1.0 - busy)


def switch_engine_s(inputs: Inputs, a: int) -> float:
    """Engine-seconds the switch from the arrangement now to `a` costs."""
    cap, n, c = inputs.cap, inputs.n, inputs.current
    if a == c:
        return 0.0
    if c == 0:  # colocated -> split: every engine reconfigures, the new prefill side drains, the KV moves
        saturated = inputs.rates is not None
        return n * cap.colocated_switch_s + a * inputs.drain_s + relocation_s(inputs.colocated_demand, cap, a, n, saturated)
    if a == 0:  # back to colocated: nothing to drain
        return n * cap.colocated_switch_s
    return resize_cost_s(inputs.split_demand, cap, c, a, n, inputs.drain_s)


def return_engine_s(inputs: Inputs, a: int) -> float:
    """Engine-seconds the way back from `a` to the arrangement now would cost, priced as `a`
    would see it: a grow is cheap and its shrink recomputes what the leaving prefill engines
    held, a colocation is cheap and the split after it relocates the working set."""
    return switch_engine_s(dataclasses.replace(inputs, current=a), inputs.current)


def holds(inputs: Inputs, a: int) -> bool:
    """Whether candidate `a` can run: colocation unless the operator ruled it out; a split whose
    decode side holds what it must keep, or any split where engines queue what does not fit
    (the saturated model rates it)."""
    if a == 0:
        return inputs.colocation
    if inputs.cap.admission_queues:
        return True
    return decode_side_holds(inputs.split_demand, inputs.cap, inputs.n - a, entering=inputs.current == 0)


def evaluate(inputs: Inputs) -> Evaluation:
    """finish_s for every candidate (module docstring)."""
    candidates = range(inputs.n)
    costs = [switch_engine_s(inputs, a) for a in candidates]
    later = inputs.after_horizon()
    near = [pace(inputs, a) for a in candidates]
    far = [pace(later, a) for a in candidates] if later else near
    runs = [holds(inputs, a) and math.isfinite(near[a]) and math.isfinite(far[a]) for a in candidates]

    def against_now(paces: list[float]) -> list[float]:
        """Each pace over the pace the work left was timed at (now's, `Inputs.timed`); where
        that has none or now is ruled out, over the fastest that runs."""
        reference = paces[inputs.timed]
        if not math.isfinite(reference) or inputs.now_ruled_out:
            reference = min((paces[a] for a in candidates if runs[a]), default=math.inf)
        return [p / reference for p in paces]

    left_s = inputs.remaining_s
    near_s = min(inputs.horizon_s, left_s) if later else left_s
    relative = [near_s * n + (left_s - near_s) * f for n, f in zip(against_now(near), against_now(far))]
    relative = [r / left_s if left_s > 0 else r for r in relative]
    finish = [left_s * relative[a] + costs[a] / inputs.n if runs[a] else math.inf for a in candidates]
    return Evaluation(finish, relative, costs, inputs.current, inputs.remaining_s)
