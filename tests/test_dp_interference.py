"""DP-attention groups: one rank's prefill stalls every rank's decode when prefill and decode
share an engine (colocated), and does not when they run on separate engines (PD).

Driven through the pure scheduler core in model time: no bus, no clock.
"""

from __future__ import annotations

from actors.engine.core import EngineCore, Seq
from actors.engine.emulated.costmodel import Layout, with_layout
from bus_schemas.control import Role
from bus_schemas.work import DecodeWork, KvHandle
from tests.test_engine_core import work

PRESET = with_layout("h200-qwen3-30b-a3b", Layout(dp=4, ep=4))
DECODES = 32  # 8 per rank
LONG_PREFILL_TOKENS = 16_384


def engine(role: Role) -> EngineCore:
    return EngineCore("e", role, PRESET, max_batch_tokens=8192, max_decode_seqs=64, max_waiting=64)


def add_decodes(core: EngineCore) -> list[Seq]:
    seqs = []
    for i in range(DECODES):
        w = work(f"d{i}", context=4000, new=100, out=100_000)
        handle = KvHandle(engine_id="p", handle_id=w.work_id, tokens=4100, kv_bytes=1, expires_at_s=1e9)
        seq = core.admit_decode(DecodeWork(prefill=w, kv=handle, prefilled_at_s=0.0))
        seq.rank = i % PRESET.dp_ranks
        seqs.append(seq)
    return seqs


def add_long_prefill(core: EngineCore) -> Seq:
    seq = core.admit_prefill(work("long", new=LONG_PREFILL_TOKENS, out=1))
    seq.rank = 0
    return seq


def run(core: EngineCore, duration_s: float) -> None:
    elapsed_s = 0.0
    while elapsed_s < duration_s:
        batch = core.plan(max_advance_s=0.0)  # one iteration per step: exact accounting
        elapsed_s += batch.duration_s
        core.complete(batch)


def tpot_s(core: EngineCore, seqs: list[Seq], duration_s: float) -> float:
    """Model seconds per generated token of `seqs` while `core` runs for `duration_s`."""
    before = sum(s.generated for s in seqs)
    start_busy = core.busy_s
    run(core, duration_s)
    return (core.busy_s - start_busy) / ((sum(s.generated for s in seqs) - before) / len(seqs))


def prefill_time_s() -> float:
    core = engine(Role.PREFILL)
    seq = add_long_prefill(core)
    elapsed_s = 0.0
    while seq in core.waiting:
        batch = core.plan(max_advance_s=0.0)
        elapsed_s += batch.duration_s
        core.complete(batch)
    return elapsed_s


def test_colocated_prefill_on_one_rank_slows_decode_on_every_other_rank():
    window_s = prefill_time_s()
    core = engine(Role.COLOCATED)
    seqs = add_decodes(core)
    baseline = tpot_s(core, seqs, window_s)
    add_long_prefill(core)
    other_ranks = [s for s in seqs if s.rank != 0]
    during = tpot_s(core, other_ranks, window_s)
    assert during > 3 * baseline, (during, baseline)  # ranks 1-3 wait for rank 0's prefill chunks


def test_pd_disaggregated_decode_keeps_its_pace_during_the_same_prefill():
    window_s = prefill_time_s()
    decode = engine(Role.DECODE)
    seqs = add_decodes(decode)
    baseline = tpot_s(decode, seqs, window_s)
    prefill = engine(Role.PREFILL)
    add_long_prefill(prefill)  # the prefill runs on its own engine, in the same window
    run(prefill, window_s)
    during = tpot_s(decode, [s for s in seqs if s.rank != 0], window_s)
    assert during < 1.05 * baseline, (during, baseline)
