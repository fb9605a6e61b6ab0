"""The allocator's load model (pure): demand in engines, for a PD split and for colocation.

    prefill load (engines) = prefill tokens/s x engine-s per token / target utilisation
                             (per token at the context the forecast's prefills attend over)
    decode load (engines)  = max(decode seqs / seqs a decode engine serves at `slack` x its
                                 fastest step,  decode KV / a decode engine's KV pool)
                             (decode KV: what the decode side keeps, `decode_side_kv_tokens`)
    colocated load         = the same work on colocated engines (KV: the live trajectories',
                             `live_kv_tokens`), plus what DP-attention
                             lockstep costs their decodes while a rank prefills
    a split's relocation   = the KV held on the engines that become decode engines,
                             recomputed by the prefill side

Units: loads in engines (engine-seconds per second), costs in engine-seconds.
"""

from __future__ import annotations

import math

from actors.allocator.capacity import KV_HIGH_WATERMARK, Capacity
from actors.allocator.state import Demand

# Resize deadband: rounding alone flips between neighbours at x.5; a quarter engine beyond it [A]
RESIZE_DEADBAND_ENGINES = 0.75


def stage_loads(demand: Demand, cap: Capacity, util: float) -> tuple[float, float]:
    """(prefill, decode) load in engines. Short appends prefilled where their KV lives (the
    non-remote share) load the decode side. The decode side's KV is what it keeps once split
    (`decode_side_kv_tokens`): with write-back, the sequences it decodes."""
    remote = demand.prefill_tokens_per_s * demand.remote_share
    local = demand.prefill_tokens_per_s - remote
    s_per_token = cap.prefill_s_at(demand.prefill_attention_tokens)
    prefill = remote * s_per_token / util
    decode = max(demand.decode_seqs / cap.decode_full_seqs, decode_side_kv_tokens(demand, cap) / (KV_HIGH_WATERMARK * cap.decode_kv_tokens))
    return prefill, decode + local * s_per_token


def kv_tokens(demand: Demand) -> float:
    """KV the decode side must hold without KV write-back: the decoding sequences' contexts, or
    the whole working set where that is larger — per-turn placement keeps each trajectory's
    history where it last decoded, so between turns it stays on the decode engines (or is
    recomputed)."""
    return max(demand.decoding_kv_tokens, working_set_tokens(demand))


def live_kv_tokens(demand: Demand) -> float:
    """KV the live trajectories need wherever they are: the decoding sequences' contexts or the
    live histories (`Demand.live_context_tokens`, the forecaster's lifecycle state), whichever
    is larger; the working set (`kv_tokens`) where the histories are not known. Unlike the
    working set it leaves out the cached prefixes of finished trajectories (between sync
    steps, with none live, the pools are full of them and no turn will read them)."""
    if not demand.live_kv_known:
        return kv_tokens(demand)
    return max(demand.decoding_kv_tokens, demand.live_context_tokens)


def decode_side_kv_tokens(demand: Demand, cap: Capacity, entering: bool = False) -> float:
    """KV a split's decode side must keep to run without thrashing. Entering a split it must
    hold the working set: the histories on the engines becoming decode engines stay there until
    their next turn. Once split, with KV write-back each finished turn's KV goes back to the
    prefill side, so the decode side holds only the sequences it decodes; without, the whole
    working set (`kv_tokens`)."""
    if entering or cap.decode_holds_histories:
        return kv_tokens(demand)
    return demand.decoding_kv_tokens


def decode_side_holds(demand: Demand, cap: Capacity, decode_engines: int, entering: bool = False) -> bool:
    """Whether `decode_engines` decode engines hold the KV the decode side must
    (`decode_side_kv_tokens`, at `KV_HIGH_WATERMARK`, the pool occupancy the decode load is
    sized to)."""
    return decode_side_kv_tokens(demand, cap, entering) <= KV_HIGH_WATERMARK * decode_engines * cap.decode_kv_tokens


def working_set_tokens(demand: Demand) -> float:
    """KV of every live trajectory, as the allocator sizes it: what the fleet holds (eviction
    caps it at the pools it has), or the live trajectories times the decoding sequences' mean
    context where that is larger (a fleet that already evicts reports only what it kept).
    Both over-count the live histories (`Demand.live_context_tokens`): pools keep finished
    trajectories' prefixes until eviction, so a warm fleet's read full, and the sequences
    decoding are the longer ones. The rules and the saturated regime's gate were measured on
    this figure; docs/allocation.md, "Alternatives considered", shows what the live histories did in its place."""
    return max(demand.kv_working_set_tokens, demand.live_trajectories * demand.decode_context_tokens)


def target_prefill_engines(loads: tuple[float, float], n: int, current: int) -> int:
    """Prefill engines for the least bottleneck (about equal stage utilisation: the floor or
    the ceiling of the fractional count that equalises them, whichever loads the busier stage
    less); a split keeps its size while that count stays within RESIZE_DEADBAND_ENGINES of it,
    so an ideal hovering at a rounding edge does not move an engine back and forth."""
    prefill, decode = loads
    if n < 2:
        return current
    if prefill + decode <= 0:
        return current  # nothing to go by: stay
    ideal = n * prefill / (prefill + decode)
    if 1 <= current <= n - 1 and abs(ideal - current) < RESIZE_DEADBAND_ENGINES:
        return current
    # the bottleneck is least at the floor or the ceiling of the ideal, not always at the one
    # nearer to it (1.4 of 4: one prefill engine runs at 0.76 where two run the decode side at 0.71)
    below, above = (min(n - 1, max(1, k)) for k in (math.floor(ideal), math.ceil(ideal)))
    return min((below, above), key=lambda k: (bottleneck(loads, k, n), abs(k - ideal)))


def colocated_load(demand: Demand, cap: Capacity, util: float, n: int) -> float:
    """The fleet's load in engines with every engine colocated: all prefill tokens at the
    colocated layout's cost (with the target utilisation's headroom, as the prefill side
    gets) and the decode load at its capacity. Under DP attention the prefill chunks also
    cost decode time:

    * SGLang's prefill-first lockstep (`colocated_lockstep_ranks` R > 1): a step in which
      any rank prefills lasts the chunk's step, and the group's decodes make no real progress
      in it (one eager token). A rank prefills a share p of the time (its in-step prefill
      load); ranks whose turns arrive independently leave the group decoding only while none
      prefills, (1 - p)^R of the time; so the prefill takes 1 - (1 - p)^R of every engine
      (between p, ranks in step, and R p, never together). Prefill work beyond the whole
      fleet (a step's burst of prompts, a backlog) takes what it takes: the stall can hold
      every engine at most, the prefill itself is not capped (as the split's prefill load
      is not);
    * otherwise (vLLM's piecewise steps): decode steps run eager while a peer prefills (the
      prefill share times the decode load, times the eager factor - 1)."""
    prefill = demand.prefill_tokens_per_s * cap.prefill_s_at(demand.prefill_attention_tokens, colocated=True) / util
    decode = max(
        demand.decode_seqs / cap.colocated_decode_full_seqs, live_kv_tokens(demand) / (KV_HIGH_WATERMARK * cap.colocated_kv_tokens)
    )
    share = min(1.0, prefill / max(n, 1))
    if cap.colocated_lockstep_ranks > 1:
        return max(prefill, n * (1.0 - (1.0 - share) ** cap.colocated_lockstep_ranks)) + decode
    return prefill + decode * (1.0 + cap.colocated_mixed_penalty * share)


def relocation_s(demand: Demand, cap: Capacity, target: int, n: int, saturated: bool = False) -> float:
    """Engine-seconds a split from colocation spends recomputing the KV in the wrong place: the
    live trajectories whose history sits on the engines that become decode engines prefill
    their next turn on a prefill engine that holds none of it (the share on those engines of
    the KV the fleet holds now, at the prefill side's cost per token). Only KV that exists
    counts: what eviction dropped, what no turn has prefilled yet, and what a weight update
    made stale (engines drop an older policy's KV) are recomputed under any arrangement, so
    right after an update (async) or at a step's start a split relocates almost nothing.
    A `saturated` fleet (its KV full, `throughput.fleet_saturated`) counts only what the live
    trajectories hold (`relocatable_tokens`): the rest is finished trajectories' prefixes that
    colocation evicts as it needs room. Below saturation the held KV stays the measure: after
    a split at a SWE step's start the prefill side recomputed more than the live trajectories
    held on the engines that turned decode (docs/allocation.md, saturated fleets)."""
    tokens = relocatable_tokens(demand) if saturated else demand.kv_working_set_tokens
    return tokens * (n - target) / n * cap.prefill_s_per_token


def relocatable_tokens(demand: Demand) -> float:
    """The KV the live trajectories hold, where the fleet holds it: a warm fleet also holds
    finished trajectories' prefixes until eviction drops them, which no later turn reads (all
    that is held where the live trajectories' KV is not known)."""
    if demand.live_kv_known:
        return min(demand.kv_working_set_tokens, demand.live_context_tokens)
    return demand.kv_working_set_tokens


def resize_cost_s(demand: Demand, cap: Capacity, current: int, target: int, n: int, drain_s: float) -> float:
    """Engine-seconds resizing a split from `current` to `target` prefill engines costs: drains
    (only a switch to prefill drains decodes), reconfiguration, and on a shrink the prefixes
    the leaving prefill engines held for the next turns, recomputed."""
    cost_s = max(0, target - current) * drain_s + abs(target - current) * cap.switch_s
    if target < current:
        cost_s += working_set_tokens(demand) * (current - target) / n * cap.prefill_s_per_token
    return cost_s


def bottleneck(loads: tuple[float, float], n_prefill: int, n: int) -> float:
    """Utilisation of the busier stage with `n_prefill` prefill engines."""
    prefill, decode = loads
    return max(prefill / max(n_prefill, 1e-9), decode / max(n - n_prefill, 1e-9))
