"""Iteration-time model of the emulated backend (pure).

    T_iter = c0 + max(T_w(N), t_tok * N) + c_attn * Σ L_i (p_i + L_i / 2) + c_kv * Σ C_j + c_seq * B

with N the new tokens of the iteration (prefill chunk tokens + decode sequences), L_i / p_i
a prefill chunk's new tokens and the prefix already in KV, C_j a decode sequence's context.
Constants come from ``shared/reference/calibration.md`` (section 7.1, "Default constants");
their fidelity to real GPUs, DP-attention groups and MoE detail belong to the cost-model
issue. KV transfer: ``t0 + bytes / bandwidth`` (calibration.md section 3.2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostPreset:
    name: str
    c0_s: float  # per-iteration overhead
    t_w_base_s: float  # weight-streaming floor (dense: all of it)
    t_w_moe_s: float  # MoE: extra weight bytes touched, scaled by 1 - (1 - 1/16)^N
    t_tok_s: float  # GEMM time per new token
    c_attn_s: float  # prefill attention per (new token x context token)
    c_kv_s: float  # decode attention per context token read
    c_seq_s: float  # per-sequence overhead (sampling, bookkeeping)
    kv_bytes_per_token: int
    kv_capacity_tokens: int  # KV pool: ~0.9 HBM minus weights

    def weight_s(self, new_tokens: int) -> float:
        if self.t_w_moe_s == 0.0:
            return self.t_w_base_s
        return self.t_w_base_s + self.t_w_moe_s * (1.0 - (15.0 / 16.0) ** new_tokens)


PRESETS: dict[str, CostPreset] = {
    # Qwen3-8B BF16, TP1. calibration.md 7.1: c0 1.0 ms (from gpustack TPOT), T_w 6.05 ms
    # (15.2 GB / (0.75 x 3.35 TB/s)), t_tok 30.5 us, c_attn 1.19 ns, c_kv 58.7 ns (144 KiB/token),
    # c_seq 0.01 ms [A], KV capacity ~380k tokens.
    "h100-qwen3-8b": CostPreset("h100-qwen3-8b", 1.0e-3, 6.05e-3, 0.0, 30.5e-6, 1.19e-9, 58.7e-9, 1.0e-5, 147_456, 380_000),
    # Same model on H200: 4.8 TB/s HBM -> T_w 4.22 ms, c_kv 41.0 ns; KV capacity ~750k tokens.
    "h200-qwen3-8b": CostPreset("h200-qwen3-8b", 1.0e-3, 4.22e-3, 0.0, 30.5e-6, 1.19e-9, 41.0e-9, 1.0e-5, 147_456, 750_000),
    # Qwen3-30B-A3B BF16, TP1 on H200: c0 1.5 ms [A], T_w 0.67 + 16.1 f(N) ms [D], t_tok 20 us [A],
    # c_attn 1.59 ns, c_kv 27.3 ns (96 KiB/token), KV capacity ~670k tokens.
    "h200-qwen3-30b-a3b": CostPreset(
        "h200-qwen3-30b-a3b", 1.5e-3, 0.67e-3, 16.1e-3, 20e-6, 1.59e-9, 27.3e-9, 1.0e-5, 98_304, 670_000
    ),
}


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    t0_s: float  # fixed cost of one transfer
    bytes_per_s: float  # effective bandwidth


LINKS: dict[str, Link] = {
    # calibration.md 3.2: fit to Mooncake vLLM-v1 1P1D, 8x400G RoCE: 0.4 ms + bytes / 150 GB/s.
    "rdma-8x400g": Link("rdma-8x400g", 0.4e-3, 150e9),
    "nic-400g": Link("nic-400g", 0.4e-3, 40e9),  # single 400G NIC [A]
    "nvlink": Link("nvlink", 0.4e-3, 300e9),  # intra-node NVLink, effective [A]
}


def iteration_s(
    preset: CostPreset,
    prefill_chunks: Sequence[tuple[int, int]],
    decode_seqs: int,
    decode_context_tokens: int,
) -> float:
    """One iteration: prefill chunks as (new tokens, prefix tokens), plus a decode batch."""
    new_tokens = sum(n for n, _ in prefill_chunks) + decode_seqs
    if new_tokens == 0:
        return 0.0
    attn = sum(n * (p + n / 2.0) for n, p in prefill_chunks)
    return (
        preset.c0_s
        + max(preset.weight_s(new_tokens), preset.t_tok_s * new_tokens)
        + preset.c_attn_s * attn
        + preset.c_kv_s * decode_context_tokens
        + preset.c_seq_s * decode_seqs
    )


def decode_run_s(preset: CostPreset, decode_seqs: int, decode_context_tokens: int, iterations: int) -> float:
    """``iterations`` decode-only iterations of a fixed batch whose context grows by one per step."""
    if iterations <= 0 or decode_seqs == 0:
        return 0.0
    mean_context = decode_context_tokens + decode_seqs * (iterations - 1) / 2.0
    return iterations * iteration_s(preset, (), decode_seqs, round(mean_context))


def transfer_s(link: Link, kv_bytes: int) -> float:
    return link.t0_s + kv_bytes / link.bytes_per_s
