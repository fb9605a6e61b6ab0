"""Calibration points: the cost model's predictions against published figures (pure).

Every sanity check listed in ``shared/reference/calibration.md`` plus the measured KV
transfer series and prefill throughputs it cites. `published` is the cited figure; the
tag says whether the source measured it [M] or derived it from a measurement [D].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from actors.engine.emulated.costmodel import LINKS, PRESETS, RankLoad, group_iteration_s, iteration_s, transfer_s

TOLERANCE = 0.15  # every point must be predicted within 15%

QWEN3_8B_KV_BYTES = PRESETS["h100-qwen3-8b"].kv_bytes_per_token


@dataclass(frozen=True, slots=True)
class Point:
    point: str
    unit: str
    published: float
    source: str
    predict: Callable[[], float]


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
    Point("qwen3-8b h100 TPOT, batch 4 (ctx 512)", "ms", 7.2, "gpustack TPOT 7.2-7.4 ms at bs~4 [M]",
          lambda: _decode_ms("h100-qwen3-8b", 4, 512)),
    Point("qwen3-30b-a3b-fp8 h200 TPOT, batch 10 at 32k ctx", "ms", 16.0, "calibration.md section 0 [M]",
          lambda: _decode_ms("h200-qwen3-30b-a3b-fp8", 10, 32768)),
    Point("deepseek-v3 h100 decode step, B=256/GPU, C=2k", "ms", 92.0, "LMSYS large-scale EP deployment [D from M]",
          lambda: _ep_decode_ms("h100-deepseek-v3-fp8", 256, 2048)),
    Point("deepseek-v3 h100 decode step, B=128/GPU, C=4k", "ms", 73.0, "calibration.md 7.1 sanity check [D]",
          lambda: _ep_decode_ms("h100-deepseek-v3-fp8", 128, 4096)),
    Point("deepseek-v3 h100 prefill throughput, 2k ISL", "tok/s/GPU", 6800.0, "LMSYS: 6.8k tok/s/GPU at 2k ISL [M]",
          lambda: _prefill_tok_s("h100-deepseek-v3-fp8", 8, 2048)),
    Point("qwen3-8b-fp8 h100 prefill throughput, 2k ISL", "tok/s", 55000.0, "TRT-LLM FP8 8B prefill ~55k tok/s [M]",
          lambda: _prefill_tok_s("h100-qwen3-8b-fp8", 1, 2048)),
    Point("kv transfer 128 tokens (qwen3-8b)", "ms", 0.54, MOONCAKE, lambda: _xfer_ms(128)),
    Point("kv transfer 1k tokens (qwen3-8b)", "ms", 1.50, MOONCAKE, lambda: _xfer_ms(1024)),
    Point("kv transfer 4k tokens (qwen3-8b)", "ms", 4.75, MOONCAKE, lambda: _xfer_ms(4096)),
    Point("kv transfer 8k tokens (qwen3-8b)", "ms", 8.84, MOONCAKE, lambda: _xfer_ms(8192)),
    Point("kv transfer 16k tokens (qwen3-8b)", "ms", 16.4, MOONCAKE, lambda: _xfer_ms(16384)),
    Point("kv transfer 32k tokens (qwen3-8b)", "ms", 31.65, MOONCAKE, lambda: _xfer_ms(32768)),
)  # fmt: skip


def evaluate() -> list[dict]:
    """One record per point: point, predicted, published, unit, rel_error, source."""
    records = []
    for p in POINTS:
        predicted = p.predict()
        records.append(
            {
                "point": p.point,
                "predicted": round(predicted, 4),
                "published": p.published,
                "unit": p.unit,
                "rel_error": round((predicted - p.published) / p.published, 4),
                "source": p.source,
            }
        )
    return records
