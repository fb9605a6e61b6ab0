"""Iteration-time model of the emulated backend (pure).

For one rank (a TP group) executing one scheduler iteration (docs/calibration.md, "Iteration-time model"):

    T_r = max(T_w(N), t_tok * Np_r + t_dec * B_r) + c_attn * Σ L_i (p_i + L_i / 2) + c_kv * Σ C_j + c_seq * B_r

N: new tokens of the iteration (prefill chunk tokens + decode sequences), L_i / p_i: a prefill
chunk's new tokens and the prefix already in KV, C_j: a decode sequence's context. An engine
with DP attention is a group of ranks synchronised at every MoE layer, so

    T_iter = c0 + T_a2a(N_group) + max_r T_r

— one rank that prefills stalls every rank's decode, the interference PD disaggregation
removes. With one rank this is the single-instance formula. Per-iteration constants are
derived from `hardware.py` specs (formulas of docs/calibration.md), except DeepSeek-V3's
DP-attention + EP deployment, whose per-GPU figures are taken as measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from actors.engine.emulated import hardware as hw
from actors.engine.emulated.hardware import LINKS, Link  # re-exported: the engine imports links from here

__all__ = [
    "LINKS",
    "Link",
    "CostPreset",
    "Layout",
    "RankLoad",
    "PRESETS",
    "derive",
    "iteration_s",
    "group_iteration_s",
    "switch_reconfig_s",
    "weight_sync_s",
    "with_lockstep",
    "scaled",
]


@dataclass(frozen=True, slots=True)
class Layout:
    """Parallel layout of one engine: TP inside a rank, DP-attention ranks, expert parallelism."""

    tp: int = 1
    dp: int = 1  # DP-attention ranks in the engine (each rank has tp GPUs)
    ep: int = 1  # experts split over this many GPUs (MoE only)

    @property
    def gpus(self) -> int:
        return self.tp * self.dp


@dataclass(frozen=True, slots=True)
class CostPreset:
    name: str
    c0_s: float  # per-iteration overhead (group-wide)
    t_w_base_s: float  # weight-streaming floor (dense: all of it; MoE: the always-read part)
    t_w_moe_s: float  # MoE: expert bytes per GPU, scaled by the share of experts touched
    moe_touch_share: float  # top_k / n_experts
    t_tok_s: float  # GEMM time per prefill token
    t_dec_s: float  # GEMM time per decode sequence (0 where c_seq already holds it)
    c_attn_s: float  # prefill attention per (new token x context token)
    c_kv_s: float  # decode attention per context token read
    c_seq_s: float  # per decode sequence (sampling, bookkeeping; MoE per-seq cost for EP groups)
    kv_bytes_per_token: int
    kv_capacity_tokens: int  # whole engine (all ranks)
    dp_ranks: int = 1
    a2a_latency_s: float = 0.0  # per iteration: all-to-all dispatch + combine latency, all layers
    a2a_s_per_token: float = 0.0  # per token of the group (bytes moved / link bandwidth)
    gpus: int = 1
    model: str = ""  # hardware.MODELS key
    ep: int = 1  # expert-parallel GPUs
    # DP-attention lockstep (`with_lockstep`; "ideal": ranks only wait for the slowest)
    dp_sync: str = "ideal"  # "sglang" | "vllm" | "ideal"
    mixed_chunk: bool = False  # sglang: a prefilling rank's decodes advance in the same step
    eager_factor: float = 1.0  # decode work run eagerly / graph-replayed
    piecewise_factor: float = 1.0  # vLLM piecewise / full graph
    graph_capture_tokens: int = 0  # vLLM: larger per-rank batches run eagerly
    a2a_ll_s: float = 0.0  # low-latency all-to-all of a graph step that normal mode replaces (DeepSeek: inside c0)
    a2a_normal_fixed_s: float = 0.0  # normal-mode all-to-all: fixed cost per step, all MoE layers
    a2a_normal_s_per_token: float = 0.0  # ... per token of the busiest rank
    # DP attention + EP: share of t_tok / t_dec that is routed-expert work, run by the GPUs that
    # host the experts a token is sent to, so spread over the group (`_rank_s`); 0 otherwise
    routed_share: float = 0.0

    def weight_s(self, new_tokens: int) -> float:
        if self.t_w_moe_s == 0.0:
            return self.t_w_base_s
        return self.t_w_base_s + self.t_w_moe_s * (1.0 - (1.0 - self.moe_touch_share) ** new_tokens)


@dataclass(frozen=True, slots=True)
class RankLoad:
    """What one DP rank runs in an iteration."""

    prefill_chunks: tuple[tuple[int, int], ...] = ()  # (new tokens, prefix tokens)
    decode_seqs: int = 0
    decode_context_tokens: int = 0

    @property
    def new_tokens(self) -> int:
        return sum(n for n, _ in self.prefill_chunks) + self.decode_seqs


def gemm_efficiency(m: float, k: float, n: float) -> float:
    """Achieved / peak BF16 tensor FLOPs of an M x K x N GEMM on one GPU: the measured square-matmul
    table (hardware.GEMM_BF16_EFFICIENCY) read at the cube root of the volume, log-interpolated;
    below the table it falls in proportion to size, above it stays at the last entry."""
    size = (m * k * n) ** (1.0 / 3.0)
    pts = hw.GEMM_BF16_EFFICIENCY
    if size <= pts[0][0]:
        return pts[0][1] * size / pts[0][0]
    for (s0, e0), (s1, e1) in zip(pts, pts[1:]):
        if size <= s1:
            return e0 + (e1 - e0) * math.log(size / s0) / math.log(s1 / s0)
    return pts[-1][1]


def attention_s(model: hw.ModelSpec, gpu: hw.GpuSpec, tp: int = 1) -> float:
    """Prefill attention per (new token x context token): QK^T and PV, 4 FLOPs per head dim per head
    per layer, in BF16 even for FP8 models (docs/calibration.md "Iteration-time model")."""
    return 4 * model.n_layers * model.n_q_heads * model.head_dim / (hw.ETA_ATTN * gpu.bf16_flops) / tp


def derive(gpu_name: str, model_name: str, fp8: bool = False, layout: Layout = Layout()) -> CostPreset:
    """Per-iteration constants from specs (docs/calibration.md, "Iteration-time model").

    FP8 is scaled per component: linear-layer weights stream at half the bytes (the LM head stays
    BF16), GEMMs run FP8_GEMM_SPEEDUP faster, non-GEMM prefill work, attention and the KV cache do
    not change. Under TP each GPU runs 1/tp of every GEMM at the efficiency of its smaller matrix
    and adds two all-reduces of the layer's activations per layer over NVLink."""
    gpu, model = hw.GPUS[gpu_name], hw.MODELS[model_name]
    name = f"{gpu_name}-{model_name}{'-fp8' if fp8 else ''}"
    if model_name == "deepseek-v3":
        return _deepseek_ep(gpu, name, layout)
    tp = layout.tp
    w_scale = 0.5 if fp8 else 1.0
    bw = hw.ETA_BW * gpu.hbm_bytes_per_s
    moe = model.moe_expert_bytes_bf16 > 0
    ref = hw.GEMM_REF_TOKENS
    if moe:  # grouped GEMM [A], degraded by TP as a dense GEMM of the same per-GPU shape would be
        eta_prefill = (
            hw.ETA_FLOPS_MOE * gemm_efficiency(ref, model.hidden, model.hidden / tp) / gemm_efficiency(ref, model.hidden, model.hidden)
        )
        eta_decode = eta_prefill
    else:
        eta_prefill = gemm_efficiency(ref, model.hidden, model.hidden / tp)
        eta_decode = hw.GEMM_BF16_EFFICIENCY[-1][1]  # skinny decode GEMMs: the roofline max() holds the rest
    flops = 2 * model.active_nonembed_params
    gemm_prefill_bf16 = flops / (eta_prefill * gpu.bf16_flops) / tp
    fp8_div = hw.FP8_GEMM_SPEEDUP if fp8 else 1.0
    allreduce_per_token = 0.0
    if tp > 1:  # ring all-reduce of the attention and MLP outputs, BF16 activations, every layer
        allreduce_per_token = 2 * model.n_layers * model.hidden * 2 * 2 * (tp - 1) / tp / hw.NCCL_ALLREDUCE_BUSBW
    t_tok = gemm_prefill_bf16 / fp8_div + hw.PREFILL_NON_GEMM_SHARE * gemm_prefill_bf16 + allreduce_per_token
    t_dec = flops / (eta_decode * gpu.bf16_flops) / tp / fp8_div + allreduce_per_token
    lm_head = model.lm_head_bytes_bf16
    if moe:
        dense_bytes = ((model.moe_dense_bytes_bf16 - lm_head) * w_scale + lm_head) / tp
        expert_bytes = model.moe_expert_bytes_bf16 * w_scale / (tp * layout.ep)
    else:
        dense_bytes, expert_bytes = ((model.weight_bytes_bf16 - lm_head) * w_scale + lm_head) / tp, 0.0
    embedding_bytes = lm_head / tp  # resident, not streamed (untied input embedding, same size as the head)
    free_bytes = hw.KV_POOL_SHARE * gpu.hbm_bytes - dense_bytes - expert_bytes - embedding_bytes
    if free_bytes <= 0:
        raise ValueError(f"{name} with {layout} does not fit: weights exceed {hw.KV_POOL_SHARE:.0%} of HBM per GPU")
    allreduce_s = 2 * model.n_layers * hw.TP_ALLREDUCE_LATENCY_S if tp > 1 else 0.0
    moe_fixed_s = model.moe_layers * hw.MOE_LAYER_FIXED_S
    a2a_latency_s, a2a_per_token = 0.0, 0.0
    if layout.dp > 1:  # dispatch + combine per MoE layer: 2 small collectives, bf16 activations [A]
        a2a_latency_s = 2 * model.n_layers * hw.TP_ALLREDUCE_LATENCY_S
        a2a_per_token = 2 * model.n_layers * model.hidden * 2 / (gpu.nvlink_bytes_per_s * layout.dp)
    return CostPreset(
        name=name,
        c0_s=hw.C0_DENSE_S + moe_fixed_s + allreduce_s,
        t_w_base_s=dense_bytes / bw,
        t_w_moe_s=expert_bytes / (hw.ETA_BW_MOE * gpu.hbm_bytes_per_s),
        moe_touch_share=model.moe_touch_share,
        t_tok_s=t_tok,
        t_dec_s=t_dec,
        c_attn_s=attention_s(model, gpu, tp),
        c_kv_s=model.kv_bytes_per_token / bw / tp,
        c_seq_s=hw.C_SEQ_S,
        kv_bytes_per_token=model.kv_bytes_per_token,
        kv_capacity_tokens=int(free_bytes * tp / model.kv_bytes_per_token) * layout.dp,
        dp_ranks=layout.dp,
        a2a_latency_s=a2a_latency_s,
        a2a_s_per_token=a2a_per_token,
        gpus=layout.gpus,
        model=model_name,
        ep=layout.ep,
        routed_share=model.routed_share if moe and layout.ep > 1 and layout.dp > 1 else 0.0,
    )


def _deepseek_ep(gpu: hw.GpuSpec, name: str, layout: Layout) -> CostPreset:
    """DeepSeek-V3 FP8 with DP attention + EP: measured per-GPU constants (hardware.DEEPSEEK_V3_EP),
    attention by the common formula (attention_s)."""
    if layout.tp != 1 or layout.ep < 2:
        raise ValueError(f"{name}: DeepSeek-V3 presets model DP attention + EP (tp=1, ep>=2), got {layout}")
    k = hw.DEEPSEEK_V3_EP[gpu.name]
    model = hw.MODELS["deepseek-v3"]
    weights_per_gpu = model.weight_bytes_bf16 * 0.5 / layout.ep  # FP8 weights spread over the EP group
    free_bytes = hw.KV_POOL_SHARE * gpu.hbm_bytes - weights_per_gpu
    if free_bytes <= 0:
        raise ValueError(f"{name} with {layout} does not fit: {weights_per_gpu / 1e9:.0f} GB of weights per GPU")
    c_attn = attention_s(model, gpu)  # the formula every other model uses, per GPU (DP attention: no TP split)
    return CostPreset(
        name=name if name.endswith("-fp8") else name + "-fp8",
        c0_s=k.c0_s,  # includes the EP all-to-all
        t_w_base_s=0.0,
        t_w_moe_s=0.0,
        moe_touch_share=0.0,
        # measured 1/throughput at the reference prompt length, less that prompt's mean attention cost
        t_tok_s=k.prefill_per_token_s - c_attn * hw.DEEPSEEK_V3_PREFILL_ISL / 2,
        t_dec_s=0.0,  # in c_seq (c_b)
        c_attn_s=c_attn,
        c_kv_s=k.c_kv_s,
        c_seq_s=k.per_seq_s,
        kv_bytes_per_token=model.kv_bytes_per_token,
        kv_capacity_tokens=int(free_bytes / model.kv_bytes_per_token) * layout.dp,
        dp_ranks=layout.dp,
        gpus=layout.gpus,
        model="deepseek-v3",
        ep=layout.ep,
        # the measured t_tok is a per-GPU figure with every rank prefilling alike, so it already
        # holds the spread: equal loads price as measured, a lone rank's prefill less (`_rank_s`)
        routed_share=model.routed_share if layout.dp > 1 else 0.0,
    )


def _presets() -> dict[str, CostPreset]:
    out: dict[str, CostPreset] = {}
    for gpu in ("h100", "h200"):
        for fp8 in (False, True):
            p = derive(gpu, "qwen3-8b", fp8)
            out[p.name] = p
            p = derive(gpu, "qwen3-30b-a3b", fp8)
            out[p.name] = p
    out["h200-deepseek-v3-fp8"] = derive("h200", "deepseek-v3", True, Layout(dp=8, ep=8))
    out["h100-deepseek-v3-fp8"] = derive("h100", "deepseek-v3", True, Layout(dp=16, ep=16))
    return out


PRESETS: dict[str, CostPreset] = _presets()


def with_layout(preset_name: str, layout: Layout) -> CostPreset:
    """A named preset re-derived for another parallel layout."""
    base = PRESETS[preset_name]
    gpu, rest = preset_name.split("-", 1)
    fp8 = rest.endswith("-fp8")
    model = rest.removesuffix("-fp8")
    return replace(derive(gpu, model, fp8, layout), name=base.name + f"@tp{layout.tp}dp{layout.dp}ep{layout.ep}")


def with_lockstep(preset: CostPreset, dp_sync: str, mixed_chunk: bool = False, end: str = "value") -> CostPreset:
    """`preset` with the forward-mode coupling of its DP-attention ranks (docs/calibration.md,
    "DP-attention lockstep constants"). `end` picks each constant's published value, or the
    end of its range with the least ("low") or the most ("high") penalty."""
    if preset.dp_ranks <= 1 or dp_sync == "ideal":
        return replace(preset, dp_sync="ideal", mixed_chunk=mixed_chunk)

    def pick(r: hw.Ranged, penalty_grows: bool = True) -> float:
        if end == "value":
            return r.value
        return r.low if (end == "low") == penalty_grows else r.high

    routing = hw.MOE_ROUTING.get(preset.model)
    fixed_s = per_token_s = ll_s = 0.0
    if routing is not None and preset.ep > 1:
        layers, top_k, _ = routing
        fanout = preset.ep * (1.0 - (1.0 - 1.0 / preset.ep) ** top_k)  # ranks a token is sent to
        bytes_per_token = hw.MODELS[preset.model].hidden * hw.A2A_NORMAL_BYTES_PER_HIDDEN * fanout
        fixed_s = layers * pick(hw.A2A_NORMAL_FIXED_S)
        per_token_s = layers * bytes_per_token / pick(hw.A2A_NORMAL_INTRANODE_BYTES_PER_S, penalty_grows=False)
        if preset.a2a_latency_s == 0.0 and preset.a2a_s_per_token == 0.0:  # measured c0 holds the LL a2a
            ep = min((e for e in hw.DEEPEP_LL_PER_LAYER_S if e >= preset.ep), default=max(hw.DEEPEP_LL_PER_LAYER_S))
            ll_s = layers * hw.DEEPEP_LL_PER_LAYER_S[ep]
    moe = routing is not None
    return replace(
        preset,
        dp_sync=dp_sync,
        mixed_chunk=mixed_chunk,
        eager_factor=pick(hw.EAGER_DECODE_FACTOR_MOE if moe else hw.EAGER_DECODE_FACTOR_DENSE),
        piecewise_factor=pick(hw.PIECEWISE_DECODE_FACTOR_MOE if moe else hw.PIECEWISE_DECODE_FACTOR_DENSE),
        graph_capture_tokens=hw.VLLM_GRAPH_CAPTURE_TOKENS,
        a2a_ll_s=ll_s,
        a2a_normal_fixed_s=fixed_s,
        a2a_normal_s_per_token=per_token_s,
    )


def _rank_s(
    preset: CostPreset,
    load: RankLoad,
    weight_s: float,
    decode_factor: float = 1.0,
    gemm_tokens: int = 0,
    spread: float = 0.0,
    mean_tok: float = 0.0,
    mean_dec: float = 0.0,
) -> float:
    """One rank's forward. `decode_factor` scales its decode work (eager or piecewise instead of
    a replayed graph); `gemm_tokens` pads its GEMMs to that many tokens (vLLM DP padding).

    `spread` (the preset's routed share under DP attention + EP, else 0): that share of the GEMM
    work is routed-expert work, which runs where the experts are, evenly over the ranks; the rank
    pays it for the group's mean GEMM tokens (`mean_tok` prefill and padding tokens, `mean_dec`
    decode sequences per rank) and the rest for its own. Equal loads give the unspread cost."""
    prefill_tokens = sum(n for n, _ in load.prefill_chunks)
    pad = gemm_tokens - load.new_tokens if gemm_tokens > load.new_tokens else 0
    if spread:
        tok = prefill_tokens + pad
        tok += spread * (mean_tok - tok)
        dec = load.decode_seqs + spread * (mean_dec - load.decode_seqs)
        gemm = preset.t_tok_s * tok + preset.t_dec_s * dec
    else:
        dec = load.decode_seqs
        gemm = preset.t_tok_s * prefill_tokens + preset.t_dec_s * dec
        if pad:
            gemm += preset.t_tok_s * pad
    attn = sum(n * (p + n / 2.0) for n, p in load.prefill_chunks)
    decode_s = preset.c_kv_s * load.decode_context_tokens + preset.c_seq_s * load.decode_seqs
    t = max(weight_s, gemm) + preset.c_attn_s * attn + decode_s
    if decode_factor != 1.0 and load.decode_seqs:  # the decode-only forward this rank would run, slowed
        t += (decode_factor - 1.0) * (max(weight_s, preset.t_dec_s * dec) + decode_s)
    return t


def group_iteration_s(preset: CostPreset, ranks: Sequence[RankLoad]) -> float:
    """One iteration of an engine whose ranks run `ranks` (idle ranks still wait for the slowest).

    With DP attention the ranks share one forward mode (`preset.dp_sync`):
    * "sglang": a decode-only step replays graphs with low-latency all-to-all; if any rank
      prefills, every rank runs eager (its decode work x `eager_factor`) and the all-to-all
      runs in normal mode (bandwidth-bound on the busiest rank's tokens);
    * "vllm": if any rank's batch exceeds the graph capture size every rank runs eager, else a
      mixed step runs every rank piecewise, padded to the largest rank's tokens;
    * "ideal": ranks only wait for the slowest.

    Under DP attention + EP the routed-expert share of every rank's GEMM work is spread over
    the group (`_rank_s`): ranks absent from `ranks` count as idle.
    """
    new_tokens = sum(r.new_tokens for r in ranks)
    if new_tokens == 0:
        return 0.0
    weight_s = preset.weight_s(new_tokens)
    dp = preset.dp_ranks
    a2a_s = preset.a2a_latency_s + preset.a2a_s_per_token * new_tokens if dp > 1 else 0.0
    mode = preset.dp_sync if dp > 1 else "ideal"
    mixed = mode != "ideal" and any(r.prefill_chunks for r in ranks)
    # Routed experts: a token's top-k experts sit on the EP GPUs (ep = dp x tp in every preset),
    # each rank's tp GPUs hosting ep / dp of them, so the group's routed work lands evenly on
    # the dp ranks. Were ep < dp x tp, replicated experts would spread it the same way.
    spread = preset.routed_share if dp > 1 else 0.0
    mean_tok = mean_dec = 0.0
    if spread:
        decode_seqs = sum(r.decode_seqs for r in ranks)
        mean_tok, mean_dec = (new_tokens - decode_seqs) / dp, decode_seqs / dp
    if mode == "ideal" or not mixed and mode == "sglang":
        return preset.c0_s + a2a_s + max(_rank_s(preset, r, weight_s, 1.0, 0, spread, mean_tok, mean_dec) for r in ranks)
    if mode == "sglang":  # some rank extends: all eager, normal-mode all-to-all
        busiest = max(r.new_tokens for r in ranks)
        a2a_s = preset.a2a_normal_fixed_s + preset.a2a_normal_s_per_token * busiest - preset.a2a_ll_s
        f = preset.eager_factor
        return preset.c0_s + a2a_s + max(_rank_s(preset, r, weight_s, f, 0, spread, mean_tok, mean_dec) for r in ranks)
    busiest = max(r.new_tokens for r in ranks)  # vllm
    if busiest > preset.graph_capture_tokens:
        f = preset.eager_factor
        return preset.c0_s + a2a_s + max(_rank_s(preset, r, weight_s, f, 0, spread, mean_tok, mean_dec) for r in ranks)
    if not mixed:
        return preset.c0_s + a2a_s + max(_rank_s(preset, r, weight_s, 1.0, 0, spread, mean_tok, mean_dec) for r in ranks)
    if spread:  # every listed rank is padded to the busiest: the padding tokens are routed too
        mean_tok += (len(ranks) * busiest - new_tokens) / dp
    f = preset.piecewise_factor
    return preset.c0_s + a2a_s + max(_rank_s(preset, r, weight_s, f, busiest, spread, mean_tok, mean_dec) for r in ranks)


def iteration_s(
    preset: CostPreset,
    prefill_chunks: Sequence[tuple[int, int]],
    decode_seqs: int,
    decode_context_tokens: int,
) -> float:
    """One iteration of a single-rank engine."""
    return group_iteration_s(preset, [RankLoad(tuple(prefill_chunks), decode_seqs, decode_context_tokens)])


def group_decode_run_s(preset: CostPreset, ranks: Sequence[RankLoad], iterations: int) -> float:
    """`iterations` decode-only iterations of a fixed batch whose contexts grow by one token per step."""
    if iterations <= 0 or not any(r.decode_seqs for r in ranks):
        return 0.0
    mean = [RankLoad((), r.decode_seqs, round(r.decode_context_tokens + r.decode_seqs * (iterations - 1) / 2.0)) for r in ranks]
    return iterations * group_iteration_s(preset, mean)


def decode_run_s(preset: CostPreset, decode_seqs: int, decode_context_tokens: int, iterations: int) -> float:
    return group_decode_run_s(preset, [RankLoad((), decode_seqs, decode_context_tokens)], iterations)


def host_copy_s(preset: CostPreset, tokens: int) -> float:
    """One DP rank's copy of `tokens` of KV to or from host memory: its GPUs' PCIe links
    (hardware.HOST_LINK_BYTES_PER_S each) side by side, as the KV is spread over them."""
    gpus_per_rank = max(1, preset.gpus // max(1, preset.dp_ranks))
    return tokens * preset.kv_bytes_per_token / (hw.HOST_LINK_BYTES_PER_S * gpus_per_rank)


def transfer_s(link: Link, kv_bytes: int) -> float:
    return link.t0_s + kv_bytes / link.bytes_per_s


def weight_sync_bytes(preset: CostPreset) -> int:
    """Bytes of a new policy version's weights: the BF16 weights a decode step reads
    (hardware.MODELS, from each model's config.json) plus the input embedding table, which has
    the untied LM head's shape (vocab x hidden) in these models [M: config.json]."""
    model = hw.MODELS[preset.model]
    return int(model.weight_bytes_bf16 + model.lm_head_bytes_bf16)


def weight_sync_s(preset: CostPreset, link: Link) -> float:
    """A weight update mid-rollout (run.mode = "async"): the model's bytes over the engine's
    link (engines.link), as a KV transfer of that size would take (`transfer_s`)."""
    return transfer_s(link, weight_sync_bytes(preset))


def scaled(preset: CostPreset, prefill: float = 1.0, decode: float = 1.0, kv: float = 1.0) -> CostPreset:
    """`preset` with its prefill compute (GEMM time per prefill token, prefill attention) times
    `prefill`, its decode work (weight reads, GEMM time per decode sequence, KV reads,
    per-sequence cost) times `decode`, and its KV pool times `kv`: engines whose truth differs
    from the model they are priced with (`engines.truth`)."""
    if (prefill, decode, kv) == (1.0, 1.0, 1.0):
        return preset
    return replace(
        preset,
        name=f"{preset.name}*p{prefill:g}d{decode:g}kv{kv:g}",
        t_tok_s=preset.t_tok_s * prefill,
        c_attn_s=preset.c_attn_s * prefill,
        t_w_base_s=preset.t_w_base_s * decode,
        t_w_moe_s=preset.t_w_moe_s * decode,
        t_dec_s=preset.t_dec_s * decode,
        c_kv_s=preset.c_kv_s * decode,
        c_seq_s=preset.c_seq_s * decode,
        kv_capacity_tokens=max(1, round(preset.kv_capacity_tokens * kv)),
    )


def prefill_s(preset: CostPreset, new_tokens: int, prefix_tokens: int = 0) -> float:
    """A lone prefill of `new_tokens` on top of `prefix_tokens` of cached KV, in one iteration."""
    return iteration_s(preset, [(new_tokens, prefix_tokens)], 0, 0)


def switch_reconfig_s(engines, old_role, new_role) -> float:
    """Reconfiguration time of a role switch (after draining): the configured regime, and at
    least a sleep/wake-like reload when the switch changes the engine's parallel layout."""
    regime_s = hw.SWITCH_REGIMES[engines.switch_regime]
    if engines.layout_for(old_role) != engines.layout_for(new_role):
        return max(regime_s, hw.SWITCH_REGIMES["sleep-wake"])
    return regime_s
