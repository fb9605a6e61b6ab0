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
