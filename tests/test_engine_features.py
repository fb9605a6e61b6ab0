"""The engine core's host KV tier, shared first prompts and SGLang's per-rank chunk: what a
careful operator turns on for every arrangement (no bus, no clock)."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest

from actors.engine.core import EngineCore
from actors.engine.emulated.costmodel import PRESETS, host_copy_s, with_layout
from actors.engine.emulated.costmodel import Layout as CostLayout
from bus_schemas.control import Role
from tests.test_engine_core import decode_work, run_to_idle, work

PRESET = PRESETS["h100-qwen3-8b"]


def engine(capacity=20_000, ratio=2.0, role=Role.COLOCATED, preset=PRESET, **kw) -> EngineCore:
    return EngineCore("e0", role, replace(preset, kv_capacity_tokens=capacity), 8192, 16, 8, host_kv_ratio=ratio, **kw)


@pytest.mark.parametrize("role", [Role.DECODE, Role.COLOCATED])
def test_without_a_host_tier_kv_that_does_not_fit_is_recomputed(role):
    c = engine(capacity=2_600, ratio=0.0, role=role)
    for i in range(4):
        c.admit_decode(decode_work(f"t{i}", context=500, out=600))
    done, _ = run_to_idle(c, 0.5)
    assert c.retractions == 0 and c.preemptions > 0 and c.preempted_kv_tokens > 0
    assert sorted(s.work.trajectory_id for k, s in done if k == "decode_done") == [f"t{i}" for i in range(4)]


def _evicted_to_host(ratio: float) -> EngineCore:
    """t0's 3,000-token history is cached, then four other histories push it out of the GPU."""
    c = engine(capacity=6_000, ratio=ratio)
    c.admit_prefill(work("t0", new=3000, out=10))
    run_to_idle(c)
    for i in range(1, 5):
        c.admit_prefill(work(f"t{i}", new=1000, out=10))
        run_to_idle(c)
    return c


def test_an_evicted_prefix_moves_to_host_and_is_loaded_back_not_recomputed():
    c = _evicted_to_host(ratio=2.0)
    assert c.prefixes.peek("t0@0") == (0, 3010)  # off the GPU, in host memory
    seq = c.admit_prefill(work("t0", turn=1, context=3010, new=100))
    assert seq.cached_prefix_tokens == 3010 and seq.prefill_tokens == 100
    batch = c.plan(1.0)
    assert batch.host_copy_s == pytest.approx(host_copy_s(c.preset, 3010))
    assert c.prefixes.host_tokens == c.prefixes.peek("t1@0")[1] + c.prefixes.peek("t2@0")[1]  # t0 left the host tier


def test_without_a_host_tier_an_evicted_prefix_is_computed_again():
    c = _evicted_to_host(ratio=0.0)
    assert c.prefixes.peek("t0@0") == (0, 0) and c.prefixes.host_tokens == 0
    seq = c.admit_prefill(work("t0", turn=1, context=3010, new=100))
    assert seq.cached_prefix_tokens == 0 and seq.prefill_tokens == 3110
    assert c.plan(1.0).host_copy_s == 0.0


def test_the_host_tier_keeps_the_newest_prefixes_within_its_capacity():
    c = engine(capacity=4_000, ratio=0.5)  # 2,000 tokens of host memory
    for i in range(6):
        c.admit_prefill(work(f"t{i}", new=900, out=10))
        run_to_idle(c)
    assert c.prefixes.host_tokens <= 2_000
    in_host = [i for i in range(6) if c.prefixes.peek(f"t{i}@0")[1]]
    assert in_host and in_host == list(range(min(in_host), min(in_host) + len(in_host)))  # a run of the newest evicted
    assert c.prefixes.drop_below(1) >= len(in_host) and c.prefixes.host_tokens == 0


def _sibling(g: int, prompt_key: str = "s0-k0", version: int = 0):
    return msgspec.structs.replace(work(f"s0-k0-g{g}", new=3000, out=20, version=version), prompt_key=prompt_key)


def test_grpo_siblings_share_their_first_prompt_on_one_engine():
    c = engine()
    first = c.admit_prefill(_sibling(0))
    assert first.cached_prefix_tokens == 0 and first.prefill_tokens == 3000
    run_to_idle(c)
    second = c.admit_prefill(_sibling(1))
    assert second.cached_prefix_tokens == 2999 and second.prefill_tokens == 1  # the last token is computed for its logits
    done, _ = run_to_idle(c)
    assert [k for k, _ in done] == ["prefill_done", "decode_done"] and second.kv_tokens == 3000 + 20
    assert c.admit_prefill(_sibling(2, version=1)).cached_prefix_tokens == 0  # another policy's KV is never reused
    assert c.admit_prefill(_sibling(3, prompt_key="")).cached_prefix_tokens == 0  # a prompt not shared


def test_under_dp_attention_each_rank_gets_the_chunk_divided_by_the_dp_size():
    dp4 = with_layout("h200-qwen3-30b-a3b", CostLayout(dp=4, ep=4))
    divided = EngineCore("e0", Role.COLOCATED, dp4, 8192, 16, 8, divide_chunk=True)
    full = EngineCore("e0", Role.COLOCATED, dp4, 8192, 16, 8)
    for c in (divided, full):
        c.admit_prefill(work("a", new=5000))
    assert divided.rank_chunk_tokens == 2048 and [n for _, n in divided.plan(1.0).prefill] == [2048]
    assert full.rank_chunk_tokens == 8192 and [n for _, n in full.plan(1.0).prefill] == [5000]
    single = EngineCore("e0", Role.COLOCATED, PRESET, 8192, 16, 8, divide_chunk=True)
    assert single.rank_chunk_tokens == 8192  # one rank: nothing to divide


def test_a_layout_switch_resizes_the_host_tier_and_keeps_copies_due():
    c = engine(capacity=10_000, ratio=2.0)
    c._host_copy_tokens[0] = 500
    c.preset = with_layout("h200-qwen3-30b-a3b", CostLayout(dp=4, ep=4))
    assert c.prefixes.host_capacity_tokens == 2 * c.preset.kv_capacity_tokens
    assert c._host_copy_tokens == [500, 0, 0, 0]


def _dp4_with_decodes(delayer: bool) -> EngineCore:
    """A DP4 colocated engine decoding on every rank, then one new turn on rank 0."""
    dp4 = with_layout("h200-qwen3-30b-a3b", CostLayout(dp=4, ep=4))
    c = EngineCore("e0", Role.COLOCATED, dp4, 8192, 16, 8, divide_chunk=True, prefill_delayer=delayer)
    for i in range(4):
        seq = c.admit_decode(decode_work(f"d{i}", context=2000, out=500))
        seq.rank = i
    c.admit_prefill(work("new", new=800, out=10)).rank = 0
    return c


def test_the_prefill_delayer_holds_a_lone_ranks_new_prefill_for_at_most_29_passes():
    c = _dp4_with_decodes(delayer=True)
    passes = 0
    while True:
        batch = c.plan(max_advance_s=10.0)
        if batch.prefill:
            break
        assert [s.work.trajectory_id for s in batch.decode] == [f"d{i}" for i in range(4)]
        passes += batch.iterations
        c.complete(batch)
    assert passes == 29 == c.delayed_passes  # PREFILL_DELAYER_MAX_DELAY_PASSES - 1, then it lets the prefill through
    c.complete(batch)
    assert c._delayed_passes == 0


def test_the_prefill_delayer_lets_prefill_through_when_every_rank_has_some():
    c = _dp4_with_decodes(delayer=True)
    for r in range(1, 4):
        c.admit_prefill(work(f"new{r}", new=800, out=10)).rank = r
    assert sorted(s.rank for s, _ in c.plan(max_advance_s=10.0).prefill) == [0, 1, 2, 3]
    assert c.delayed_passes == 0


def test_without_the_delayer_or_on_a_decode_engine_a_lone_prefill_runs_at_once():
    assert _dp4_with_decodes(delayer=False).plan(max_advance_s=10.0).prefill
    c = _dp4_with_decodes(delayer=True)
    c.role = Role.DECODE
    assert c.plan(max_advance_s=10.0).prefill and c.delayed_passes == 0


def test_an_idle_group_does_not_wait_for_the_delayer():
    dp4 = with_layout("h200-qwen3-30b-a3b", CostLayout(dp=4, ep=4))
    c = EngineCore("e0", Role.COLOCATED, dp4, 8192, 16, 8, prefill_delayer=True)
    c.admit_prefill(work("new", new=800, out=10))
    assert c.plan(max_advance_s=10.0).prefill


def test_dp_attention_admits_with_sglangs_conservativeness_scaled_by_0_3():
    from actors.engine.admission import INIT_NEW_TOKEN_RATIO

    dp4 = with_layout("h200-qwen3-30b-a3b", CostLayout(dp=4, ep=4))
    c = EngineCore("e0", Role.COLOCATED, dp4, 8192, 16, 8)
    assert c.new_token_ratio.current == pytest.approx(0.3 * INIT_NEW_TOKEN_RATIO)
    assert c.new_token_ratio.floor == pytest.approx(0.3 * INIT_NEW_TOKEN_RATIO * 0.14)
    c.new_token_ratio.decay(600)
    assert c.new_token_ratio.current == pytest.approx(c.new_token_ratio.floor)
    single = EngineCore("e0", Role.COLOCATED, PRESET, 8192, 16, 8)
    assert single.new_token_ratio.current == INIT_NEW_TOKEN_RATIO
    c.preset = PRESET  # a switch to a one-rank layout
    assert c.new_token_ratio.current == INIT_NEW_TOKEN_RATIO
