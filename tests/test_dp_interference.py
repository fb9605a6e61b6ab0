"""DP-attention groups share one forward mode per step (engines.dp_sync).

The cost-model rule, checked against arithmetic done here from the group's own decode-only
step: under "sglang" a group with one prefilling rank makes every rank pay the eager factor
and the normal-mode all-to-all, and a decode-only group runs at graph speed; under "vllm" a
chunk above the capture size makes every rank eager, a smaller one piecewise and padded.
Then the scheduler core: SGLang's prefill-first rule stalls the prefilling rank's decodes
(unless mixed_chunk), and a colocated engine's decodes pay for a prefill that a PD decode
engine never sees. No bus, no clock.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from actors.engine.core import EngineCore, Seq
from actors.engine.emulated.costmodel import Layout, RankLoad, group_iteration_s, with_layout, with_lockstep
from bus_schemas.control import Role
from bus_schemas.work import DecodeWork, KvHandle
from tests.test_engine_core import work

BASE = with_layout("h200-qwen3-30b-a3b", Layout(dp=4, ep=4))
SGLANG = with_lockstep(BASE, "sglang")
DECODES = 32  # 8 per rank
CONTEXT = 4000
LONG_PREFILL_TOKENS = 16_384


def decode_rank(seqs: int = 8) -> RankLoad:
    return RankLoad((), seqs, seqs * CONTEXT)


def graph_a2a_s(preset, loads) -> float:
    return preset.a2a_latency_s + preset.a2a_s_per_token * sum(r.new_tokens for r in loads)


def test_a_decode_only_group_runs_at_graph_speed():
    loads = [decode_rank()] * 4
    assert group_iteration_s(SGLANG, loads) == group_iteration_s(with_lockstep(BASE, "ideal"), loads)


@pytest.mark.parametrize("end", ["low", "value", "high"])
def test_one_prefilling_rank_makes_every_rank_pay_eager_and_normal_all_to_all(end):
    preset = with_lockstep(BASE, "sglang", end=end)
    decode_only = [decode_rank()] * 4
    # one decode rank's forward at graph speed, from the group's decode-only step
    rank_graph_s = group_iteration_s(preset, decode_only) - preset.c0_s - graph_a2a_s(preset, decode_only)
    prefill = RankLoad(((8, 0),), 0, 0)  # an 8-token extend on rank 0 (its decodes wait: prefill-first)
    mixed = [prefill] + [decode_rank()] * 3
    busiest = 8
    normal_a2a_s = preset.a2a_normal_fixed_s + preset.a2a_normal_s_per_token * busiest - preset.a2a_ll_s
    expected = preset.c0_s + normal_a2a_s + preset.eager_factor * rank_graph_s
    assert group_iteration_s(preset, mixed) == pytest.approx(expected, rel=1e-9)
    assert preset.eager_factor >= 1.3 and preset.a2a_normal_fixed_s > graph_a2a_s(preset, decode_only)


def test_the_range_ends_order_the_penalty():
    mixed = [RankLoad(((512, 0),), 0, 0)] + [decode_rank()] * 3
    low, mid, high = (group_iteration_s(with_lockstep(BASE, "sglang", end=e), mixed) for e in ("low", "value", "high"))
    ideal = group_iteration_s(with_lockstep(BASE, "ideal"), mixed)
    assert ideal < low < mid < high


def test_vllm_eager_above_capture_size_piecewise_and_padded_below():
    base = replace(BASE, routed_share=0.0)  # the padding alone (the routed experts' spread: tests/test_costmodel_ep.py)
    preset = with_lockstep(base, "vllm")
    ideal = with_lockstep(base, "ideal")
    decode_only = [decode_rank()] * 4
    assert group_iteration_s(preset, decode_only) == group_iteration_s(ideal, decode_only)  # full graphs
    rank_graph_s = group_iteration_s(preset, decode_only) - preset.c0_s - graph_a2a_s(preset, decode_only)
    big = [RankLoad(((preset.graph_capture_tokens + 1, 0),), 0, 0)] + [decode_rank()] * 3
    assert group_iteration_s(preset, big) >= preset.c0_s + preset.eager_factor * rank_graph_s
    # below the capture size: the decode ranks run piecewise, their GEMMs padded to the chunk
    chunk = 256
    small = [RankLoad(((chunk, 0),), 0, 0)] + [decode_rank()] * 3
    weight_s = base.weight_s(chunk + 24)
    decode_rest_s = base.c_kv_s * 8 * CONTEXT + base.c_seq_s * 8
    padded = max(weight_s, base.t_dec_s * 8 + base.t_tok_s * (chunk - 8)) + decode_rest_s
    piecewise_extra = (preset.piecewise_factor - 1) * (max(weight_s, base.t_dec_s * 8) + decode_rest_s)
    prefill_rank = max(weight_s, base.t_tok_s * chunk) + base.c_attn_s * chunk * chunk / 2
    expected = preset.c0_s + graph_a2a_s(preset, small) + max(padded + piecewise_extra, prefill_rank)
    assert group_iteration_s(preset, small) == pytest.approx(expected, rel=1e-9)
    assert group_iteration_s(preset, small) > group_iteration_s(ideal, small)


def test_single_rank_engines_are_unaffected_by_dp_sync():
    dense = with_lockstep(with_layout("h200-qwen3-8b", Layout()), "sglang")
    loads = [RankLoad(((2048, 0),), 16, 16 * CONTEXT)]
    assert dense.dp_sync == "ideal"
    assert group_iteration_s(dense, loads) == group_iteration_s(with_layout("h200-qwen3-8b", Layout()), loads)


# --- the scheduler core ----------------------------------------------------------------------


def engine(role: Role, preset=SGLANG) -> EngineCore:
    return EngineCore("e", role, preset, max_batch_tokens=8192, max_decode_seqs=64, max_waiting=64)


def add_decodes(core: EngineCore) -> list[Seq]:
    seqs = []
    for i in range(DECODES):
        w = work(f"d{i}", context=CONTEXT, new=100, out=100_000)
        handle = KvHandle(engine_id="p", handle_id=w.work_id, tokens=CONTEXT + 100, kv_bytes=1, expires_at_s=1e9)
        seq = core.admit_decode(DecodeWork(prefill=w, kv=handle, prefilled_at_s=0.0))
        seq.rank = i % core.preset.dp_ranks
        seqs.append(seq)
    return seqs


def add_long_prefill(core: EngineCore) -> Seq:
    seq = core.admit_prefill(work("long", new=LONG_PREFILL_TOKENS, out=1))
    seq.rank = 0
    return seq


def one_step(core: EngineCore):
    batch = core.plan(max_advance_s=0.0)  # one iteration per step: exact accounting
    core.complete(batch)
    return batch


def test_prefill_first_stalls_the_prefilling_ranks_decodes_unless_mixed_chunk():
    for mixed_chunk, rank0_advances in ((False, False), (True, True)):
        core = engine(Role.COLOCATED, replace(SGLANG, mixed_chunk=mixed_chunk))
        seqs = add_decodes(core)
        add_long_prefill(core)
        before = {s.key: s.generated for s in seqs}
        one_step(core)
        rank0 = [s for s in seqs if s.rank == 0]
        others = [s for s in seqs if s.rank != 0]
        assert all(s.generated == before[s.key] + 1 for s in others)
        assert all((s.generated == before[s.key] + 1) is rank0_advances for s in rank0)


def test_colocated_decodes_pay_for_a_prefill_a_pd_decode_engine_never_sees():
    colocated = engine(Role.COLOCATED)
    add_decodes(colocated)
    add_long_prefill(colocated)
    mixed_step_s = one_step(colocated).duration_s
    decode = engine(Role.DECODE)
    add_decodes(decode)
    pd_step_s = one_step(decode).duration_s
    # the decode engine runs at graph speed; the colocated one waits for the chunk, eagerly
    resident = RankLoad((), 8, 8 * (CONTEXT + 100 + 1))  # context, the turn and its first token
    assert pd_step_s == pytest.approx(group_iteration_s(SGLANG, [resident] * 4), rel=1e-9)
    assert mixed_step_s > 10 * pd_step_s
