"""What one engine can serve, from the cost model (pure): the allocator's unit of capacity.

* prefill: engine-seconds per prefill token, for full chunks (each DP rank's chunk, on every
  DP rank) on top of a typical prefix;
* decode: the batch at which a decode step takes `slack` times its fastest (one sequence per
  rank) — beyond it, adding sequences mostly slows every one of them — and the KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from actors.config import EngineSection
from actors.engine.admission import rank_chunk_tokens
from actors.engine.core import KV_HIGH_WATERMARK
from actors.engine.emulated.costmodel import CostPreset, RankLoad, group_iteration_s, switch_reconfig_s
from bus_schemas.control import Role


@dataclass(frozen=True, slots=True)
class Capacity:
    prefill_s_per_token: float  # engine-seconds one prefill token costs on a prefill engine
    decode_full_seqs: int  # sequences a decode engine serves at `slack` x its fastest step
    decode_kv_tokens: int  # KV pool of a decode engine
    min_tpot_s: float  # a decode engine's fastest step (one sequence per rank)
    switch_s: float  # reconfiguration of a prefill <-> decode switch (drain comes on top)
    # the same engines colocated (their colocated layout), for the colocation-or-PD choice
    colocated_prefill_s_per_token: float = 0.0
    colocated_decode_full_seqs: int = 1
    colocated_kv_tokens: int = 1
    # where histories wait between turns: the GPU pool, and with a host tier
    # (`engines.host_kv_tier`) host memory `host_kv_ratio` times its size, loaded back rather
    # than recomputed
    history_kv_scale: float = 1.0
    # extra decode time per unit of decode load while some rank of a colocated engine
    # prefills: a DP-attention group runs every mixed step eagerly (eager factor - 1); 0
    # where the colocated layout has one rank (no lockstep)
    colocated_mixed_penalty: float = 0.0
    # DP-attention ranks of a colocated engine that run SGLang's prefill-first lockstep: one
    # rank's chunk holds every rank's decodes for the chunk's whole step (1: no lockstep)
    colocated_lockstep_ranks: int = 1
    colocated_switch_s: float = 0.0  # reconfiguration of a colocated <-> prefill or decode switch
    # without KV write-back the decode engines keep every trajectory's history between turns
    # (the next turn reuses it there or recomputes it); with write-back it goes back to the
    # prefill side, and the decode side holds only the sequences it decodes
    decode_holds_histories: bool = True
    # with write-back to the prefill side ("to-prefill"), a split keeps the live trajectories'
    # histories between turns in its prefill engines' pools (`throughput.kept_histories_tokens`)
    histories_on_prefill: bool = False
    prefill_kv_tokens: int = 1  # KV pool of a prefill engine
    # the KV-bound regime (throughput.py): sequences an engine's pool holds at the context and
    # the step time of that batch at graph speed, colocated and on a decode engine; a decode
    # engine's own prefill cost and lockstep ranks (short appends prefilled where their KV is)
    colocated_kv_seqs: int = 1
    colocated_kv_step_s: float = 1.0
    decode_kv_seqs: int = 1
    decode_kv_step_s: float = 1.0
    # ... and a step's time at a smaller batch (fewer live trajectories than the pools hold),
    # linear from one sequence per rank to that batch: engine-seconds per sequence
    # (`kv_step_s_at`)
    colocated_step_s_per_seq: float = 0.0
    decode_step_s_per_seq: float = 0.0
    decode_prefill_s_per_token: float = 0.0
    decode_lockstep_ranks: int = 1
    # engines queue what their KV cannot take instead of admitting it and preempting
    # (`engines.admission = "sglang"`)
    admission_queues: bool = False
    # the prefill cost per token is linear in the context a token attends over; the figures
    # above are at `prefill_attention_tokens` (the reference chunk's prefix + chunk / 2), and a
    # demand whose prefills attend over more or less is priced along these slopes
    # (`prefill_s_at`; engine-seconds per token per context token)
    prefill_attention_tokens: float = 0.0
    prefill_s_per_token_per_context: float = 0.0
    colocated_prefill_s_per_token_per_context: float = 0.0

    def kv_step_s_at(self, seqs: float, colocated: bool) -> float:
        """A step of `seqs` sequences per engine (at most the KV-bound batch) at graph speed."""
        full_seqs, full_s, per_seq_s = (
            (self.colocated_kv_seqs, self.colocated_kv_step_s, self.colocated_step_s_per_seq)
            if colocated
            else (self.decode_kv_seqs, self.decode_kv_step_s, self.decode_step_s_per_seq)
        )
        return full_s - per_seq_s * max(0.0, full_seqs - seqs)

    def prefill_s_at(self, attention_tokens: float, colocated: bool = False) -> float:
        """Engine-seconds per prefill token (full chunks) for tokens that attend over
        `attention_tokens` of context on average (`Demand.prefill_attention_tokens`); the
        reference figure where that is unknown (0)."""
        base = self.colocated_prefill_s_per_token if colocated else self.prefill_s_per_token
        if attention_tokens <= 0:
            return base
        slope = self.colocated_prefill_s_per_token_per_context if colocated else self.prefill_s_per_token_per_context
        return base + slope * (attention_tokens - self.prefill_attention_tokens)


@dataclass(frozen=True, slots=True)
class Scales:
    """Measured over prior, per capacity family (1.0: as the prior says)."""

    prefill: float = 1.0
    decode: float = 1.0
    mixed: float = 1.0
    kv: float = 1.0

    @property
    def unit(self) -> bool:
        return (self.prefill, self.decode, self.mixed, self.kv) == (1.0, 1.0, 1.0, 1.0)


def scaled_capacity(cap: Capacity, s: Scales) -> Capacity:
    """`cap` (the prior's) with measured factors applied (`actors.allocator.measured`): the KV
    pools and the batches they hold scaled by `s.kv`, each batch's step time read at its new
    size along the prior's slope, then every step time scaled by `s.decode`; prefill costs by
    `s.prefill` (a colocated engine's, whose prefill runs in mixed steps, by `s.mixed`)."""
    if s.unit:
        return cap
    colocated_seqs = max(1, round(cap.colocated_kv_seqs * s.kv))
    decode_seqs = max(1, round(cap.decode_kv_seqs * s.kv))
    return replace(
        cap,
        prefill_s_per_token=cap.prefill_s_per_token * s.prefill,
        prefill_s_per_token_per_context=cap.prefill_s_per_token_per_context * s.prefill,
        decode_prefill_s_per_token=cap.decode_prefill_s_per_token * s.prefill,
        colocated_prefill_s_per_token=cap.colocated_prefill_s_per_token * s.mixed,
        colocated_prefill_s_per_token_per_context=cap.colocated_prefill_s_per_token_per_context * s.mixed,
        min_tpot_s=cap.min_tpot_s * s.decode,
        colocated_kv_seqs=colocated_seqs,
        decode_kv_seqs=decode_seqs,
        colocated_kv_step_s=(cap.colocated_kv_step_s + cap.colocated_step_s_per_seq * (colocated_seqs - cap.colocated_kv_seqs)) * s.decode,
        decode_kv_step_s=(cap.decode_kv_step_s + cap.decode_step_s_per_seq * (decode_seqs - cap.decode_kv_seqs)) * s.decode,
        colocated_step_s_per_seq=cap.colocated_step_s_per_seq * s.decode,
        decode_step_s_per_seq=cap.decode_step_s_per_seq * s.decode,
        decode_kv_tokens=max(1, round(cap.decode_kv_tokens * s.kv)),
        colocated_kv_tokens=max(1, round(cap.colocated_kv_tokens * s.kv)),
        prefill_kv_tokens=max(1, round(cap.prefill_kv_tokens * s.kv)),
    )


def prefill_s_per_token(preset: CostPreset, chunk_tokens: int, prefix_tokens: int) -> float:
    ranks = [RankLoad(((chunk_tokens, prefix_tokens),), 0, 0)] * preset.dp_ranks
    return group_iteration_s(preset, ranks) / (chunk_tokens * preset.dp_ranks)


def prefill_s_per_token_per_context(preset: CostPreset, chunk_tokens: int, prefix_tokens: int) -> float:
    """How `prefill_s_per_token` grows per token of prefix (the attention term; linear)."""
    return (
        prefill_s_per_token(preset, chunk_tokens, prefix_tokens + chunk_tokens) - prefill_s_per_token(preset, chunk_tokens, prefix_tokens)
    ) / chunk_tokens


def decode_step_s(preset: CostPreset, seqs: int, context_tokens: int) -> float:
    """One decode step of `seqs` sequences of `context_tokens` each, spread over the ranks."""
    ranks = preset.dp_ranks
    per_rank = [seqs // ranks + (1 if r < seqs % ranks else 0) for r in range(ranks)]
    return group_iteration_s(preset, [RankLoad((), n, n * context_tokens) for n in per_rank])


def step_s_per_seq(preset: CostPreset, full_seqs: int, context_tokens: int) -> float:
    """The slope of a decode step's time from one sequence per rank to `full_seqs`."""
    if full_seqs <= preset.dp_ranks:
        return 0.0
    return (decode_step_s(preset, full_seqs, context_tokens) - decode_step_s(preset, preset.dp_ranks, context_tokens)) / (
        full_seqs - preset.dp_ranks
    )


def decode_full_seqs(preset: CostPreset, context_tokens: int, slack: float, cap: int, limit_s: float | None = None) -> int:
    """Largest batch (<= cap) whose step time stays within `slack` x the fastest step (or
    within `limit_s`: another layout's limit, so two layouts are held to one TPOT)."""
    if limit_s is None:
        limit_s = slack * decode_step_s(preset, preset.dp_ranks, context_tokens)
    lo, hi = preset.dp_ranks, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if decode_step_s(preset, mid, context_tokens) <= limit_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


class CapacityModel:
    """Capacity of the fleet's engines at a typical context, computed once per context bucket
    (a power of two, so the figure is stable while contexts drift a little)."""

    def __init__(self, engines: EngineSection, slack: float, truth: bool = False) -> None:
        self.engines = engines
        self.slack = slack
        # the engines' own cost model (`engines.truth`, its mean: no per-engine spread) instead
        # of the one they are priced with: the oracle's (`allocator.capacity = "truth"`)
        self.preset_of = engines.truth_preset if truth else engines.cost_preset
        self.scales = Scales()  # measured over prior (`actors.allocator.measured`)
        self._cache: dict[int, Capacity] = {}

    def at(self, context_tokens: float) -> Capacity:
        bucket = 1 << max(8, round(max(1.0, context_tokens)).bit_length() - 1)
        if bucket not in self._cache:
            self._cache[bucket] = self._compute(bucket)
        return scaled_capacity(self._cache[bucket], self.scales)

    def _compute(self, context_tokens: int) -> Capacity:
        engines = self.engines
        prefill, decode = self.preset_of(Role.PREFILL), self.preset_of(Role.DECODE)
        kv_seq_cap = max(decode.dp_ranks, int(KV_HIGH_WATERMARK * decode.kv_capacity_tokens / context_tokens))
        cap = min(engines.max_decode_seqs * decode.dp_ranks, kv_seq_cap)
        colocated = self.preset_of(Role.COLOCATED)
        colocated_cap = min(
            engines.max_decode_seqs * colocated.dp_ranks,
            max(colocated.dp_ranks, int(KV_HIGH_WATERMARK * colocated.kv_capacity_tokens / context_tokens)),
        )
        lockstep = colocated.dp_ranks > 1 and colocated.dp_sync != "ideal"

        def chunk(preset: CostPreset) -> int:  # each rank's prefill chunk
            return rank_chunk_tokens(engines.max_batch_tokens, preset.dp_ranks, engines.dp_chunk == "divided")

        return Capacity(
            prefill_s_per_token=prefill_s_per_token(prefill, chunk(prefill), context_tokens),
            decode_full_seqs=decode_full_seqs(decode, context_tokens, self.slack, cap),
            decode_kv_tokens=decode.kv_capacity_tokens,
            min_tpot_s=decode_step_s(decode, decode.dp_ranks, context_tokens),
            switch_s=switch_reconfig_s(engines, Role.PREFILL, Role.DECODE),
            colocated_prefill_s_per_token=prefill_s_per_token(colocated, chunk(colocated), context_tokens),
            # held to the decode engines' TPOT limit, so the two are compared at one token latency
            colocated_decode_full_seqs=decode_full_seqs(
                colocated, context_tokens, self.slack, colocated_cap, self.slack * decode_step_s(decode, decode.dp_ranks, context_tokens)
            ),
            colocated_kv_tokens=colocated.kv_capacity_tokens,
            history_kv_scale=1.0 + (engines.host_kv_ratio if engines.host_kv_tier else 0.0),
            colocated_mixed_penalty=colocated.eager_factor - 1.0 if lockstep else 0.0,
            colocated_lockstep_ranks=colocated.dp_ranks if lockstep and colocated.dp_sync == "sglang" else 1,
            decode_holds_histories=engines.kv_writeback == "none",
            histories_on_prefill=engines.kv_writeback == "to-prefill",
            prefill_kv_tokens=prefill.kv_capacity_tokens,
            colocated_kv_seqs=colocated_cap,
            colocated_kv_step_s=decode_step_s(colocated, colocated_cap, context_tokens),
            decode_kv_seqs=cap,
            decode_kv_step_s=decode_step_s(decode, cap, context_tokens),
            colocated_step_s_per_seq=step_s_per_seq(colocated, colocated_cap, context_tokens),
            decode_step_s_per_seq=step_s_per_seq(decode, cap, context_tokens),
            decode_prefill_s_per_token=prefill_s_per_token(decode, chunk(decode), context_tokens),
            decode_lockstep_ranks=decode.dp_ranks if engines.decode_lockstep else 1,
            admission_queues=engines.admission == "sglang",
            prefill_attention_tokens=context_tokens + chunk(prefill) / 2.0,
            prefill_s_per_token_per_context=prefill_s_per_token_per_context(prefill, chunk(prefill), context_tokens),
            colocated_prefill_s_per_token_per_context=prefill_s_per_token_per_context(colocated, chunk(colocated), context_tokens),
            colocated_switch_s=max(
                switch_reconfig_s(engines, Role.COLOCATED, Role.PREFILL), switch_reconfig_s(engines, Role.COLOCATED, Role.DECODE)
            ),
        )
