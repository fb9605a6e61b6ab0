"""The cost model: published figures, monotonicity and ordering properties, derivations."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.emulated import hardware as hw
from actors.engine.emulated.costmodel import PRESETS, Layout, RankLoad, derive, group_iteration_s, iteration_s, with_layout
from runners.bench import main as bench_main
from runners.calibration import POINTS, TOLERANCE, evaluate

SINGLE_RANK = sorted(name for name, p in PRESETS.items() if p.dp_ranks == 1)
PAIRS = [(m, fp8) for m in ("qwen3-8b", "qwen3-30b-a3b") for fp8 in (False, True)]

tokens = st.integers(0, 32_768)
batch = st.integers(0, 512)
context = st.integers(0, 131_072)
preset_names = st.sampled_from(sorted(PRESETS))


@pytest.mark.parametrize("point", POINTS, ids=lambda p: p.point)
def test_every_calibration_point_is_within_tolerance(point):
    predicted = point.predict()
    assert abs(predicted - point.published) / point.published <= TOLERANCE, f"{predicted:.4g} vs {point.published}"


def test_bench_writes_calibration_json(tmp_path):
    assert bench_main(["calibration", "--out", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "calibration.json").read_text())
    assert [r["point"] for r in records] == [p.point for p in POINTS]
    assert all(set(r) >= {"point", "predicted", "published", "unit", "rel_error"} for r in records)
    assert records == evaluate()


def test_derived_constants_match_the_reference_table():
    """calibration.md 7.1 lists these derived values; the derivation must reproduce them."""
    p = PRESETS["h100-qwen3-8b"]
    assert p.t_w_base_s == pytest.approx(6.05e-3, rel=0.01)
    assert p.t_tok_s == pytest.approx(30.5e-6, rel=0.01)
    assert p.c_attn_s == pytest.approx(1.19e-9, rel=0.01)
    assert p.c_kv_s == pytest.approx(58.7e-9, rel=0.01)
    assert PRESETS["h200-qwen3-8b"].c_kv_s == pytest.approx(41.0e-9, rel=0.01)
    moe = PRESETS["h200-qwen3-30b-a3b"]
    assert moe.weight_s(1000) == pytest.approx(0.67e-3 + 16.1e-3, rel=0.01)
    assert moe.c_kv_s == pytest.approx(27.3e-9, rel=0.01)
    assert PRESETS["h100-qwen3-8b"].kv_capacity_tokens == pytest.approx(380_000, rel=0.05)
    assert PRESETS["h200-qwen3-30b-a3b"].kv_capacity_tokens == pytest.approx(670_000, rel=0.05)


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
