"""The cost model: the fitting set as a regression guard, monotonicity and ordering properties, derivations.

The validation set (published figures that set no constant) is checked in
tests/test_calibration_validation.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.emulated import hardware as hw
from actors.engine.emulated.costmodel import PRESETS, Layout, RankLoad, derive, gemm_efficiency, group_iteration_s, iteration_s, with_layout
from runners.bench import main as bench_main
from runners.calibration import POINTS, TOLERANCE, VALIDATION, report

SINGLE_RANK = sorted(name for name, p in PRESETS.items() if p.dp_ranks == 1)
PAIRS = [(m, fp8) for m in ("qwen3-8b", "qwen3-30b-a3b") for fp8 in (False, True)]

tokens = st.integers(0, 32_768)
batch = st.integers(0, 512)
context = st.integers(0, 131_072)
preset_names = st.sampled_from(sorted(PRESETS))


@pytest.mark.parametrize("point", POINTS, ids=lambda p: p.point)
def test_fitting_set_regression(point):
    """The fitting set: the constants were derived from these figures, so this guards against
    regressions and validates nothing (the validation set does that)."""
    predicted = point.predict()
    assert abs(predicted - point.published) / point.published <= TOLERANCE, f"{predicted:.4g} vs {point.published}"


def test_bench_writes_calibration_json(tmp_path):
    assert bench_main(["calibration", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "calibration.json").read_text())
    assert set(result) == {"fitting", "validation", "validation_summary", "lockstep_check"}
    lockstep = result.pop("lockstep_check")
    assert len(lockstep["grid"]) == 9 and lockstep["published_range"] == [0.13, 0.35]
    assert [r["point"] for r in result["fitting"]] == [p.point for p in POINTS]
    assert [r["point"] for r in result["validation"]] == [p.point for p in VALIDATION]
    keys = {"point", "predicted", "published", "unit", "rel_error", "time_error", "source", "url", "setting", "tag", "gpu"}
    assert all(set(r) >= keys for r in result["fitting"] + result["validation"])
    assert result == report()


def test_derived_constants_follow_the_documented_formulas():
    """docs/calibration.md "Iteration-time model": each derived constant from its specs."""
    h100, h200 = hw.GPUS["h100"], hw.GPUS["h200"]
    q8 = hw.MODELS["qwen3-8b"]
    p = PRESETS["h100-qwen3-8b"]
    assert p.t_w_base_s == pytest.approx(15.2e9 / (0.75 * h100.hbm_bytes_per_s), rel=1e-9)  # 6.05 ms
    gemm = 2 * q8.active_nonembed_params / (gemm_efficiency(2048, 4096, 4096) * h100.bf16_flops)
    assert p.t_tok_s == pytest.approx(gemm * (1 + hw.PREFILL_NON_GEMM_SHARE), rel=1e-9)
    assert 0.58 < 2 * q8.active_nonembed_params / (p.t_tok_s * h100.bf16_flops) < 0.64  # effective ~0.6
    assert p.c_attn_s == pytest.approx(1.19e-9, rel=0.01)
    assert p.c_kv_s == pytest.approx(58.7e-9, rel=0.01)
    assert PRESETS["h200-qwen3-8b"].c_kv_s == pytest.approx(41.0e-9, rel=0.01)
    fp8 = PRESETS["h100-qwen3-8b-fp8"]  # linear weights halve, the LM head stays BF16
    assert fp8.t_w_base_s == pytest.approx(((15.2e9 - q8.lm_head_bytes_bf16) / 2 + q8.lm_head_bytes_bf16) / (0.75 * h100.hbm_bytes_per_s))
    assert fp8.c_attn_s == p.c_attn_s and fp8.c_kv_s == p.c_kv_s  # attention and KV stay BF16
    moe = PRESETS["h200-qwen3-30b-a3b"]
    assert moe.t_w_moe_s == pytest.approx(57.96e9 / (hw.ETA_BW_MOE * h200.hbm_bytes_per_s), rel=1e-9)
    assert moe.c0_s == pytest.approx(hw.C0_DENSE_S + 48 * hw.MOE_LAYER_FIXED_S)
    assert moe.c_kv_s == pytest.approx(27.3e-9, rel=0.01)
    assert PRESETS["h100-qwen3-8b"].kv_capacity_tokens == pytest.approx(380_000, rel=0.05)
    assert PRESETS["h200-qwen3-30b-a3b"].kv_capacity_tokens == pytest.approx(670_000, rel=0.05)
    ds = PRESETS["h100-deepseek-v3-fp8"]  # attention by the common formula: 4 L H d / (eta_attn x BF16 peak)
    assert ds.c_attn_s == pytest.approx(4 * 61 * 128 * 192 / (hw.ETA_ATTN * h100.bf16_flops))
    assert ds.t_tok_s == pytest.approx(1 / 6800 - ds.c_attn_s * 1024)


def test_gemm_efficiency_reads_the_measured_table():
    assert gemm_efficiency(4096, 4096, 4096) == pytest.approx(788.7 / 989)
    assert gemm_efficiency(1024, 1024, 1024) < gemm_efficiency(2048, 2048, 2048) < gemm_efficiency(8192, 8192, 8192)
    assert gemm_efficiency(512, 512, 512) == pytest.approx(0.5 * 176.6 / 989)
    assert gemm_efficiency(65536, 65536, 65536) == pytest.approx(797.5 / 989)


def test_tensor_parallel_prefill_pays_smaller_gemms_and_the_all_reduce():
    """A TP rank's prefill is slower than 1/tp of TP1: smaller per-GPU GEMMs and two all-reduces per layer."""
    tp1, tp4 = PRESETS["h100-qwen3-8b"], with_layout("h100-qwen3-8b", Layout(tp=4))
    assert tp4.t_tok_s > tp1.t_tok_s / 4 * 1.15


def test_deepseek_prefill_throughput_falls_with_prompt_length():
    """LMSYS: per-GPU prefill throughput falls ~13% from 1K to 4K prompts (57,674 -> 50,302 tok/s/node)."""
    p = PRESETS["h100-deepseek-v3-fp8"]

    def per_gpu(isl):
        ranks = [RankLoad(tuple((isl, 0) for _ in range(16_384 // isl)))] * p.dp_ranks
        return 16_384 / group_iteration_s(p, ranks)

    assert 0.08 < 1 - per_gpu(4096) / per_gpu(1024) < 0.18


def test_a_layout_that_does_not_fit_is_refused():
    with pytest.raises(ValueError, match="does not fit"):
        derive("h100", "deepseek-v3", True, Layout(dp=8, ep=8))  # 84 GB of FP8 weights per 80 GB GPU


def test_tensor_parallelism_speeds_up_decode_and_grows_the_kv_pool():
    tp1, tp2 = PRESETS["h100-qwen3-8b"], with_layout("h100-qwen3-8b", Layout(tp=2))
    assert iteration_s(tp2, (), 64, 64 * 8192) < iteration_s(tp1, (), 64, 64 * 8192)
    assert tp2.kv_capacity_tokens > 2 * tp1.kv_capacity_tokens


@settings(max_examples=300, deadline=None)
@given(preset_names, tokens, tokens, batch, context, st.integers(1, 4096), st.integers(1, 64), st.integers(1, 8192))
def test_iteration_time_never_decreases_as_work_grows(name, new, prefix, b, ctx, d_tokens, d_batch, d_ctx):
    p = PRESETS[name]
    base = iteration_s(p, [(new, prefix)], b, ctx)
    assert iteration_s(p, [(new + d_tokens, prefix)], b, ctx) >= base
    assert iteration_s(p, [(new, prefix + d_tokens)], b, ctx) >= base
    assert iteration_s(p, [(new, prefix)], b + d_batch, ctx) >= base
    assert iteration_s(p, [(new, prefix)], b, ctx + d_ctx) >= base


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(PAIRS), st.integers(1, 512), context)
def test_h200_decode_is_never_slower_than_h100(pair, b, ctx):
    model, fp8 = pair
    suffix = "-fp8" if fp8 else ""
    h100, h200 = PRESETS[f"h100-{model}{suffix}"], PRESETS[f"h200-{model}{suffix}"]
    assert iteration_s(h200, (), b, b * ctx) <= iteration_s(h100, (), b, b * ctx)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["h100", "h200"]), st.sampled_from(["qwen3-8b", "qwen3-30b-a3b"]), tokens, batch, context)
def test_fp8_is_never_slower_than_bf16(gpu, model, new, b, ctx):
    bf16, fp8 = PRESETS[f"{gpu}-{model}"], PRESETS[f"{gpu}-{model}-fp8"]
    assert iteration_s(fp8, [(new, 0)], b, ctx) <= iteration_s(bf16, [(new, 0)], b, ctx)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(tokens, batch, context), min_size=2, max_size=8), st.integers(0, 7), st.integers(1, 8192))
def test_a_group_waits_for_its_slowest_rank(loads, which, extra_tokens):
    p = with_layout("h200-qwen3-30b-a3b", Layout(dp=len(loads), ep=len(loads)))
    ranks = [RankLoad(((n, 0),) if n else (), b, b * c // max(b, 1)) for n, b, c in loads]
    base = group_iteration_s(p, ranks)
    assert base >= max(group_iteration_s(p, [r] + [RankLoad()] * (len(ranks) - 1)) for r in ranks) - 1e-12
    i = which % len(ranks)
    heavier = list(ranks)
    heavier[i] = RankLoad(ranks[i].prefill_chunks + ((extra_tokens, 0),), ranks[i].decode_seqs, ranks[i].decode_context_tokens)
    assert group_iteration_s(p, heavier) >= base


def test_switch_regimes_are_ordered():
    assert hw.SWITCH_REGIMES["instant"] < hw.SWITCH_REGIMES["sleep-wake"] < hw.SWITCH_REGIMES["restart"]
