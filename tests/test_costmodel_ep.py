"""Routed experts under expert parallelism (docs/calibration.md, "Routed experts under expert
parallelism"): with DP attention + EP a rank pays the routed share of its GEMM work for the
group's mean load, the rest for its own. Equal loads keep the unspread cost exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest

from actors.engine.emulated import hardware as hw
from actors.engine.emulated.costmodel import PRESETS, Layout, RankLoad, group_iteration_s, iteration_s, with_layout, with_lockstep

DEEPSEEK = PRESETS["h200-deepseek-v3-fp8"]  # DP8 + EP8
QWEN_EP = with_layout("h200-qwen3-30b-a3b", Layout(dp=4, ep=4))


def unspread(preset):
    return replace(preset, routed_share=0.0)


def test_routed_shares_follow_the_parameter_split():
    assert hw.MODELS["deepseek-v3"].routed_active_params == pytest.approx(58 * 8 * 3 * 7168 * 2048, rel=1e-3)
    assert hw.MODELS["qwen3-30b-a3b"].routed_active_params == pytest.approx(48 * 8 * 3 * 2048 * 768, rel=1e-3)
    assert DEEPSEEK.routed_share == pytest.approx(0.572, abs=1e-3)
    assert QWEN_EP.routed_share == pytest.approx(0.664, abs=1e-3)
    assert PRESETS["h100-deepseek-v3-fp8"].routed_share == DEEPSEEK.routed_share


EQUAL_LOADS = [
    RankLoad(((2048, 0),), 0, 0),
    RankLoad(((1000, 3000), (500, 0)), 16, 16 * 4000),
    RankLoad((), 32, 32 * 5000),
    RankLoad(((300, 100),), 7, 7 * 1234),
]


@pytest.mark.parametrize("dp_sync", ["ideal", "sglang", "vllm"])
@pytest.mark.parametrize("preset", [DEEPSEEK, QWEN_EP], ids=["deepseek-dp8", "qwen3-dp4"])
@pytest.mark.parametrize("load", EQUAL_LOADS)
def test_equal_loads_cost_exactly_what_they_did_unspread(preset, dp_sync, load):
    p = with_lockstep(preset, dp_sync)
    ranks = [load] * p.dp_ranks
    assert group_iteration_s(p, ranks) == group_iteration_s(unspread(p), ranks)


def gemm_term(preset, ranks) -> float:
    """The prefilling rank's GEMM term: the group step less everything that is not spread."""
    chunk_tokens, prefix = ranks[0].prefill_chunks[0]
    return group_iteration_s(preset, ranks) - preset.c0_s - preset.c_attn_s * chunk_tokens * (prefix + chunk_tokens / 2.0)


@pytest.mark.parametrize("name,factor", [("h200-deepseek-v3-fp8", 0.499), ("h100-deepseek-v3-fp8", 0.463)])
def test_a_lone_rank_prefill_pays_about_half_its_gemm_term(name, factor):
    p = PRESETS[name]
    s = p.routed_share
    assert 1 - s * (p.dp_ranks - 1) / p.dp_ranks == pytest.approx(factor, abs=1e-3)
    ranks = [RankLoad(((4096, 1000),), 0, 0)] + [RankLoad()] * (p.dp_ranks - 1)
    spread, old = gemm_term(p, ranks), gemm_term(unspread(p), ranks)
    assert old == pytest.approx(p.t_tok_s * 4096, rel=1e-9)
    assert spread / old == pytest.approx(factor, abs=2e-3)
    # idle peers listed or left out: the same group
    assert group_iteration_s(p, ranks[:1]) == pytest.approx(group_iteration_s(p, ranks), rel=1e-12)


def test_a_lone_rank_on_qwen3_dp4_ep4_pays_about_half_its_gemm_term():
    p = QWEN_EP
    ranks = [RankLoad(((8192, 0),), 0, 0)] + [RankLoad()] * 3
    a2a_s = p.a2a_latency_s + p.a2a_s_per_token * 8192
    spread, old = gemm_term(p, ranks) - a2a_s, gemm_term(unspread(p), ranks) - a2a_s
    assert old == pytest.approx(p.t_tok_s * 8192, rel=1e-9)  # well above the weight floor
    assert spread / old == pytest.approx(1 - p.routed_share * 3 / 4, rel=1e-9)
    assert spread / old == pytest.approx(0.502, abs=2e-3)


def test_idle_peers_take_on_routed_work_and_can_become_the_slowest():
    """Decode-only ranks beside a long prefill: each pays its share of the prefill's routed work."""
    p = QWEN_EP
    prefill = RankLoad(((8192, 0),), 0, 0)
    decode = RankLoad((), 8, 8 * 4000)
    weight_s = p.weight_s(8192 + 24)
    s = p.routed_share
    mean_tok, mean_dec = 8192 / 4, 24 / 4
    decode_gemm = p.t_tok_s * (s * mean_tok) + p.t_dec_s * (8 + s * (mean_dec - 8))
    decode_rank = max(weight_s, decode_gemm) + p.c_kv_s * 8 * 4000 + p.c_seq_s * 8
    prefill_gemm = p.t_tok_s * (8192 + s * (mean_tok - 8192)) + p.t_dec_s * (s * mean_dec)
    prefill_rank = max(weight_s, prefill_gemm) + p.c_attn_s * 8192 * 4096
    a2a_s = p.a2a_latency_s + p.a2a_s_per_token * (8192 + 24)
    expected = p.c0_s + a2a_s + max(prefill_rank, decode_rank)
    assert group_iteration_s(p, [prefill] + [decode] * 3) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    "preset",
    [
        PRESETS["h200-qwen3-8b"],
        PRESETS["h200-qwen3-30b-a3b"],  # MoE, one rank
        with_layout("h200-qwen3-30b-a3b", Layout(tp=4, ep=4)),  # EP inside one TP rank
        with_layout("h200-qwen3-30b-a3b", Layout(dp=4)),  # DP without EP
        with_layout("h200-qwen3-8b", Layout(dp=2)),  # dense DP
    ],
)
def test_dense_single_rank_and_no_ep_presets_are_unchanged(preset):
    assert preset.routed_share == 0.0
    ranks = [RankLoad(((4096, 0),), 4, 4000)] + [RankLoad()] * (preset.dp_ranks - 1)
    assert group_iteration_s(preset, ranks) == group_iteration_s(unspread(preset), ranks)
    assert iteration_s(preset, [(1024, 512)], 8, 8000) == iteration_s(unspread(preset), [(1024, 512)], 8, 8000)


def test_a_single_rank_group_is_never_spread():
    p = replace(QWEN_EP, dp_ranks=1)  # a share left on a one-rank preset has nothing to spread over
    assert iteration_s(p, [(4096, 0)], 8, 8000) == iteration_s(unspread(p), [(4096, 0)], 8, 8000)


@pytest.mark.parametrize("preset", [DEEPSEEK, QWEN_EP], ids=["deepseek-dp8", "qwen3-dp4"])
def test_the_sglang_lockstep_step_is_spread_too(preset):
    p = with_lockstep(preset, "sglang")
    assert p.routed_share == preset.routed_share > 0
    ranks = [RankLoad(((4096, 0),), 0, 0)] + [RankLoad((), 16, 16 * 3000)] * (p.dp_ranks - 1)
    spread, old = group_iteration_s(p, ranks), group_iteration_s(unspread(p), ranks)
    assert spread < old
    # the prefilling rank is the slowest either way: the saving is its routed GEMM work
    dec_mean = 16 * (p.dp_ranks - 1) / p.dp_ranks
    s = p.routed_share
    saved = p.t_tok_s * s * (4096 - 4096 / p.dp_ranks) - p.t_dec_s * s * dec_mean
    assert old - spread == pytest.approx(saved, rel=1e-9)


def test_vllm_padding_tokens_are_spread_with_the_rest():
    p = with_lockstep(QWEN_EP, "vllm")
    chunk = 256
    ranks = [RankLoad(((chunk, 0),), 0, 0)] + [RankLoad((), 8, 8 * 4000)] * 3
    # every rank padded to 256 tokens: the group's GEMM tokens are 4 x 256, 24 of them decodes
    s = p.routed_share
    mean_tok, mean_dec = (chunk + 3 * (chunk - 8)) / 4, 24 / 4
    weight_s = p.weight_s(chunk + 24)
    decode_rest_s = p.c_kv_s * 8 * 4000 + p.c_seq_s * 8
    tok, dec = (chunk - 8) + s * (mean_tok - (chunk - 8)), 8 + s * (mean_dec - 8)
    padded = max(weight_s, p.t_tok_s * tok + p.t_dec_s * dec) + decode_rest_s
    padded += (p.piecewise_factor - 1) * (max(weight_s, p.t_dec_s * dec) + decode_rest_s)
    prefill_gemm = p.t_tok_s * (chunk + s * (mean_tok - chunk)) + p.t_dec_s * s * mean_dec
    prefill_rank = max(weight_s, prefill_gemm) + p.c_attn_s * chunk * chunk / 2
    a2a_s = p.a2a_latency_s + p.a2a_s_per_token * (chunk + 24)
    expected = p.c0_s + a2a_s + max(padded, prefill_rank)
    assert group_iteration_s(p, ranks) == pytest.approx(expected, rel=1e-12)
