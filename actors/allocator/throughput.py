"""What each arrangement turns over when the fleet is saturated (pure).

Saturated: the live trajectories' KV is more than the whole fleet holds, and engines queue
what does not fit (SGLang's admission: `engines.admission = "sglang"`). Every arrangement
then runs with full KV pools and turns waiting, and the rollout's pace is what the fleet
turns over, not the demand of the next horizon (queued, that demand is whatever the fleet
takes). The flows a forecast reads are then the fleet's own throughput, and a comparison of
loads built on them cannot tell a faster arrangement from a slower one.

So in this regime each arrangement is rated by the decode tokens per second D it sustains,
given q, the prefill tokens the fleet computes per decode token it generates (measured on
the fleet: `RatioMeter`). A KV-bound engine decodes B sequences at step time t (B: what its
pool holds at the context, or its share of the live trajectories where they are fewer, as
in a step's tail, with the shorter step of that batch: `decode_rate`); under
SGLang's prefill-first lockstep (R ranks) its decodes advance only in steps in which no rank
prefills, (1 - p)^R of the time, where p is a rank's prefill share (the turn-rate model of
docs/allocation.md):

    colocated, n engines:  D = n B_c / t_c x (1 - D q s_c / n)^R_c
    P:D split:             D = min(P / (q r s_p),
                                   (n - P) B_d / t_d x (1 - D q (1 - r) s_d / (n - P))^R_d)

s: engine-seconds per prefill token on that engine, r: the share of prefill tokens computed
on prefill engines (the rest are short appends prefilled where their KV lives, on the decode
engines). Units: D in decode tokens per second of the whole fleet.

q is measured in the arrangement the fleet runs. Another arrangement computes more where it
keeps fewer of the live histories between turns: a turn whose history was evicted recomputes
all of it. Colocated, every engine's pool keeps them (L, the live histories, in H, the
fleet's pools). A split with KV write-back to its prefill side keeps them in its prefill
engines' pools alone, all but what its decode engines hold while they decode (the write-back
restores a decoded turn's whole context): L less (n - P) / n of the decoding sequences' KV,
in P pools. A share max(0, 1 - H / kept) of the turns misses (they come back in no order an
LRU cache could exploit), and each miss recomputes a history of L / (live trajectories):

    q(arrangement) = q(measured) + max(0, miss(arrangement) - miss(measured))
                                   x history tokens per decode token

(`arrangement_ratio`; history tokens per decode token: the mean history times the turns
routed per decode token, both measured). Where the measured arrangement already misses
(its histories past its pools), its miss share is read from q and every arrangement's pools
are scaled by what its own kept that share for. The term only adds: an arrangement that
keeps more histories than the measured one is rated at the measured q, not below it, because
that q also carries recompute the term does not see (a split's relocation right after it
was bought, colocation's preemptions as its sequences grow); credited, DeepSeek SWE at 64
per GPU went back to colocation on a split's reading taken while it relocated (6,917.9 s
against 4,730.6). The policy applies it to the splits a colocated fleet might buy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.allocator.capacity import KV_HIGH_WATERMARK, Capacity
from actors.allocator.loads import decode_side_holds, working_set_tokens
from actors.allocator.state import Demand

# decayed sums behind the measured prefill-per-decode ratio: each tick keeps this share of the
# old sums, so the ratio reads about the last 1 / (1 - decay) ticks [A]
RATIO_DECAY = 0.9
# ... and an arrangement's own reading counts once it spans that many ticks (one window)
RATIO_MIN_TICKS = round(1.0 / (1.0 - RATIO_DECAY))
# without KV write-back the saturated regime's model holds where recomputing evicted
# histories is most of the fleet's prefill work (every arrangement then misses most of them) [A]
RECOMPUTE_SHARE = 0.5
BISECTIONS = 60  # the fixed point to well below a token per second


def lockstep_rate(decode_rate: float, prefill_per_engine: float, ranks: int) -> float:
    """The root D of D = decode_rate x (1 - D x prefill_per_engine)^ranks: decode tokens per
    second of engines that reach `decode_rate` with no prefill, when each decode token brings
    `prefill_per_engine` engine-seconds of prefill per engine and a step of any rank's prefill
    holds every rank's decodes. `ranks` 1: plain time sharing."""
    if decode_rate <= 0.0:
        return 0.0
    if prefill_per_engine <= 0.0:
        return decode_rate
    lo, hi = 0.0, min(decode_rate, 1.0 / prefill_per_engine)
    for _ in range(BISECTIONS):  # D - decode_rate (1 - D k)^R increases with D: one root
        mid = 0.5 * (lo + hi)
        if mid < decode_rate * (1.0 - mid * prefill_per_engine) ** max(1, ranks):
            lo = mid
        else:
            hi = mid
    return lo


def decode_rate(cap: Capacity, engines: int, live: float | None, colocated: bool) -> float:
    """Decode tokens per second `engines` engines reach with no prefill: each decodes its
    KV-bound batch, or its share of the `live` trajectories where they are fewer (a step's
    tail: the pools hold more than is left to decode, and a step of fewer sequences is
    shorter). None: as many as the pools hold."""
    full_seqs = cap.colocated_kv_seqs if colocated else cap.decode_kv_seqs
    seqs = full_seqs if live is None else min(full_seqs, max(1.0, live / engines))
    return engines * seqs / cap.kv_step_s_at(seqs, colocated)


def colocated_rate(cap: Capacity, n: int, q: float, live: float | None = None) -> float:
    """Decode tokens per second a saturated colocated fleet of `n` engines sustains, with at
    most `live` trajectories to decode (`decode_rate`)."""
    if n < 1:
        return 0.0
    return lockstep_rate(decode_rate(cap, n, live, colocated=True), q * cap.colocated_prefill_s_per_token / n, cap.colocated_lockstep_ranks)


def split_rate(cap: Capacity, n: int, prefill_engines: int, q: float, remote_share: float, live: float | None = None) -> float:
    """Decode tokens per second a saturated `prefill_engines`:(n - prefill_engines) split
    sustains: its prefill side's bound, or its decode side's (which prefills the local share),
    with at most `live` trajectories to decode (`decode_rate`)."""
    decode_engines = n - prefill_engines
    if prefill_engines < 1 or decode_engines < 1:
        return 0.0
    remote_tokens_s = q * remote_share * cap.prefill_s_per_token  # prefill engine-s per decode token
    prefill_bound = prefill_engines / remote_tokens_s if remote_tokens_s > 0 else float("inf")
    local_s = q * (1.0 - remote_share) * cap.decode_prefill_s_per_token / decode_engines
    decode_bound = lockstep_rate(decode_rate(cap, decode_engines, live, colocated=False), local_s, cap.decode_lockstep_ranks)
    return min(prefill_bound, decode_bound)


def turnover_rates(demand: Demand, cap: Capacity, n: int, qs: list[float]) -> list[float]:
    """Decode tokens per second a saturated fleet turns over colocated (index 0) and split
    p:(n - p) (index p), at the prefill tokens each computes per decode token (`qs`)."""
    # at most the live trajectories decode at once (a step's tail leaves the pools part-empty)
    live = demand.live_trajectories if demand.live_trajectories > 0 else None
    # a split's decode engines run KV-full here: under lockstep the router sends them no
    # appends (environment/router.py), so their prefill side computes every token
    remote_share = 1.0 if cap.decode_lockstep_ranks > 1 else demand.remote_share
    return [colocated_rate(cap, n, qs[0], live)] + [split_rate(cap, n, p, qs[p], remote_share, live) for p in range(1, n)]


def history_pools_tokens(cap: Capacity, n: int, prefill_engines: int) -> float:
    """KV an arrangement keeps the live histories in between turns (at `KV_HIGH_WATERMARK`,
    the pool occupancy loads are sized to): colocated, every engine's pool; a split with
    write-back to its prefill side, its prefill engines' pools; otherwise every engine's (no
    write-back: the decode engines keep the histories they decoded; a store tier keeps them
    for any engine). A host tier scales each pool by `history_kv_scale`."""
    if prefill_engines < 1 or not cap.histories_on_prefill:
        return KV_HIGH_WATERMARK * n * cap.colocated_kv_tokens * cap.history_kv_scale
    return KV_HIGH_WATERMARK * prefill_engines * cap.prefill_kv_tokens * cap.history_kv_scale


def kept_histories_tokens(cap: Capacity, n: int, prefill_engines: int, live_history_tokens: float, decoding_tokens: float) -> float:
    """The live histories an arrangement's history pools must keep: colocated, all of them
    (the decoding sequences' KV is in the same pools); a split with write-back to its prefill
    side, all but what its decode engines hold while they decode (the write-back restores a
    decoded turn's whole context to a prefill engine that lost its prefix). Its decode
    engines hold what colocated engines hold per engine of the decoding sequences' KV (both
    KV-bound here), `decoding_tokens` up to the colocated pools."""
    if prefill_engines < 1 or not cap.histories_on_prefill:
        return live_history_tokens
    decoding_held = min(decoding_tokens, history_pools_tokens(cap, n, 0)) * (n - prefill_engines) / n
    return max(0.0, live_history_tokens - decoding_held)


def history_miss_share(kept_tokens: float, pools_tokens: float) -> float:
    """Share of the turns whose history is no longer cached where they prefill, for histories
    of `kept_tokens` in pools of `pools_tokens`."""
    if kept_tokens <= 0:
        return 0.0
    return max(0.0, 1.0 - pools_tokens / kept_tokens)


def arrangement_ratio(
    q: float,
    q_new: float,
    cap: Capacity,
    n: int,
    prefill_engines: int,
    measured_at: int,
    live_history_tokens: float,
    decoding_tokens: float,
    history_per_decode: float,
) -> float:
    """q for the arrangement with `prefill_engines` (0: colocated), from q measured in the one
    with `measured_at` (q_new of it the turns' new tokens): more where it keeps fewer of the
    live histories, each miss recomputing `history_per_decode` tokens per decode token; never
    less (see the module's docstring). Where the live histories outgrow the measured
    arrangement's pools, its misses are read from q (what it computes beyond the new tokens,
    in histories) and the pools it keeps them in count for that much (they also hold the
    decoding sequences' growth): each arrangement's pools are scaled alike."""
    kept_measured = kept_histories_tokens(cap, n, measured_at, live_history_tokens, decoding_tokens)
    pools_measured = history_pools_tokens(cap, n, measured_at)
    miss_measured, scale = history_miss_share(kept_measured, pools_measured), 1.0
    if miss_measured > 0.0 and history_per_decode > 0.0:
        miss_measured = min(1.0, max(miss_measured, (q - q_new) / history_per_decode))
        scale = (1.0 - miss_measured) * kept_measured / pools_measured
    kept = kept_histories_tokens(cap, n, prefill_engines, live_history_tokens, decoding_tokens)
    miss = history_miss_share(kept, scale * history_pools_tokens(cap, n, prefill_engines))
    return q + max(0.0, miss - miss_measured) * history_per_decode


def arrangement_ratios(meter: RatioMeter, demand: Demand, cap: Capacity, n: int, q: float) -> list[float]:
    """q for each arrangement (index: prefill engines, 0 colocated), from `q` measured in the
    arrangement the meter read (`arrangement_ratio`); the same q for every arrangement where
    the live histories or the turns are not known."""
    reading, turns_per_decode = meter.reading(), meter.turns_per_decode
    live_tokens = demand.live_context_tokens
    if reading is None or not turns_per_decode or live_tokens <= 0 or demand.live_trajectories <= 0:
        return [q] * n
    history_per_decode = live_tokens / demand.live_trajectories * turns_per_decode
    q_new = meter.new_ratio or 0.0
    return [
        arrangement_ratio(q, q_new, cap, n, p, reading[0], live_tokens, demand.decoding_kv_tokens, history_per_decode) for p in range(n)
    ]


def saturated(working_set_tokens: float, cap: Capacity, n: int) -> bool:
    """Whether the live trajectories' KV exceeds what the whole fleet holds (at
    `KV_HIGH_WATERMARK`, the pool occupancy loads are sized to), with engines that queue
    what does not fit."""
    return cap.admission_queues and working_set_tokens > KV_HIGH_WATERMARK * n * cap.colocated_kv_tokens


def saturated_ratio(meter: RatioMeter, histories_follow: bool) -> float | None:
    """q for every arrangement in the saturated regime: the reading of now (of the arrangement
    before, while a new one settles). One figure for both sides keeps a noisy or transient
    reading from tipping the comparison; it holds where a split computes about the prefill
    work colocation does:
    * with KV write-back (`histories_follow`), each finished turn's KV goes back to the
      prefill side, whose caches keep the histories a split's turns prefill on (measured on
      DeepSeek SWE at 32 per GPU: 21.6M prefill tokens under static 2:2, 17.6M colocated);
    * without it, only where recomputing evicted histories is at least RECOMPUTE_SHARE of the
      prefill work read: then every arrangement's caches miss most of them (DeepSeek SWE at
      64 per GPU: 11.8 prefill tokens per new token colocated, 13.3 split). A fleet whose
      caches keep its histories recomputes little there, a split's decode engines would keep
      them away from its prefill side, and this model does not tell how much: None.
    None also while q is below the new tokens' share (counters out of step)."""
    reading, q_new = meter.reading(), meter.new_ratio
    if reading is None or q_new is None or reading[1] <= 0.0 or reading[1] < q_new:
        return None
    q = reading[1]
    return q if histories_follow or 1.0 - q_new / q >= RECOMPUTE_SHARE else None


def fleet_saturated(demand: Demand, cap: Capacity, n: int, prefill_engines: int, split_now: bool) -> bool:
    """`saturated`, or a split whose decode side cannot hold what it must keep: with admission
    that queues, that side runs KV-bound, not thrashing, and what each arrangement turns over
    decides."""
    if saturated(working_set_tokens(demand), cap, n):
        return True
    return cap.admission_queues and split_now and 0 < prefill_engines < n and not decode_side_holds(demand, cap, n - prefill_engines)


@dataclass(slots=True)
class RatioMeter:
    """q: prefill tokens the fleet computes per decode token it generates, read in the
    arrangement the fleet runs (by its prefill engines, 0: colocated), and the turns' new
    tokens per decode token (the workload's, whatever the arrangement), from cumulative
    counters (decayed sums, so they follow the workload). Only the arrangement of now is
    read: a figure from an earlier stretch would be of another phase of the step. The caller
    counts q only in settled stretches (right after a change the prefill side recomputes the
    KV it relocated); until the new arrangement has a reading, the one before stands. An
    engine restart, which resets its counters, is skipped."""

    last: tuple[int, int, int] | None = None
    measured_at: int | None = None  # prefill engines of the arrangement being read
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [prefill, decode] there
    ticks: int = 0  # ticks counted into `sums`
    before: tuple[int, float] | None = None  # (prefill engines, q) of the arrangement before
    new: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [new, decode]
    turns: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [turns routed, decode]
    last_turns: int | None = None

    def observe(
        self, prefilled_total: int, decoded_total: int, new_total: int, prefill_engines: int | None, turns_total: int | None = None
    ) -> None:
        """Count the tokens (and the turns routed) since the last call; q toward the arrangement
        with `prefill_engines` (None: a change settling, not q)."""
        last, self.last = self.last, (prefilled_total, decoded_total, new_total)
        last_turns, self.last_turns = self.last_turns, turns_total
        if prefill_engines is not None and prefill_engines != self.measured_at:
            reading = self.reading()
            self.before = reading if reading is not None else self.before
            self.measured_at, self.sums, self.ticks = prefill_engines, [0.0, 0.0], 0
        if last is None:
            return
        d_prefill, d_decode, d_new = prefilled_total - last[0], decoded_total - last[1], new_total - last[2]
        if min(d_prefill, d_decode, d_new) < 0:
            return
        self.new[0] = RATIO_DECAY * self.new[0] + d_new
        self.new[1] = RATIO_DECAY * self.new[1] + d_decode
        if turns_total is not None and last_turns is not None and turns_total >= last_turns:
            self.turns[0] = RATIO_DECAY * self.turns[0] + turns_total - last_turns
            self.turns[1] = RATIO_DECAY * self.turns[1] + d_decode
        if prefill_engines is not None:
            self.sums[0] = RATIO_DECAY * self.sums[0] + d_prefill
            self.sums[1] = RATIO_DECAY * self.sums[1] + d_decode
            self.ticks += 1

    def reading(self) -> tuple[int, float] | None:
        """(prefill engines, q) of the arrangement read now, or of the one before while it has
        no reading over a whole window (RATIO_MIN_TICKS: a tick or two right after a change
        would stand for the whole arrangement)."""
        if self.measured_at is not None and self.sums[1] > 0 and self.ticks >= RATIO_MIN_TICKS:
            return self.measured_at, self.sums[0] / self.sums[1]
        return self.before

    @property
    def new_ratio(self) -> float | None:
        return self.new[0] / self.new[1] if self.new[1] > 0 else None

    @property
    def turns_per_decode(self) -> float | None:
        """Turns routed per decode token generated (None: none counted)."""
        return self.turns[0] / self.turns[1] if self.turns[1] > 0 and self.turns[0] > 0 else None
