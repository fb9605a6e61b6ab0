"""Calibration points: the cost model's predictions against published figures (pure).

Two sets, kept apart (docs/calibration.md):

* ``POINTS`` — the fitting set: the figures the constants were derived from. A regression test,
  not evidence; every point must stay within ``TOLERANCE``.
* ``VALIDATION`` — published measured H100/H200 figures that set no constant. The honest figure
  is their median and maximum absolute *time* error (``summary``). Points are added here and never
  moved to the fitting set.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from actors.engine.emulated.costmodel import (
    LINKS,
    PRESETS,
    Layout,
    RankLoad,
    derive,
    group_iteration_s,
    iteration_s,
    prefill_s,
    transfer_s,
)

TOLERANCE = 0.15  # fitting set: every point must be reproduced within 15% (a regression guard)

QWEN3_8B_KV_BYTES = PRESETS["h100-qwen3-8b"].kv_bytes_per_token


VALIDATION_MEDIAN_TARGET = 0.10  # median absolute time error on H100/H200 validation points
VALIDATION_MAX_TARGET = 0.20  # ... and the maximum


@dataclass(frozen=True, slots=True)
class Point:
    point: str
    unit: str  # "ms" / "s" (a time) or "tok/s..." (a throughput: time error = published / predicted - 1)
    published: float
    source: str
    predict: Callable[[], float]
    url: str = ""
    setting: str = ""
    tag: str = "[M]"
    gpu: str = ""  # "h100" / "h200" / "" (other or unstated: reported, not in the H100/H200 summary)
    covers: tuple[str, ...] = field(default_factory=tuple)  # regimes the point validates


def _decode_ms(preset: str, batch: int, context: int) -> float:
    return 1e3 * iteration_s(PRESETS[preset], (), batch, batch * context)


def _ep_decode_ms(preset: str, batch_per_gpu: int, context: int) -> float:
    p = PRESETS[preset]
    ranks = [RankLoad((), batch_per_gpu, batch_per_gpu * context)] * p.dp_ranks
    return 1e3 * group_iteration_s(p, ranks)


def _prefill_tok_s(preset: str, requests_per_rank: int, isl: int) -> float:
    p = PRESETS[preset]
    ranks = [RankLoad(tuple((isl, 0) for _ in range(requests_per_rank)))] * p.dp_ranks
    return requests_per_rank * isl / group_iteration_s(p, ranks)  # per GPU when each rank is one GPU


def _xfer_ms(tokens: int) -> float:
    return 1e3 * transfer_s(LINKS["rdma-8x400g"], tokens * QWEN3_8B_KV_BYTES)


MOONCAKE = "Mooncake vLLM-v1 1P1D benchmark, Qwen3-8B, 8x RoCE [M]"
POINTS: tuple[Point, ...] = (
    Point(
        "qwen3-8b h100 TPOT, batch 4 (ctx 512)",
        "ms",
        7.2,
        "gpustack TPOT 7.2-7.4 ms at bs~4 [M]",
        lambda: _decode_ms("h100-qwen3-8b", 4, 512),
    ),
    Point(
        "qwen3-30b-a3b-fp8 h200 TPOT, batch 10 at 32k ctx",
        "ms",
        16.0,
        "docs/calibration.md#efficiencies-and-per-iteration-costs (the η_bw row) [M]",
        lambda: _decode_ms("h200-qwen3-30b-a3b-fp8", 10, 32768),
    ),
    Point(
        "deepseek-v3 h100 decode step, B=256/GPU, C=2k",
        "ms",
        92.0,
        "LMSYS large-scale EP deployment [D from M]",
        lambda: _ep_decode_ms("h100-deepseek-v3-fp8", 256, 2048),
    ),
    Point(
        "deepseek-v3 h100 decode step, B=128/GPU, C=4k",
        "ms",
        73.0,
        "docs/calibration.md#deepseek-v3 (c0, c_b, c_kv from LMSYS's decode figures) [D]",
        lambda: _ep_decode_ms("h100-deepseek-v3-fp8", 128, 4096),
    ),
    Point(
        "deepseek-v3 h100 prefill throughput, 2k ISL",
        "tok/s/GPU",
        6800.0,
        "LMSYS: 6.8k tok/s/GPU at 2k ISL [M]",
        lambda: _prefill_tok_s("h100-deepseek-v3-fp8", 8, 2048),
    ),
    Point(
        "qwen3-8b-fp8 h100 prefill throughput, 2k ISL",
        "tok/s",
        55000.0,
        "TRT-LLM FP8 8B prefill ~55k tok/s [M]",
        lambda: _prefill_tok_s("h100-qwen3-8b-fp8", 1, 2048),
    ),
    Point("kv transfer 128 tokens (qwen3-8b)", "ms", 0.54, MOONCAKE, lambda: _xfer_ms(128)),
    Point("kv transfer 1k tokens (qwen3-8b)", "ms", 1.50, MOONCAKE, lambda: _xfer_ms(1024)),
    Point("kv transfer 4k tokens (qwen3-8b)", "ms", 4.75, MOONCAKE, lambda: _xfer_ms(4096)),
    Point("kv transfer 8k tokens (qwen3-8b)", "ms", 8.84, MOONCAKE, lambda: _xfer_ms(8192)),
    Point("kv transfer 16k tokens (qwen3-8b)", "ms", 16.4, MOONCAKE, lambda: _xfer_ms(16384)),
    Point("kv transfer 32k tokens (qwen3-8b)", "ms", 31.65, MOONCAKE, lambda: _xfer_ms(32768)),
)


def _lat_ms(preset, batch: int, isl: int, osl: int) -> float:
    """End-to-end latency of one static batch (vLLM benchmark_latency): one prefill iteration of
    `batch` prompts, then osl - 1 decode iterations whose contexts grow by one token each."""
    t = iteration_s(preset, [(isl, 0)] * batch, 0, 0)
    for i in range(1, osl):
        t += iteration_s(preset, (), batch, batch * (isl + i))
    return 1e3 * t


def _ttft_ms(preset, isl: int) -> float:
    return 1e3 * prefill_s(preset, isl)


def _itl_ms(preset, context: int) -> float:
    return 1e3 * iteration_s(preset, (), 1, context)


def _ep_prefill_tok_s(preset: str, isl: int, tokens_per_rank: int = 16_384) -> float:
    return _prefill_tok_s(preset, tokens_per_rank // isl, isl)


VLLM_CI = "https://buildkite.com/vllm/performance-benchmark/builds/9515"
NIM = "https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance"
LMSYS_EP = "https://lmsys.org/blog/2025-05-05-large-scale-ep/"
_H200_8B = derive("h200", "llama-3.1-8b")
_H200_70B_TP4 = derive("h200", "llama-3-70b", layout=Layout(tp=4))
_H200_MIXTRAL_TP2 = derive("h200", "mixtral-8x7b", layout=Layout(tp=2))
_H100_70B_FP8_TP2 = derive("h100", "llama-3-70b", fp8=True, layout=Layout(tp=2))

VALIDATION: tuple[Point, ...] = (
    Point(
        "llama-3.1-8b h200 bf16 tp1, batch 8, 32 in / 128 out, e2e latency",
        "ms",
        833.42,
        "vLLM CI performance benchmark, latency_llama8B_tp1 (mean)",
        lambda: _lat_ms(_H200_8B, 8, 32, 128),
        VLLM_CI,
        "vLLM benchmark_latency, batch 8 fixed, input 32, output 128, 1x H200, BF16",
        "[M]",
        "h200",
        ("decode batch 1-8", "short context", "bf16"),
    ),
    Point(
        "llama-3-70b h200 bf16 tp4, batch 8, 32 in / 128 out, e2e latency",
        "ms",
        2077.53,
        "vLLM CI performance benchmark, latency_llama70B_tp4 (mean)",
        lambda: _lat_ms(_H200_70B_TP4, 8, 32, 128),
        VLLM_CI,
        "vLLM benchmark_latency, batch 8, input 32, output 128, 4x H200 TP4, BF16",
        "[M]",
        "h200",
        ("decode batch 1-8", "tp decode", "bf16"),
    ),
    Point(
        "mixtral-8x7b h200 bf16 tp2, batch 8, 32 in / 128 out, e2e latency",
        "ms",
        1917.44,
        "vLLM CI performance benchmark, latency_mixtral8x7B_tp2 (mean)",
        lambda: _lat_ms(_H200_MIXTRAL_TP2, 8, 32, 128),
        VLLM_CI,
        "vLLM benchmark_latency, batch 8, input 32, output 128, 2x H200 TP2, BF16",
        "[M]",
        "h200",
        ("moe small batch", "decode batch 1-8", "bf16"),
    ),
    Point(
        "llama-3.3-70b h100 fp8 tp2, prefill 5000 tokens (TTFT, c=1)",
        "ms",
        406.77,
        "NVIDIA NIM benchmarking, Llama-3.3-70b-instruct NIM 1.8.0, 5000 in / 500 out",
        lambda: _ttft_ms(_H100_70B_FP8_TP2, 5000),
        NIM,
        "NIM (TensorRT-LLM), 2x H100 80G, fp8 TP2, concurrency 1, TTFT",
        "[M]",
        "h100",
        ("prefill tp>=2", "fp8"),
    ),
    Point(
        "llama-3.3-70b h100 fp8 tp2, decode batch 1 at ~5.25k ctx (ITL, c=1)",
        "ms",
        18.58,
        "NVIDIA NIM benchmarking, Llama-3.3-70b-instruct NIM 1.8.0, 5000 in / 500 out",
        lambda: _itl_ms(_H100_70B_FP8_TP2, 5250),
        NIM,
        "NIM (TensorRT-LLM), 2x H100 80G, fp8 TP2, concurrency 1, mean ITL over 500 outputs",
        "[M]",
        "h100",
        ("decode batch 1-8", "fp8", "long context", "tp decode"),
    ),
    Point(
        "llama-3.3-70b h100 fp8 tp2, prefill 500 tokens (TTFT, c=1)",
        "ms",
        47.77,
        "NVIDIA NIM benchmarking, Llama-3.3-70b-instruct NIM 1.8.0, 500 in / 2000 out",
        lambda: _ttft_ms(_H100_70B_FP8_TP2, 500),
        NIM,
        "NIM (TensorRT-LLM), 2x H100 80G, fp8 TP2, concurrency 1, TTFT",
        "[M]",
        "h100",
        ("prefill tp>=2", "fp8"),
    ),
    Point(
        "llama-3.3-70b h100 fp8 tp2, decode batch 1 at ~1.5k ctx (ITL, c=1)",
        "ms",
        18.91,
        "NVIDIA NIM benchmarking, Llama-3.3-70b-instruct NIM 1.8.0, 500 in / 2000 out",
        lambda: _itl_ms(_H100_70B_FP8_TP2, 1500),
        NIM,
        "NIM (TensorRT-LLM), 2x H100 80G, fp8 TP2, concurrency 1, mean ITL over 2000 outputs",
        "[M]",
        "h100",
        ("decode batch 1-8", "fp8", "short context", "tp decode"),
    ),
    Point(
        "deepseek-v3 h100 dp-attn+ep prefill, 1k ISL",
        "tok/s/GPU",
        57_674 / 8,
        "LMSYS large-scale EP blog: 57,674 tok/s per node at 1K prompts (4 prefill nodes, EP32)",
        lambda: _ep_prefill_tok_s("h100-deepseek-v3-fp8", 1024),
        LMSYS_EP,
        "SGLang, 4x8 H100, DP-attention + EP32, DeepEP normal, 16,384 tokens per device",
        "[M]",
        "h100",
        ("dp-attn+ep prefill",),
    ),
    Point(
        "deepseek-v3 h100 dp-attn+ep prefill, 4k ISL",
        "tok/s/GPU",
        50_302 / 8,
        "LMSYS large-scale EP blog: 50,302 tok/s per node at 4K prompts (4 prefill nodes, EP32)",
        lambda: _ep_prefill_tok_s("h100-deepseek-v3-fp8", 4096),
        LMSYS_EP,
        "SGLang, 4x8 H100, DP-attention + EP32, DeepEP normal, 16,384 tokens per device",
        "[M]",
        "h100",
        ("dp-attn+ep prefill", "long context"),
    ),
)


def _record(p: Point) -> dict:
    predicted = p.predict()
    is_time = p.unit in ("ms", "s")
    time_error = (predicted - p.published) / p.published if is_time else p.published / predicted - 1.0
    return {
        "point": p.point,
        "predicted": round(predicted, 4),
        "published": round(p.published, 4),
        "unit": p.unit,
        "rel_error": round((predicted - p.published) / p.published, 4),
        "time_error": round(time_error, 4),
        "source": p.source,
        "url": p.url,
        "setting": p.setting,
        "tag": p.tag,
        "gpu": p.gpu,
        "covers": list(p.covers),
    }


def evaluate() -> list[dict]:
    """The fitting set: one record per point (point, predicted, published, unit, rel_error, time_error, source...)."""
    return [_record(p) for p in POINTS]


def evaluate_validation() -> list[dict]:
    return [_record(p) for p in VALIDATION]


def summary(records: list[dict]) -> dict:
    """Median and maximum absolute time error of the H100/H200 validation records."""
    errors = [abs(r["time_error"]) for r in records if r["gpu"] in ("h100", "h200")]
    median, worst = statistics.median(errors), max(errors)
    return {
        "points": len(errors),
        "median_abs_time_error": round(median, 4),
        "max_abs_time_error": round(worst, 4),
        "median_target": VALIDATION_MEDIAN_TARGET,
        "max_target": VALIDATION_MAX_TARGET,
        "meets_targets": median <= VALIDATION_MEDIAN_TARGET and worst <= VALIDATION_MAX_TARGET,
    }


def report() -> dict:
    """What `python -m runners.bench calibration` writes to calibration.json."""
    validation = evaluate_validation()
    return {"fitting": evaluate(), "validation": validation, "validation_summary": summary(validation)}
