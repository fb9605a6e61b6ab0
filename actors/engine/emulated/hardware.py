"""Hardware, model and link constants for the emulated backend, each with its source.

Tags as in ``shared/reference/calibration.md``: [M] measured by the cited source, [D] derived
from [M] by a stated formula, [A] assumption. The cost model (`costmodel.py`) derives its
per-iteration constants from these specs with the roofline formulas of calibration.md.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense
    fp8_flops: float
    nvlink_bytes_per_s: float  # per direction, effective


# calibration.md 2.1 (third-party spec pages consistent with NVIDIA's datasheet).
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", 80e9, 3.35e12, 989e12, 1979e12, 300e9),  # NVLink 450 GB/s/dir peak, 300 effective [A]
    "h200": GpuSpec("h200", 141e9, 4.8e12, 989e12, 1979e12, 300e9),  # same die as H100; HBM3e 141 GB, 4.8 TB/s
}

# Efficiencies [A], calibrated in calibration.md to the two [M] TPOT points of its section 0.
ETA_BW = 0.75  # achieved / peak HBM bandwidth
ETA_FLOPS_DENSE = 0.5  # dense BF16 GEMM
ETA_FLOPS_MOE = 0.3  # MoE grouped GEMM
ETA_ATTN = 0.5  # attention kernels
KV_POOL_SHARE = 0.9  # share of HBM given to weights + KV (vLLM gpu_memory_utilization)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    n_layers: int
    n_q_heads: int
    head_dim: int
    hidden: int
    kv_bytes_per_token: int  # BF16 KV (calibration.md 3.1)
    weight_bytes_bf16: float  # all weights, BF16
    active_nonembed_params: float  # params touched per token outside embeddings
    # MoE: weights split into always-read "dense" bytes and experts touched with
    # probability 1 - (1 - top_k / n_experts)^N for N tokens in the iteration.
    moe_dense_bytes_bf16: float = 0.0
    moe_expert_bytes_bf16: float = 0.0
    moe_touch_share: float = 0.0  # top_k / n_experts


MODELS: dict[str, ModelSpec] = {
    # Qwen3-8B: 36 layers, 32 q heads x 128, 8 KV heads -> 147,456 B/token (Mooncake measured
    # 4.50 GB for 32,768 tokens [M]). 15.2 GB of BF16 weights read per step (calibration.md 7.1 [D]);
    # t_tok 30.5 us = 2 P / (0.5 x 989 TFLOPS) gives P = 7.54e9 active non-embedding-equivalent [D].
    "qwen3-8b": ModelSpec("qwen3-8b", 36, 32, 128, 4096, 147_456, 15.2e9, 7.54e9),
    # Qwen3-30B-A3B: 48 layers, 32 q heads x 128, 4 KV heads -> 98,304 B/token; 128 experts, top-8.
    # T_w = 0.67 + 16.1 f(N) ms on H200 (calibration.md 7.1 [D]): 0.67 ms x 0.75 x 4.8 TB/s = 2.41 GB
    # dense bytes, 16.1 ms x 3.6 TB/s = 58.0 GB expert bytes. t_tok 20 us [A] -> P = 2.97e9 at eta 0.3.
    "qwen3-30b-a3b": ModelSpec(
        "qwen3-30b-a3b", 48, 32, 128, 2048, 98_304, 60.4e9, 2.97e9,
        moe_dense_bytes_bf16=2.41e9, moe_expert_bytes_bf16=57.96e9, moe_touch_share=8 / 128,
    ),  # fmt: skip
    # DeepSeek-V3 (MLA): 61 layers, latent 512 + rope 64 -> 70,272 B/token BF16 (calibration.md 3.1).
    # 671 B params, FP8 weights. Served with DP attention + EP: its per-GPU constants are measured
    # figures, not derived (see DEEPSEEK_V3_EP below).
    "deepseek-v3": ModelSpec("deepseek-v3", 61, 128, 192, 7168, 70_272, 1342e9, 37e9),
}


@dataclass(frozen=True, slots=True)
class EpGroupConstants:
    """Per-GPU constants of a DP-attention + expert-parallel deployment (measured, not derived)."""

    c0_s: float  # decode floor per iteration (EP all-to-all)
    per_seq_s: float  # per decode sequence (MoE + sampling), c_b
    prefill_per_token_s: float  # per prefill token per GPU
    c_kv_s: float  # per context token read
    c_attn_s: float  # prefill attention per (new x context) token


# calibration.md 7.1, DeepSeek-V3 FP8 DP-attention + EP (per GPU):
# H100: c0 30 ms [D from LMSYS], c_b 0.15 ms/seq [D], prefill 147 us/token/GPU [M->D, 6.8k tok/s/GPU
# at 2k ISL], c_kv 45 ns [D], c_attn ~1.5 ns [A]. H200: c_b 0.12 ms [A], prefill ~140 us [A], c_kv ~32 ns [A].
DEEPSEEK_V3_EP: dict[str, EpGroupConstants] = {
    "h100": EpGroupConstants(30e-3, 0.15e-3, 147e-6, 45e-9, 1.5e-9),
    "h200": EpGroupConstants(30e-3, 0.12e-3, 140e-6, 32e-9, 1.5e-9),
}


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    t0_s: float  # fixed cost of one transfer
    bytes_per_s: float  # effective bandwidth


# calibration.md 3.2 / 7.2: T_xfer = t0 + bytes / BW_eff.
LINKS: dict[str, Link] = {
    "rdma-8x400g": Link("rdma-8x400g", 0.4e-3, 150e9),  # fit to Mooncake vLLM-v1 1P1D, 8x400G RoCE [D from M]
    "nic-400g": Link("nic-400g", 0.4e-3, 40e9),  # single 400G NIC [A]
    "nvlink": Link("nvlink", 0.4e-3, 300e9),  # intra-node NVLink, effective [A]
    "remote-store": Link("remote-store", 0.4e-3, 6e9),  # remote RDMA KV store, 5-7 GB/s effective [M]
}

# Role-switch reconfiguration regimes, model seconds (calibration.md 7.2).
SWITCH_REGIMES: dict[str, float] = {
    "instant": 0.0,  # same engine, both graph sets captured: T_drain + 0 [A]
    "sleep-wake": 3.0,  # sleep/wake: 0.1-0.8 s small models, 3-6 s large [M]; 3 s middle of the range
    "restart": 48.0,  # cold restart 30-100 s; ~48 s measured for small models on A100 [M]
}

TP_ALLREDUCE_LATENCY_S = 8e-6  # one small NCCL all-reduce inside a node [A]


# --- DP-attention lockstep (docs/calibration.md, "DP-attention lockstep constants") -------------
# Ranks of a DP-attention engine share one forward mode per step (SGLang all-gathers
# can_cuda_graph = min and is_extend_in_batch = max over ranks; vLLM syncs cudagraph_mode = min
# and pads every rank to the largest token count). Each constant: (value, (low, high)) of its
# published range; the sensitivity bench runs both ends.


@dataclass(frozen=True, slots=True)
class Ranged:
    value: float
    low: float
    high: float


# Decode step run eagerly instead of replaying its CUDA graph, time ratio eager / graph.
# MoE with EP: vLLM PR #25444 (Qwen3-Coder-30B-A3B-FP8, H100) piecewise vs full 1.47x [M];
# vLLM PR #24123 (DeepSeek-R1 DP8+EP) 1.33x [M]; SGLang PR #5068 (DeepSeek-V3, H20) 1.64x with
# normal a2a included [M]. Range 1.3-2.0, 1.5 used [D].
EAGER_DECODE_FACTOR_MOE = Ranged(1.5, 1.3, 2.0)
# Dense at batch >= 64: 1.05-1.15x (xLLM PR #713 1.08x at c=30; vLLM PR #16072 1.07x) [M].
EAGER_DECODE_FACTOR_DENSE = Ranged(1.10, 1.05, 1.15)
# vLLM piecewise (attention eager, the rest graphed) vs full graph: MoE 1.47x (PR #25444) [M],
# Kimi-K2.6 TP8 1.11x (PR #42885) [M]; dense 1.07x (PR #16072) [M].
PIECEWISE_DECODE_FACTOR_MOE = Ranged(1.47, 1.11, 1.47)
PIECEWISE_DECODE_FACTOR_DENSE = Ranged(1.07, 1.07, 1.11)
# vLLM default max_cudagraph_capture_size = min(2 x max_num_seqs, 512) tokens; larger batches
# dispatch to NONE (eager) (vllm/config/vllm.py _set_cudagraph_sizes) [M].
VLLM_GRAPH_CAPTURE_TOKENS = 512

# DeepEP low-latency dispatch + combine per MoE layer, 128 tokens/rank, hidden 7168, top-8,
# H800 + CX7 IB (deepseek-ai/DeepEP docs/legacy.md) [M], by EP size. What a graph-replayed
# decode step of DeepSeek-V3 pays inside its measured c0.
DEEPEP_LL_PER_LAYER_S: dict[int, float] = {8: 191e-6, 16: 313e-6, 32: 428e-6, 64: 487e-6, 128: 561e-6, 256: 554e-6}
# DeepEP normal mode (any rank extends under SGLang auto): bandwidth-bound, not graph-capturable.
# Intranode EP8 NVLink: dispatch 153 GB/s, combine 158 GB/s [M]; internode RDMA 43-58 GB/s [M]
# (DeepEP legacy.md). Fixed cost per call (notify kernel + CPU wait for the received count,
# "nearly double" the communication time on H20, DeepEP issue #144): 50-150 us [A], 100 used.
A2A_NORMAL_INTRANODE_BYTES_PER_S = Ranged(150e9, 150e9, 158e9)
A2A_NORMAL_FIXED_S = Ranged(100e-6, 50e-6, 150e-6)  # per MoE layer (dispatch + combine)
# Bytes per token per destination rank: FP8 dispatch (1 B) + BF16 combine (2 B) per hidden element.
A2A_NORMAL_BYTES_PER_HIDDEN = 3
# A rank with no work runs an idle forward that joins every collective (SGLang get_idle_batch,
# vLLM execute_dummy_batch) [M]: its cost is the group's collectives, which the group-wide
# all-to-all term already charges; it adds nothing beyond waiting for the slowest rank [D].
IDLE_RANK_EXTRA_S = 0.0

# MoE layers and routing (model configs) [M]: Qwen3-30B-A3B 48 MoE layers, top-8 of 128;
# DeepSeek-V3 58 MoE layers of 61 (first 3 dense), top-8 of 256.
MOE_ROUTING: dict[str, tuple[int, int, int]] = {"qwen3-30b-a3b": (48, 8, 128), "deepseek-v3": (58, 8, 256)}
