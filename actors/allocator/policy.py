"""Allocation policies (pure): `decide(demand, fleet) -> role changes`, no bus, no clock.

Every PD policy here sizes the prefill side the same way, from a demand estimate:

    prefill load (engines) = prefill tokens/s x engine-s per token / target utilisation
    decode load (engines)  = max(decode seqs / seqs a decode engine serves at `slack` x its
                                 fastest step,  decode KV / a decode engine's KV pool)
    prefill engines        = round(n x prefill load / (prefill + decode load)), in [1, n-1]

— equal utilisation of the two stages. They differ in where the demand comes from:
`reactive` reads the queues of now, `prorsa` the forecast over its horizon (plus the
backlog of now), `oracle` the true future of a recorded log. `prorsa` and `oracle` also
weigh a change: it must save more engine-seconds over the horizon (the bottleneck stage's
utilisation, before vs after, times the fleet) than the switching engines lose (drain +
reconfiguration), with hysteresis (`min_gain_s`) and a minimum dwell per engine. The
engines that switch are those with the least in-flight work.

Colocation is one of the choices (`allocator.colocation`):

* "cost-model" (default): the fleet's load colocated — every prefill token at the colocated
  layout's cost, the decode load at its capacity, plus what DP-attention lockstep costs the
  decodes while a rank prefills (`loads.colocated_load`) — against the PD split's bottleneck
  load times the fleet, both from the cost model at the demand's context. `prorsa` and
  `oracle` weigh it so; `reactive` takes the lower load. No threshold is tuned per workload:
  where splitting does not pay, the fleet stays colocated.
  - A split must pay for every engine's switch (drain of the engines going to prefill +
    reconfiguration, a layout reload included) and for recomputing the working set that
    sits on the engines becoming decode engines (`loads.relocation_s`). What a horizon does
    not save may be saved over several: ski rental, the split is bought once the
    engine-seconds colocation has lost since a split started paying cover its cost.
  - Never into a split whose decode side cannot hold the working set (it would preempt and
    recompute without end); a split goes back when what its decode side must keep outgrows it:
    the working set, or with KV write-back only the decoding sequences' KV
    (`loads.decode_side_kv_tokens`).
  - While a split recomputes the KV it relocated (a transient already charged), and for
    `SETTLE_HORIZONS` after any change, the arrangement is judged at its settled prefill
    work per new token, and that ratio is not learned.
  - A split goes back when colocation saves more than its switches cost.
  - Saturated (`throughput.py`, opt-in: `allocator.saturated_regime`): where the live
    working set is more than the fleet's KV, or a split's decode side cannot hold what it
    must keep, and engines queue what does not fit (SGLang's admission), the queued demand
    is whatever the fleet takes and loads built on it cannot tell the arrangements apart. There each is rated by the decode tokens per second
    it turns over (the lockstep turn-rate model), from the prefill tokens the fleet computes
    per decode token, measured; the veto and the go-back rule above (whose premise is a
    decode side that preempts) give way to that rating, bought and undone the same way. A
    split a colocated fleet might buy is rated at the histories its prefill pools could not
    keep, recomputed (`throughput.arrangement_ratios`).
* "thresholds": the earlier rule — colocated while the long prefills would not keep
  `disaggregate_above_engines` of an engine busy or too little is decoding for them to stall
  (`DECODE_LOAD_FOR_PD` times that); back below `colocate_below_engines` (hysteresis).
* "never": always a PD split.

`allocator.decision = "evaluator"` (the default; "rules" keeps them) replaces the rules above
for `prorsa` and `oracle` (with `weigh_cost`): every arrangement's time to finish the live
trajectories' work left, switches included, and the best once staying has not been best for
`CONFIRM_DECISIONS` decisions in a row, where it saves, net of the switch, the switch again
(and a resize its way back) (`evaluator.py`, `Split._evaluate`); the roles a fleet starts in
have no dwell.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Protocol

from actors.allocator.capacity import Capacity, CapacityModel
from actors.allocator.damping import FlapDamping
from actors.allocator.evaluator import Inputs, evaluate, return_engine_s
from actors.allocator.loads import (
    bottleneck,
    colocated_load,
    decode_side_holds,
    decode_side_kv_tokens,
    relocation_s,
    resize_cost_s,
    stage_loads,
    target_prefill_engines,
    working_set_tokens,
)
from actors.allocator.side_share import SideShare
from actors.allocator.state import Demand, EngineState, Fleet, RoleChange
from actors.allocator.throughput import RatioMeter, arrangement_ratios, fleet_saturated, saturated_ratio, turnover_rates
from actors.config import AllocatorSection, EngineSection
from bus_schemas.control import Role

DECODE_LOAD_FOR_PD = 2.0  # "thresholds": splitting also needs this many times the prefill threshold of decode load
MISS_RATIO_WEIGHT = 0.2  # EWMA weight of a new observation of prefill tokens per new token
# the miss ratio is learned once every engine has held its role this many horizons: right
# after a change, the next turns recompute what the old arrangement held (a transient) [A]
SETTLE_HORIZONS = 3.0
# the evaluator leaves the arrangement of now only once this many decisions in a row found
# another best (a tick's forecast can tip a comparison the next one undoes); it moves to the
# last one found, as the splits it weighs are often within a percent of each other [A]
CONFIRM_DECISIONS = 3


class Policy(Protocol):
    name: str

    def decide(self, demand: Demand | None, fleet: Fleet) -> list[RoleChange]: ...


# --- the fixed policies --------------------------------------------------------------------
@dataclass(slots=True)
class Fixed:
    """`colocated`, `colocated-sticky` and `static`: a role per engine that never changes
    (a restarted engine found in another role is put back)."""

    name: str
    roles: dict[str, Role]

    def decide(self, demand: Demand | None, fleet: Fleet) -> list[RoleChange]:
        return [
            RoleChange(e.engine_id, self.roles[e.engine_id], "fixed role")
            for e in fleet.engines
            if e.engine_id in self.roles and e.role is not self.roles[e.engine_id] and not e.switching and e.responsive
        ]


# --- resizing the split -----------------------------------------------------------------------
@dataclass(slots=True)
class Split:
    """`reactive`, `prorsa` and `oracle`: a P:D split resized from a demand estimate."""

    name: str
    engines: EngineSection
    config: AllocatorSection
    weigh_cost: bool = True  # prorsa / oracle: a change must pay for its switches
    capacity: CapacityModel = field(init=False)
    last_reason: str = ""
    # prefill tokens computed per new token, learned in each arrangement ("colocated", "pd"):
    # a PD split recomputes what per-turn placement cannot keep where its KV is, so the demand
    # measured while colocated under-states a split's prefill work, and the reverse
    miss_ratio: dict[str, float] = field(default_factory=dict)
    damping: FlapDamping = field(init=False)  # a change that undoes the last is held off (damping.py)
    now_s: float = 0.0
    # ski rental: engine-seconds colocation has lost, by the cost model, since a split last
    # stopped paying; a split that must recompute KV waits until this covers its cost
    regret_s: float = 0.0
    regret_at_s: float | None = None
    # the relocation transient of the last split: excess prefill engine-seconds seen since it
    relocated_s: float = 0.0
    relocated_at_s: float | None = None
    ratios: RatioMeter = field(default_factory=RatioMeter)  # prefill per decode token (throughput.py)
    q_settles_at_s: float = 0.0  # a new split's q is not learned before its relocated KV could be recomputed
    leave_streak: int = 0  # the evaluator's decisions in a row that found another arrangement than now's best
    side_share: SideShare = field(default_factory=SideShare)  # the prefill side's share of a split's prefill tokens

    def __post_init__(self) -> None:
        self.capacity = CapacityModel(self.engines, self.config.decode_tpot_slack, truth=self.config.capacity == "truth")
        self.damping = FlapDamping(self.config.horizon_s)

    def decide(self, demand: Demand | None, fleet: Fleet) -> list[RoleChange]:
        if demand is None:
            self.last_reason = "no demand estimate yet"
            return []
        usable = [e for e in fleet.engines if e.responsive]
        n = len(usable)
        self.now_s = fleet.now_s
        colocated_now = all(e.role is Role.COLOCATED for e in usable)
        pd_now = all(e.role is not Role.COLOCATED for e in usable)
        settled = all(fleet.now_s - e.role_since_s >= SETTLE_HORIZONS * self.config.horizon_s for e in usable)
        q_settled = settled and fleet.now_s >= self.q_settles_at_s and not any(e.switching for e in usable)
        prefill_engines = sum(e.role is Role.PREFILL for e in usable)
        self.ratios.observe(*fleet.token_totals, prefill_engines if q_settled and (colocated_now or pd_now) else None, fleet.turns_total)
        self.side_share.observe(usable, q_settled and pd_now)
        if any(self._dwelling(e) or e.switching for e in usable):
            self.last_reason = "a switch is under way or within its dwell"
            return []
        cap = self.capacity.at(demand.decode_context_tokens)
        loads = stage_loads(demand, cap, self.config.prefill_target_util)
        if sum(loads) <= 0:
            self.last_reason = "idle: no demand, no change"
            return []
        current = sum(e.role is Role.PREFILL for e in usable)
        if self.config.decision == "evaluator" and self.weigh_cost:
            return self._evaluate(demand, cap, usable, current, colocated_now, settled)
        regime = self.weigh_cost and self.config.saturated_regime and self.config.colocation == "cost-model"
        if regime and n >= 2 and fleet_saturated(demand, cap, n, current, pd_now):
            changes = self._saturated(demand, cap, usable, current, colocated_now)
            if changes is not None:
                return changes
            if pd_now:  # a split in a saturated fleet, no reading of q yet: loads cannot judge it
                self.last_reason = f"hold {current}:{n - current}, saturated: no prefill-per-decode reading"
                return []
        arrangement = "colocated" if colocated_now else "pd" if pd_now else ""
        demand = self._judged(demand, cap, n, current, arrangement, settled, split_now=pd_now)
        loads = stage_loads(demand, cap, self.config.prefill_target_util)
        colocate = self._colocate(demand, cap, loads, n, current, colocated_now)
        if colocate:
            self.last_reason = colocate
            return self._colocate_all(usable)
        target = target_prefill_engines(loads, n, current)
        pd_roles = all(e.role is not Role.COLOCATED for e in usable)
        if target == current and pd_roles:
            self.last_reason = f"hold {current}:{n - current}"
            return []
        abs(target - current) if pd_roles else n
        if self.weigh_cost and pd_roles:
            gain_s = (bottleneck(loads, current, n) - bottleneck(loads, target, n)) * n * self.config.horizon_s
            cost_s = resize_cost_s(demand, cap, current, target, n, self.config.drain_deadline_s)
            if gain_s - cost_s < self._required_gain_s("grow" if target > current else "shrink"):
                self.last_reason = f"keep {current}:{n - current}: {target}:{n - target} gains {gain_s:.1f} engine-s, costs {cost_s:.1f}"
                return []
        self.last_reason = f"{current}:{n - current} -> {target}:{n - target} ({demand.source})"
        changes = self._pick(usable, target, fleet.now_s)
        if changes:
            self._changed("split" if not pd_roles else "grow" if target > current else "shrink")
        return changes

    def _dwelling(self, e: EngineState) -> bool:
        """Within its minimum dwell. Under the evaluator, the roles a fleet starts in (epoch 0)
        have none: nothing was paid to enter them, and a sync step's burst comes at once."""
        started_in_it = self.config.decision == "evaluator" and self.weigh_cost and e.epoch == 0
        return self.now_s - e.role_since_s < self.config.min_dwell_s and not started_in_it

    def _evaluate(
        self, demand: Demand, cap: Capacity, usable: list[EngineState], current: int, colocated_now: bool, settled: bool
    ) -> list[RoleChange]:
        """`allocator.decision = "evaluator"`: the arrangement that finishes the work left first,
        switches included (evaluator.py)."""
        n = len(usable)
        if n < 2:
            self.last_reason = f"colocated: {n} engine"
            return self._colocate_all(usable)
        now = "colocated" if colocated_now else "pd"
        demand = self._judged(demand, cap, n, current, now, settled, split_now=not colocated_now)
        later = demand.over_work_left()
        inputs = Inputs(
            colocated_demand=self._as_in(demand, "colocated", now),
            split_demand=self._split_view(demand, cap, now),
            later=(self._as_in(later, "colocated", now), self._split_view(later, cap, now)) if later else None,
            horizon_s=self.config.horizon_s,
            cap=cap,
            n=n,
            current=current,
            util=self.config.prefill_target_util,
            drain_s=self.config.drain_deadline_s,
            remaining_s=demand.remaining_s if demand.remaining_s > 0 else self.config.horizon_s,
            stage_s=demand.turn_stage_s,
            rates=self._saturated_rates(demand, cap, n, current, colocated_now),
            colocation=self.config.colocation != "never",
            timed_in=demand.stages_timed_in,
        )
        evaluation = evaluate(inputs)
        best, where = evaluation.best, f"{evaluation.note()} ({demand.source})"
        self.leave_streak = self.leave_streak + 1 if best != current else 0
        if best == current:
            self.last_reason = f"hold: {where}"
            return []
        if self.leave_streak < CONFIRM_DECISIONS and not inputs.now_ruled_out:
            self.last_reason = f"hold: another best {self.leave_streak} of {CONFIRM_DECISIONS} decisions, {where}"
            return []
        kind = "colocate" if best == 0 else "split" if current == 0 else "grow" if best > current else "shrink"
        # net of the switch, at least the switch again; a resize, at least its way back too
        back_s = return_engine_s(inputs, best) if kind in ("grow", "shrink") else 0.0
        least_s = max(evaluation.cost_s[best], back_s) * self.damping.margin.get(kind, 1.0)
        gain_s = evaluation.gain_engine_s(n)
        if gain_s < max(self._required_gain_s(kind), least_s):
            self.last_reason = f"keep: {kind} saves {gain_s:.1f} engine-s net, less than {least_s:.1f}, {where}"
            return []
        move = " -> ".join("colocated" if a == 0 else f"{a}:{n - a}" for a in (current, best))
        self.last_reason = f"{kind} {move}, saves {gain_s:.1f} engine-s: {where}"
        if best == 0:
            return self._colocate_all(usable)
        if current == 0:
            self._buy_split(demand, cap, best, n)
        elif best < current:  # the prefixes the leaving prefill engines held are recomputed: q settles after
            recompute_s = resize_cost_s(demand, cap, current, best, n, 0.0) - (current - best) * cap.switch_s
            self.q_settles_at_s = self.now_s + recompute_s / best
        changes = self._pick(usable, best, self.now_s)
        if changes:
            self._changed(kind)
        return changes

    def _split_view(self, demand: Demand, cap: Capacity, now: str) -> Demand:
        """The demand as a split would see it: its prefill work per new token, and the share of
        its prefill tokens its prefill side computes (side_share.py)."""
        share = self.side_share.share(cap.decode_lockstep_ranks > 1, demand.remote_share)
        return dataclasses.replace(self._as_in(demand, "pd", now), remote_share=share)

    def _saturated_rates(self, demand: Demand, cap: Capacity, n: int, current: int, colocated_now: bool) -> list[float] | None:
        """Decode tokens per second of every candidate (0: colocated, p: p prefill engines) where
        the fleet is saturated and its prefill work per decode token is read (throughput.py);
        None elsewhere. A saturated split is rated against colocation alone (the other splits
        0): its q is read in its own pools, and what another split's would compute per decode
        token is not known from them (rated on it, DeepSeek SWE resized between 1:3 and 2:2
        every few minutes, each side rating the other faster)."""
        if not (self.config.saturated_regime and fleet_saturated(demand, cap, n, current, not colocated_now)):
            return None
        q = saturated_ratio(self.ratios, histories_follow=not cap.decode_holds_histories)
        if q is None:
            return None
        rates = turnover_rates(demand, cap, n, arrangement_ratios(self.ratios, demand, cap, n, q))
        return [rate if p == 0 or colocated_now or p == current else 0.0 for p, rate in enumerate(rates)]

    def _colocate_all(self, usable: list[EngineState]) -> list[RoleChange]:
        changes = [
            RoleChange(e.engine_id, Role.COLOCATED, self.last_reason) for e in usable if e.role is not Role.COLOCATED and not e.switching
        ]
        if changes:
            self._changed("colocate")
        return changes

    def _saturated(
        self, demand: Demand, cap: Capacity, usable: list[EngineState], current: int, colocated_now: bool
    ) -> list[RoleChange] | None:
        """The saturated fleet's choice: the arrangement that turns over the most decode tokens
        per second, bought when what it saves pays for its switches. None where the model does
        not hold (`throughput.saturated_ratio`)."""
        n, horizon_s = len(usable), self.config.horizon_s
        q = saturated_ratio(self.ratios, histories_follow=not cap.decode_holds_histories)
        if q is None:
            return None
        # the history term prices a split before it is bought; once split, one q judges it, as
        # the hold and the way back were built on (docs/allocation.md, saturated fleets)
        qs = arrangement_ratios(self.ratios, demand, cap, n, q) if colocated_now else [q] * n
        coloc, *split_rates = turnover_rates(demand, cap, n, qs)
        rates = dict(enumerate(split_rates, start=1))
        best = max(rates, key=lambda p: (rates[p], -abs(p - current)))
        note = f"saturated: colocated {coloc:.0f} (q {qs[0]:.2f}) vs {best}:{n - best} {rates[best]:.0f} (q {qs[best]:.2f}) decode tokens/s ({demand.source})"
        if colocated_now:
            # the rates are a busy fleet's: a faster arrangement saves what it would of the work
            # there is (a step's tail, a few sequences left, saves next to nothing)
            busy = min(1.0, colocated_load(demand, cap, self.config.prefill_target_util, n) / n)
            gain_engines = busy * n * (1.0 - coloc / rates[best]) if rates[best] > coloc else 0.0
            buys, gain_s, regret_s, cost_s, _ = self._split_pays(demand, cap, best, n, gain_engines, saturated=True)
            if buys:
                self.last_reason = f"0:{n} -> {best}:{n - best}, {note}"
                changes = self._pick(usable, best, self.now_s)
                self._changed("split")
                return changes
            self.last_reason = (
                f"colocated, {note}: split gains {gain_s:.1f} engine-s (colocation lost {regret_s:.1f} so far), costs {cost_s:.1f}"
            )
            return []
        now_rate = rates.get(current, 0.0)
        if coloc > max(now_rate, rates[best]):
            gain_s = n * (1.0 - now_rate / coloc) * horizon_s
            cost_s = n * cap.colocated_switch_s
            if gain_s - cost_s >= self._required_gain_s("colocate"):
                self.last_reason = f"colocated, {note}: gains {gain_s:.1f} engine-s, costs {cost_s:.1f}"
                return self._colocate_all(usable)
        self.last_reason = f"hold {current}:{n - current}, {note} ({current}:{n - current} {now_rate:.0f})"
        return []

    def _required_gain_s(self, kind: str) -> float:
        """min_gain; infinite while `kind` would undo the last change within the flap hold."""
        return math.inf if self.damping.refuses(kind, self.now_s) else self.config.min_gain_s

    def _changed(self, kind: str) -> None:
        self.leave_streak = 0  # the evaluator counts its decisions again from the new arrangement
        self.damping.record(kind, self.now_s)

    def _judged(self, demand: Demand, cap: Capacity, n: int, current: int, arrangement: str, settled: bool, split_now: bool) -> Demand:
        """The demand an arrangement ("colocated", "pd", "": mixed) is judged by. Settled, as
        measured, and its prefill work per new token is learned; right after a change, or while
        a split (`split_now`) still recomputes the KV it relocated (a transient already paid
        for), the turns recompute what the old arrangement held: its steady state instead."""
        if split_now and self._recomputing(demand, cap, n, current):
            settled = False
        if settled:
            self._learn_miss_ratio(demand, arrangement)
            return demand
        return self._steady(demand, arrangement or "pd")

    def _learn_miss_ratio(self, demand: Demand, arrangement: str) -> None:
        if not arrangement or demand.prefill_new_tokens_per_s <= 0:
            return
        ratio = demand.prefill_flow_tokens_per_s / demand.prefill_new_tokens_per_s
        old = self.miss_ratio.get(arrangement)
        self.miss_ratio[arrangement] = ratio if old is None else old + MISS_RATIO_WEIGHT * (ratio - old)

    def _recomputing(self, demand: Demand, cap: Capacity, n: int, current: int) -> bool:
        """Whether a split is still in its relocation transient: the prefill work beyond the
        steady state (new tokens at colocation's settled ratio) since the split, in
        engine-seconds, has not yet reached what relocating today's working set costs."""
        if self.relocated_at_s is None:
            return False
        ratio = self.miss_ratio.get("colocated")
        if ratio and demand.prefill_new_tokens_per_s > 0:
            excess = max(0.0, demand.prefill_flow_tokens_per_s - ratio * demand.prefill_new_tokens_per_s)
            self.relocated_s += excess * cap.prefill_s_per_token * max(0.0, self.now_s - self.relocated_at_s)
        self.relocated_at_s = self.now_s
        if self.relocated_s >= relocation_s(demand, cap, current, n) or not ratio:
            self.relocated_at_s = None  # the transient is over (or cannot be told from the steady state)
            return False
        return True

    def _steady(self, demand: Demand, arrangement: str) -> Demand:
        """The demand at the prefill work per new token `arrangement` settled at (or the other
        arrangement's, if it never settled), plus the backlog of now: unchanged if neither is
        known."""
        ratio = self.miss_ratio.get(arrangement) or self.miss_ratio.get("colocated" if arrangement == "pd" else "pd")
        if not ratio or demand.prefill_new_tokens_per_s <= 0:
            return demand
        return demand.with_prefill_flow(min(demand.prefill_flow_tokens_per_s, demand.prefill_new_tokens_per_s * ratio))

    def _as_in(self, demand: Demand, arrangement: str, now: str) -> Demand:
        """The demand's flow scaled to the prefill work `arrangement` was seen to compute per new
        token, against the arrangement `now` it was measured in (unscaled where either is
        unknown); the backlog of now is work queued once, whatever the arrangement."""
        ratio, ratio_now = self.miss_ratio.get(arrangement), self.miss_ratio.get(now)
        if ratio is None or not ratio_now or arrangement == now:
            return demand
        return demand.with_prefill_flow(demand.prefill_flow_tokens_per_s * ratio / ratio_now)

    def _colocate(self, demand: Demand, cap: Capacity, loads: tuple[float, float], n: int, current: int, colocated_now: bool) -> str:
        """Why the fleet should be (or stay) colocated; "" if a PD split it is."""
        mode = self.config.colocation
        where = f"({demand.source})"
        if n < 2:
            return f"colocated: {n} engine {where}"
        if mode == "never":
            return ""
        if mode == "thresholds":
            threshold = self.config.disaggregate_above_engines if colocated_now else self.config.colocate_below_engines
            # PD pays when long prefills would stall decodes: both stages need work
            contended = loads[0] >= threshold and loads[1] >= threshold * DECODE_LOAD_FOR_PD
            if not contended and self.config.colocate_below_engines > 0:
                return f"colocated: prefill load {loads[0]:.2f}, decode load {loads[1]:.2f} engines {where}"
            return ""
        util = self.config.prefill_target_util
        now = "colocated" if colocated_now else "pd" if current else ""
        pd_loads = stage_loads(self._as_in(demand, "pd", now), cap, util)
        target = target_prefill_engines(pd_loads, n, max(1, current))
        pd_load = n * bottleneck(pd_loads, target, n)
        coloc_load = colocated_load(self._as_in(demand, "colocated", now), cap, util, n)
        loads_note = f"colocated load {coloc_load:.2f} vs PD {target}:{n - target} {pd_load:.2f} engines {where}"
        if not self.weigh_cost:
            return f"colocated: {loads_note}" if coloc_load <= pd_load else ""
        veto = not (cap.admission_queues and not cap.decode_holds_histories)
        if colocated_now and veto and not decode_side_holds(demand, cap, n - target, entering=True):
            # a decode side that cannot hold the working set preempts and recomputes without end.
            # Not with write-back under SGLang's admission: the histories left on the new decode
            # engines are cached prefixes they evict as they need room, the next turns recompute
            # them on the prefill side (relocation_s, charged below), and what the decode side
            # then keeps is the sequences it decodes, in its decode load
            return f"colocated: the working set ({working_set_tokens(demand) / 1e6:.1f}M tokens) would not fit {n - target} decode engines {where}"
        if colocated_now:
            buys, gain_s, regret_s, cost_s, need_s = self._split_pays(demand, cap, target, n, coloc_load - pd_load)
            if buys:
                return ""
            return f"colocated: {loads_note}, split gains {gain_s:.1f} engine-s (colocation lost {regret_s:.1f} so far), costs {cost_s:.1f} (+{need_s:.1f})"
        if current and not decode_side_holds(demand, cap, n - current):
            what = "the working set" if cap.decode_holds_histories else "the decoding sequences' KV"
            return (
                f"colocated: {what} ({decode_side_kv_tokens(demand, cap) / 1e6:.1f}M tokens) outgrew {n - current} decode engines {where}"
            )
        cost_s = n * cap.colocated_switch_s  # back to colocated: nothing to drain
        gain_s = (pd_load - coloc_load) * self.config.horizon_s
        if gain_s - cost_s >= self._required_gain_s("colocate"):
            return f"colocated: {loads_note}, gains {gain_s:.1f} engine-s, costs {cost_s:.1f}"
        return ""

    def _split_pays(
        self, demand: Demand, cap: Capacity, target: int, n: int, gain_engines: float, saturated: bool = False
    ) -> tuple[bool, float, float, float, float]:
        """(bought, gain_s, regret_s, cost_s, need_s) of a split from colocation saving
        `gain_engines`: switches, drains and relocation against the horizon's saving, or the
        saving over several (ski rental, `_regret`); a bought split is recorded (`_buy_split`)."""
        cost_s = n * cap.colocated_switch_s + target * self.config.drain_deadline_s + relocation_s(demand, cap, target, n, saturated)
        gain_s, need_s = gain_engines * self.config.horizon_s, self._required_gain_s("split")
        regret_s = self._regret(gain_engines if gain_s > need_s else 0.0)
        bought = gain_s - cost_s >= need_s or (gain_s > need_s and regret_s - cost_s >= need_s)
        if bought:
            self._buy_split(demand, cap, target, n)
        return bought, gain_s, regret_s, cost_s, need_s

    def _buy_split(self, demand: Demand, cap: Capacity, target: int, n: int) -> None:
        """A split is bought: the losses that paid for it are spent, its relocation transient
        starts, and its prefill work per decode token is learned only once its prefill side
        could have recomputed the KV it relocated."""
        self.regret_s, self.regret_at_s = 0.0, None
        self.relocated_s, self.relocated_at_s = 0.0, self.now_s
        self.q_settles_at_s = self.now_s + relocation_s(demand, cap, target, n) / max(1, target)

    def _regret(self, gain_engines: float) -> float:
        """Engine-seconds colocation has lost since the split last stopped paying, with this
        tick's `gain_engines` (colocated minus PD load) held since the last tick. The split's
        KV recompute is bought once this covers it (ski rental: at most twice the cost of the
        best choice in hindsight, whatever the demand does next)."""
        if gain_engines <= 0.0:
            self.regret_s, self.regret_at_s = 0.0, None
            return 0.0
        if self.regret_at_s is not None:
            self.regret_s += gain_engines * (self.now_s - self.regret_at_s)
        self.regret_at_s = self.now_s
        return self.regret_s

    def _pick(self, usable: list[EngineState], target: int, now_s: float) -> list[RoleChange]:
        """Role changes reaching `target` prefill engines, moving the least busy engines that
        are past their dwell; colocated engines (a fleet's start) are assigned first."""
        dwell_ok = [e for e in usable if not e.switching and now_s - e.role_since_s >= self.config.min_dwell_s]
        changes: list[RoleChange] = []
        prefill = [e for e in usable if e.role is Role.PREFILL]
        colocated = sorted((e for e in usable if e.role is Role.COLOCATED), key=lambda e: (e.in_flight, e.engine_id))
        for e in colocated:  # not a PD split yet: every colocated engine gets a stage
            role = Role.PREFILL if len(prefill) < target else Role.DECODE
            if role is Role.PREFILL:
                prefill.append(e)
            changes.append(RoleChange(e.engine_id, role, self.last_reason))
        have = len(prefill)
        if have < target:
            pool = sorted((e for e in dwell_ok if e.role is Role.DECODE), key=lambda e: (e.in_flight, e.engine_id))
            changes += [RoleChange(e.engine_id, Role.PREFILL, self.last_reason) for e in pool[: target - have]]
        elif have > target:
            pool = sorted((e for e in dwell_ok if e.role is Role.PREFILL), key=lambda e: (e.in_flight, e.engine_id))
            changes += [RoleChange(e.engine_id, Role.DECODE, self.last_reason) for e in pool[: have - target]]
        return changes
