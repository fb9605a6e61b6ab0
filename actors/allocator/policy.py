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
  layout's cost, the decode load at its capacity, plus the eager decode steps that a
  DP-attention group runs while any rank prefills — against the PD split's bottleneck load
  times the fleet, both from the cost model at the demand's context. A colocated fleet
  splits only when the engine-seconds saved over the horizon pay for every engine's switch
  (drain of the engines going to prefill + reconfiguration, a layout reload included); a
  split fleet goes back when colocation saves more than its switches cost. `prorsa` and
  `oracle` weigh it so; `reactive` takes the lower load. No threshold is tuned per workload:
  where splitting does not pay, the fleet stays colocated.
* "thresholds": the earlier rule — colocated while the long prefills would not keep
  `disaggregate_above_engines` of an engine busy or too little is decoding for them to stall
  (`DECODE_LOAD_FOR_PD` times that); back below `colocate_below_engines` (hysteresis).
* "never": always a PD split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Protocol

from actors.allocator.capacity import Capacity, CapacityModel
from actors.config import AllocatorSection, EngineSection
from bus_schemas.control import Role

DEFAULT_CONTEXT_TOKENS = 4096.0  # typical context before any engine has reported one
DECODE_LOAD_FOR_PD = 2.0
MISS_RATIO_WEIGHT = 0.2
# Resize deadband: rounding alone flips between neighbours at x.5; a quarter engine beyond it [A]
RESIZE_DEADBAND_ENGINES = 0.75
FLAP_HALF_LIFE_HORIZONS = 6.0  # flap penalty half-life, in decision horizons [A]
REVERSES = {"split": "colocate", "colocate": "split", "grow": "shrink", "shrink": "grow"}  # EWMA weight of a new observation of prefill tokens per new token  # splitting also needs this many times the prefill threshold of decode load


@dataclass(frozen=True, slots=True)
class EngineState:
    """What the allocator knows of one engine (its last heartbeat, and its own bookkeeping)."""

    engine_id: str
    role: Role
    epoch: int = 0
    waiting_prefill: int = 0
    waiting_prefill_tokens: int = 0
    running_decode: int = 0
    decode_context_tokens: int = 0
    kv_held_tokens: int = 0  # KV resident or cached (trajectories between turns included)
    held_kv_handles: int = 0
    role_since_s: float = 0.0
    switching: bool = False
    responsive: bool = True  # False: it missed a SetRole ack; left out until it answers again

    @property
    def in_flight(self) -> int:
        return self.waiting_prefill + self.running_decode + self.held_kv_handles


@dataclass(frozen=True, slots=True)
class Fleet:
    now_s: float
    engines: tuple[EngineState, ...]

    def count(self, role: Role) -> int:
        return sum(e.role is role for e in self.engines)

    @property
    def mean_decode_context_tokens(self) -> float:
        seqs = sum(e.running_decode for e in self.engines)
        return sum(e.decode_context_tokens for e in self.engines) / seqs if seqs else DEFAULT_CONTEXT_TOKENS

    @property
    def kv_working_set_tokens(self) -> int:
        """KV the fleet holds now, live trajectories between turns included: a lower bound on
        the working set (what eviction already dropped is not counted)."""
        return sum(e.kv_held_tokens for e in self.engines)

    @property
    def waiting_prefill_tokens(self) -> int:
        return sum(e.waiting_prefill_tokens for e in self.engines)

    @property
    def running_decode(self) -> int:
        return sum(e.running_decode for e in self.engines)


@dataclass(frozen=True, slots=True)
class Demand:
    """Demand over the decision horizon."""

    prefill_tokens_per_s: float  # prefill compute asked for (cache-missed tokens)
    decode_seqs: float  # sequences decoding at once
    decode_context_tokens: float = DEFAULT_CONTEXT_TOKENS  # their mean context
    source: str = ""  # "queues", "forecast", "oracle"
    remote_share: float = 1.0  # share of prefill tokens too long to prefill where their KV lives
    kv_working_set_tokens: float = 0.0  # KV of every live trajectory, between turns included (fleet now)
    prefill_new_tokens_per_s: float = 0.0  # the turns' new tokens alone (0: unknown, take prefill_tokens_per_s)


@dataclass(frozen=True, slots=True)
class RoleChange:
    engine_id: str
    role: Role
    why: str = ""


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


# --- sizing the split -------------------------------------------------------------------------
def stage_loads(demand: Demand, cap: Capacity, util: float) -> tuple[float, float]:
    """(prefill, decode) load in engines. Short appends prefilled where their KV lives (the
    non-remote share) load the decode side."""
    remote = demand.prefill_tokens_per_s * demand.remote_share
    local = demand.prefill_tokens_per_s - remote
    prefill = remote * cap.prefill_s_per_token / util
    decode = max(demand.decode_seqs / cap.decode_full_seqs, kv_tokens(demand) / (0.9 * cap.decode_kv_tokens))
    return prefill, decode + local * cap.prefill_s_per_token


def kv_tokens(demand: Demand) -> float:
    """KV the decode side must hold: the decoding sequences' contexts, or the whole working set
    where that is larger — per-turn placement keeps each trajectory's history where it last
    decoded, so between turns it stays on the decode engines (or is recomputed)."""
    return max(demand.decode_seqs * demand.decode_context_tokens, demand.kv_working_set_tokens)


def target_prefill_engines(loads: tuple[float, float], n: int, current: int) -> int:
    """Prefill engines for equal stage utilisation; a split keeps its size while the ideal
    (fractional) count stays within RESIZE_DEADBAND_ENGINES of it, so an ideal hovering at a
    rounding edge does not move an engine back and forth."""
    prefill, decode = loads
    if n < 2:
        return current
    if prefill + decode <= 0:
        return current  # nothing to go by: stay
    ideal = n * prefill / (prefill + decode)
    if 1 <= current <= n - 1 and abs(ideal - current) < RESIZE_DEADBAND_ENGINES:
        return current
    return min(n - 1, max(1, round(ideal)))


def colocated_load(demand: Demand, cap: Capacity, util: float, n: int) -> float:
    """The fleet's load in engines with every engine colocated: all prefill tokens at the
    colocated layout's cost (with the target utilisation's headroom, as the prefill side
    gets), the decode load at its capacity, and the eager decode steps that DP-attention
    ranks run while a peer prefills (the share of time an engine prefills, times the decode
    load, times the eager factor - 1). Chunks are costed as if the ranks prefilled in step:
    charging a chunk alone for its whole group's step made the fleet split where the split
    then lost (DeepSeek SWE: 0.74x colocated-sticky), so the out-of-step cost is left out."""
    prefill = demand.prefill_tokens_per_s * cap.colocated_prefill_s_per_token / util
    decode = max(demand.decode_seqs / cap.colocated_decode_full_seqs, kv_tokens(demand) / (0.9 * cap.colocated_kv_tokens))
    mixed_share = min(1.0, prefill / max(n, 1))
    return prefill + decode * (1.0 + cap.colocated_mixed_penalty * mixed_share)


def bottleneck(loads: tuple[float, float], n_prefill: int, n: int) -> float:
    """Utilisation of the busier stage with `n_prefill` prefill engines."""
    prefill, decode = loads
    return max(prefill / max(n_prefill, 1e-9), decode / max(n - n_prefill, 1e-9))


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
    # flap damping: a change that undoes the previous one (split <-> colocate, grow <-> shrink)
    # doubles the hold during which the next reversal is refused (route-flap damping); the
    # hold halves every FLAP_HALF_LIFE_HORIZONS horizons
    flap_penalty_s: float = 0.0
    last_change: tuple[str, float] = ("", 0.0)
    now_s: float = 0.0

    def __post_init__(self) -> None:
        self.capacity = CapacityModel(self.engines, self.config.decode_tpot_slack)

    def decide(self, demand: Demand | None, fleet: Fleet) -> list[RoleChange]:
        if demand is None:
            self.last_reason = "no demand estimate yet"
            return []
        usable = [e for e in fleet.engines if e.responsive]
        n = len(usable)
        self.now_s = fleet.now_s
        if any(fleet.now_s - e.role_since_s < self.config.min_dwell_s or e.switching for e in usable):
            self.last_reason = "a switch is under way or within its dwell"
            return []
        cap = self.capacity.at(demand.decode_context_tokens)
        loads = stage_loads(demand, cap, self.config.prefill_target_util)
        if sum(loads) <= 0:
            self.last_reason = "idle: no demand, no change"
            return []
        colocated_now = all(e.role is Role.COLOCATED for e in usable)
        current = sum(e.role is Role.PREFILL for e in usable)
        pd_now = all(e.role is not Role.COLOCATED for e in usable)
        self._learn_miss_ratio(demand, "colocated" if colocated_now else "pd" if pd_now else "")
        colocate = self._colocate(demand, cap, loads, n, current, colocated_now)
        if colocate:
            self.last_reason = colocate
            changes = [RoleChange(e.engine_id, Role.COLOCATED, self.last_reason) for e in usable if e.role is not Role.COLOCATED and not e.switching]
            if changes:
                self._changed("colocate")
            return changes
        target = target_prefill_engines(loads, n, current)
        pd_roles = all(e.role is not Role.COLOCATED for e in usable)
        if target == current and pd_roles:
            self.last_reason = f"hold {current}:{n - current}"
            return []
        moves = abs(target - current) if pd_roles else n
        if self.weigh_cost and pd_roles:
            gain_s = (bottleneck(loads, current, n) - bottleneck(loads, target, n)) * n * self.config.horizon_s
            to_prefill = max(0, target - current)  # only a switch to prefill drains decodes
            cost_s = to_prefill * self.config.drain_deadline_s + moves * cap.switch_s
            if gain_s - cost_s < self._required_gain_s("grow" if target > current else "shrink"):
                self.last_reason = f"keep {current}:{n - current}: {target}:{n - target} gains {gain_s:.1f} engine-s, costs {cost_s:.1f}"
                return []
        self.last_reason = f"{current}:{n - current} -> {target}:{n - target} ({demand.source})"
        changes = self._pick(usable, target, fleet.now_s)
        if changes:
            self._changed("split" if not pd_roles else "grow" if target > current else "shrink")
        return changes

    def _penalty_s(self) -> float:
        kind, at_s = self.last_change
        if not kind:
            return 0.0
        half_life_s = FLAP_HALF_LIFE_HORIZONS * self.config.horizon_s
        return self.flap_penalty_s * 0.5 ** (max(0.0, self.now_s - at_s) / half_life_s)

    def _required_gain_s(self, kind: str) -> float:
        """min_gain; infinite while `kind` would undo the last change within the flap hold."""
        kind_last, at_s = self.last_change
        if REVERSES.get(kind) == kind_last and self.now_s - at_s < self._penalty_s():
            return math.inf
        return self.config.min_gain_s

    def _changed(self, kind: str) -> None:
        """Record a change; one that undoes the previous change doubles the hold (model s)
        during which the next reversal is refused (at least a horizon)."""
        penalty = self._penalty_s()
        if REVERSES.get(kind) == self.last_change[0]:
            penalty = max(self.config.horizon_s, 2.0 * penalty)
        self.flap_penalty_s, self.last_change = penalty, (kind, self.now_s)

    def _learn_miss_ratio(self, demand: Demand, arrangement: str) -> None:
        if not arrangement or demand.prefill_new_tokens_per_s <= 0:
            return
        ratio = demand.prefill_tokens_per_s / demand.prefill_new_tokens_per_s
        old = self.miss_ratio.get(arrangement)
        self.miss_ratio[arrangement] = ratio if old is None else old + MISS_RATIO_WEIGHT * (ratio - old)

    def _as_in(self, demand: Demand, arrangement: str, now: str) -> Demand:
        """The demand scaled to the prefill work `arrangement` was seen to compute per new token,
        against the arrangement `now` it was measured in (unscaled where either is unknown)."""
        ratio, ratio_now = self.miss_ratio.get(arrangement), self.miss_ratio.get(now)
        if ratio is None or not ratio_now or arrangement == now:
            return demand
        return replace(demand, prefill_tokens_per_s=demand.prefill_tokens_per_s * ratio / ratio_now)

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
        horizon_s = self.config.horizon_s
        if colocated_now:  # splitting: every engine reconfigures, those going to prefill drain their decodes
            cost_s = n * cap.colocated_switch_s + target * self.config.drain_deadline_s
            gain_s = (coloc_load - pd_load) * horizon_s
            need_s = self._required_gain_s("split")
            return "" if gain_s - cost_s >= need_s else f"colocated: {loads_note}, split gains {gain_s:.1f} engine-s, costs {cost_s:.1f} (+{need_s:.1f})"
        cost_s = n * cap.colocated_switch_s  # back to colocated: nothing to drain
        gain_s = (pd_load - coloc_load) * horizon_s
        if gain_s - cost_s >= self._required_gain_s("colocate"):
            return f"colocated: {loads_note}, gains {gain_s:.1f} engine-s, costs {cost_s:.1f}"
        return ""

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
