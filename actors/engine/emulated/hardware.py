"""Hardware, model and link constants for the emulated backend, each with its source.

Tags as in ``docs/calibration.md``: [M] measured by the cited source, [D] derived from [M] by a
stated formula, [A] assumption. The cost model (`costmodel.py`) derives its per-iteration
constants from these specs with the formulas of docs/calibration.md ("Iteration-time model");
every constant below is listed there with its source.
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


# docs/calibration.md "Hardware" (third-party spec pages consistent with NVIDIA's datasheet).
GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", 80e9, 3.35e12, 989e12, 1979e12, 300e9),  # NVLink 450 GB/s/dir peak, 300 effective [A]
    "h200": GpuSpec("h200", 141e9, 4.8e12, 989e12, 1979e12, 300e9),  # same die as H100; HBM3e 141 GB, 4.8 TB/s
}

# Efficiencies (docs/calibration.md "Constants").
ETA_BW = 0.75  # achieved / peak HBM bandwidth, dense weight streaming [D from the fitting set's two TPOT points]
ETA_FLOPS_MOE = 0.3  # MoE grouped GEMM at prefill sizes [A]
ETA_ATTN = 0.5  # attention kernels (FlashAttention-3 paper, arXiv 2407.08608: 0.5-0.75 of BF16 peak on H100) [D]
KV_POOL_SHARE = 0.9  # share of HBM given to weights + KV (vLLM gpu_memory_utilization)

# Dense BF16 GEMM efficiency by matrix size: square M=N=K matmul on one H100 SXM, PyTorch 2.7 /
# cuBLAS, achieved TFLOPS (github.com/zzc0721/torch-performance-test-data issue #79) [M]:
# 1024: 176.6, 2048: 676.6, 4096: 788.7, 8192: 797.5. A layer's per-GPU GEMM M x K x N/tp is read
# at the cube root of its volume, log-interpolated (costmodel.gemm_efficiency) [D].
GEMM_BF16_EFFICIENCY: tuple[tuple[int, float], ...] = ((1024, 176.6 / 989), (2048, 676.6 / 989), (4096, 788.7 / 989), (8192, 797.5 / 989))
# Prefill chunk a GEMM's efficiency is read at: vLLM V1's default chunked-prefill budget of 2048
# tokens per step (max_num_batched_tokens for online serving) [A: engine default, not a measurement].
GEMM_REF_TOKENS = 2048
# Prefill work outside GEMMs (norms, rotary, activations, sampling, kernel gaps) per token, as a
# share of the BF16 GEMM time; it does not speed up with FP8 [A]. 0.25 makes single-GPU BF16
# prefill run at 0.61 effective GEMM efficiency, which the fitting set's FP8 prefill point confirms.
PREFILL_NON_GEMM_SHARE = 0.25
# FP8 GEMM speed-up over BF16 with per-token dynamic activation quantisation included: 966.8 vs
# 593.3 TFLOPS at M=256, N=43008, K=5376 (vLLM PR #49363 benchmark, fp8-tensor-w-token-a vs
# torch-bf16) [M]. Applies to GEMMs only; attention and KV stay BF16.
FP8_GEMM_SPEEDUP = 966.8 / 593.3
# NCCL ring all-reduce bus bandwidth on 8x H100 NVLink4: "NCCL can get an effective NVLink bandwidth
# of 370GB/s" (NCCL maintainer, github.com/NVIDIA/nccl-tests issue #212) [M]. A TP all-reduce of
# B bytes takes 2 (tp-1)/tp x B / busbw, two per layer (attention and MLP outputs) [D].
NCCL_ALLREDUCE_BUSBW = 370e9
# Fused-MoE kernel cost per MoE layer: t = fixed + touched expert bytes / (eta x BW). From vLLM PR
# #24700 (benchmark_moe.py, Qwen3-30B-A3B, tp 1, fp8_w8a8, H100 [A: GPU as in the PR's other
# figures]): 40.4 us at 1 token (8 experts, 37.7 MB) and 237.3 us at 64 tokens (125 experts,
# 591 MB) [M] -> 27 us fixed (routing, align, two GEMM launches) and 0.84 of HBM bandwidth [D];
# it predicts the PR's 8- and 128-token figures within 5%.
MOE_LAYER_FIXED_S = 27e-6
ETA_BW_MOE = 0.84
# Per-iteration CPU/launch overhead of a dense engine with CUDA graphs: 1.0 ms [D from the gpustack
# Qwen3-8B TPOT fitting point]; per decode sequence (sampling, bookkeeping): 10 us [A].
C0_DENSE_S = 1.0e-3
C_SEQ_S = 1.0e-5


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    n_layers: int
    n_q_heads: int
    head_dim: int
    hidden: int
    kv_bytes_per_token: int  # BF16 KV (docs/calibration.md "Models")
    weight_bytes_bf16: float  # BF16 weights read per decode step (all but the input embedding table)
    active_nonembed_params: float  # params touched per token outside embeddings and LM head
    # MoE: weights split into always-read "dense" bytes and experts touched with
    # probability 1 - (1 - top_k / n_experts)^N for N tokens in the iteration.
    moe_dense_bytes_bf16: float = 0.0
    moe_expert_bytes_bf16: float = 0.0
    moe_touch_share: float = 0.0  # top_k / n_experts
    lm_head_bytes_bf16: float = 0.0  # stays BF16 in FP8 checkpoints (quantisation config "ignore": lm_head)
    moe_layers: int = 0  # layers with a fused-MoE kernel
    # MoE: routed-expert params touched per token (layers x top_k x 3 x hidden x moe_intermediate);
    # the rest of active_nonembed_params (attention, shared expert, dense layers, router) is "dense".
    routed_active_params: float = 0.0

    @property
    def routed_share(self) -> float:
        """Routed experts' share of the per-token GEMM work (docs/calibration.md, "Routed experts
        under expert parallelism"): what expert parallelism spreads over the EP group."""
        return self.routed_active_params / self.active_nonembed_params


MODELS: dict[str, ModelSpec] = {
    # Every figure from the model's Hugging Face config.json [M] by the arithmetic shown [D]
    # (docs/calibration.md "Models"). KV bytes/token = layers x kv_heads x head_dim x 2 (K, V) x 2 B.
    # Qwen3-8B: 36 layers, 32 q heads x 128, 8 KV heads -> 147,456 B/token (Mooncake measured 4.50 GB
    # for 32,768 tokens [M]); hidden 4096, FFN 12288, vocab 151,936 untied: 6.95e9 non-embedding
    # params, 15.2 GB of BF16 weights read per step, LM head 1.245 GB.
    "qwen3-8b": ModelSpec("qwen3-8b", 36, 32, 128, 4096, 147_456, 15.2e9, 6.95e9, lm_head_bytes_bf16=1.245e9),
    # Qwen3-30B-A3B: 48 layers, 32 q heads x 128, 4 KV heads -> 98,304 B/token; 128 experts of
    # 3 x 2048 x 768, top-8, every layer MoE. Always-read bytes 2.41 GB (attention 0.91e9 params,
    # LM head, router, norms), expert bytes 57.96 GB; active 2.73e9 non-embedding params per token.
    # Routed active per token: 48 layers x top-8 x 3 x 2048 x 768 (moe_intermediate_size, no shared
    # expert) = 1.812e9; the rest is attention 0.906e9 + router 0.013e9 -> routed share 0.664.
    "qwen3-30b-a3b": ModelSpec(
        "qwen3-30b-a3b",
        48,
        32,
        128,
        2048,
        98_304,
        60.4e9,
        2.73e9,
        moe_dense_bytes_bf16=2.41e9,
        moe_expert_bytes_bf16=57.96e9,
        moe_touch_share=8 / 128,
        lm_head_bytes_bf16=0.622e9,
        moe_layers=48,
        routed_active_params=1.812e9,
    ),
    # DeepSeek-V3 (MLA): 61 layers, latent 512 + rope 64 -> 70,272 B/token BF16; 128 heads, q/k head
    # dim 192 (128 nope + 64 rope). 671 B params, FP8 weights. Served with DP attention + EP: its
    # per-GPU throughput constants are measured figures (see DEEPSEEK_V3_EP below).
    # Active non-embedding params per token, hidden 7168: MLA attention 61 x (7168 x 1536 +
    # 1536 x 128 x 192 + 7168 x 576 + 512 x 128 x 256 + 128 x 128 x 7168) = 11.41e9; 3 dense MLP
    # layers 3 x 3 x 7168 x 18432 = 1.19e9; 58 MoE layers (first_k_dense_replace 3): shared expert
    # 58 x 3 x 7168 x 2048 = 2.55e9, router 58 x 7168 x 256 = 0.11e9, routed top-8 of 256
    # 58 x 8 x 3 x 7168 x 2048 (moe_intermediate_size) = 20.43e9 -> 35.70e9 (+ LM head 0.93e9 =
    # 36.6e9, DeepSeek's README_WEIGHTS.md; + input embedding 0.93e9 = the model card's "37B
    # activated"). Routed share 20.43 / 35.70 = 0.572.
    "deepseek-v3": ModelSpec("deepseek-v3", 61, 128, 192, 7168, 70_272, 1342e9, 35.70e9, routed_active_params=20.43e9),
    # Validation-only models (runners/calibration.py VALIDATION), no preset:
    # Llama-3.1-8B: 32 layers, 32 q heads x 128, 8 KV heads -> 131,072 B/token; hidden 4096, FFN 14336,
    # vocab 128,256 untied: 6.98e9 non-embedding params, 15.01 GB read per step, LM head 1.05 GB.
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 32, 32, 128, 4096, 131_072, 15.01e9, 6.98e9, lm_head_bytes_bf16=1.05e9),
    # Llama-3-70B / 3.3-70B: 80 layers, 64 q heads x 128, 8 KV heads -> 327,680 B/token; hidden 8192,
    # FFN 28672: 68.45e9 non-embedding params, 139.0 GB read per step, LM head 2.10 GB.
    "llama-3-70b": ModelSpec("llama-3-70b", 80, 64, 128, 8192, 327_680, 139.0e9, 68.45e9, lm_head_bytes_bf16=2.10e9),
    # Mixtral-8x7B: 32 layers, 32 q heads x 128, 8 KV heads -> 131,072 B/token; 8 experts of
    # 3 x 4096 x 14336, top-2: always-read 2.95 GB (attention 1.34e9 params + LM head), experts 90.2 GB;
    # active 12.62e9 non-embedding params per token, of which routed 32 x 2 x 3 x 4096 x 14336 = 11.27e9.
    "mixtral-8x7b": ModelSpec(
        "mixtral-8x7b",
        32,
        32,
        128,
        4096,
        131_072,
        93.2e9,
        12.62e9,
        moe_dense_bytes_bf16=2.95e9,
        moe_expert_bytes_bf16=90.2e9,
        moe_touch_share=2 / 8,
        lm_head_bytes_bf16=0.262e9,
        moe_layers=32,
        routed_active_params=11.27e9,
    ),
}


@dataclass(frozen=True, slots=True)
class EpGroupConstants:
    """Per-GPU constants of a DP-attention + expert-parallel deployment (measured, not derived)."""

    c0_s: float  # decode floor per iteration (EP all-to-all)
    per_seq_s: float  # per decode sequence (MoE + sampling), c_b
    prefill_per_token_s: float  # per prefill token per GPU
    c_kv_s: float  # per context token read
    c_attn_s: float  # prefill attention per (new x context) token


# DeepSeek-V3 FP8 DP-attention + EP, per GPU (docs/calibration.md "DeepSeek-V3"):
# H100: c0 30 ms [D from LMSYS], c_b 0.15 ms/seq [D], c_kv 45 ns [D]. Prefill: LMSYS measured
# 6.8k tok/s/GPU at 2k ISL [M]; the per-token GEMM/MoE share is what is left of 1/6800 s once the
# attention term (c_attn by the same formula as every other model, costmodel.derive) is taken
# out: 147.1 us - c_attn x 1024 [D, done in costmodel._deepseek_ep]. H200: c_b 0.12 ms [A],
# 1/throughput ~140 us [A], c_kv ~32 ns [A]. c_attn_s here is unused (0: taken from the formula).
DEEPSEEK_V3_EP: dict[str, EpGroupConstants] = {
    "h100": EpGroupConstants(30e-3, 0.15e-3, 1 / 6800, 45e-9, 0.0),
    "h200": EpGroupConstants(30e-3, 0.12e-3, 140e-6, 32e-9, 0.0),
}
DEEPSEEK_V3_PREFILL_ISL = 2048  # prompt length of LMSYS's measured prefill throughput [M]


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    t0_s: float  # fixed cost of one transfer
    bytes_per_s: float  # effective bandwidth


# A GPU's copy of KV to or from host memory over its own PCIe link (a PD decode engine's
# retraction under SGLang): "CPU-DRAM tier via PCIe H2D ~54 GB/s" on a PCIe Gen5 node [M: the
# agentic-kvc notes in docs/calibration.md "KV transfer"]; taken the same both ways [A].
HOST_LINK_BYTES_PER_S = 54e9

# docs/calibration.md "KV transfer": T_xfer = t0 + bytes / BW_eff.
LINKS: dict[str, Link] = {
    "rdma-8x400g": Link("rdma-8x400g", 0.4e-3, 150e9),  # fit to Mooncake vLLM-v1 1P1D, 8x400G RoCE [D from M]
    "nic-400g": Link("nic-400g", 0.4e-3, 40e9),  # single 400G NIC [A]
    "nvlink": Link("nvlink", 0.4e-3, 300e9),  # intra-node NVLink, effective [A]
    "remote-store": Link("remote-store", 0.4e-3, 6e9),  # remote RDMA KV store, 5-7 GB/s effective [M]
}

# Role-switch reconfiguration regimes, model seconds (docs/calibration.md "Role switches").
SWITCH_REGIMES: dict[str, float] = {
    "instant": 0.0,  # same engine, both graph sets captured: T_drain + 0 [A]
    "sleep-wake": 3.0,  # sleep/wake: 0.1-0.8 s small models, 3-6 s large [M]; 3 s middle of the range
    "restart": 48.0,  # cold restart 30-100 s; ~48 s measured for small models on A100 [M]
}

# One small TP all-reduce inside a node: vLLM custom all-reduce on H100, 32 KB, TP 2/4/8: 8.7 / 9.2 /
# 11.8 us (SGLang PR #2904 unit benchmark, no CUDA graph) [M]; 9 us used [D].
TP_ALLREDUCE_LATENCY_S = 9e-6


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
