"""The engine core's KV ledger (actors/engine/kv_ledger.py) stays equal to a count over
every sequence, whatever the core does: admissions, steps, preemption and retraction,
hand-off holds, migrations and weight updates."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from actors.engine.core import EngineCore
from actors.engine.emulated.costmodel import PRESETS
from actors.engine.sequence import HELD, OUT, RUNNING, WAITING
from bus_schemas.control import Role
from bus_schemas.work import DecodeWork, KvHandle, PrefillWork

PRESET = PRESETS["h100-qwen3-8b"]


def work(n: int, context: int, new: int, out: int, version: int = 0, prompt: str = "") -> PrefillWork:
    return PrefillWork(
        work_id=f"t{n}/n/t0/a0",
        trajectory_id=f"t{n % 7}",  # trajectories return: their prefixes are cached and taken again
        turn=0,
        env_id="env0",
        task_family="swe",
        policy_version=version,
        context_tokens=context,
        new_tokens=new,
        max_output_tokens=4096,
        target_output_tokens=out,
        queued_at_s=0.0,
        prompt_key=prompt,
    )


def assert_ledger_counts(c: EngineCore) -> None:
    used, resident = c.counted_kv_tokens()
    assert (c.kv_used_tokens, c.kv_resident_tokens) == (used, resident)
    assert c.waiting_prefill_tokens == sum(s.prefill_left for s in c.waiting)
    places = {OUT: [*c.retracted], WAITING: [*c.waiting], RUNNING: [*c.running.values()], HELD: [h.seq for h in c.held.values()]}
    for place, seqs in places.items():
        assert all(s.place == place for s in seqs)
    ranks = c.preset.dp_ranks
    running = [sum(1 for s in c.running.values() if s.rank == r) for r in range(ranks)]
    context = [sum(s.kv_tokens for s in c.running.values() if s.rank == r) for r in range(ranks)]
    assert c._decode_per_rank(set()) == ((running, context) if ranks > 1 else ([len(c.running)], [sum(context)]))
    loads = [sum(s.kv_reserved_tokens for s in [*c.waiting, *c.running.values()] if s.rank == r) for r in range(ranks)]
    assert c._least_loaded_rank() == min(range(ranks), key=loads.__getitem__)
    admitted = {s.work.trajectory_id for s in [*c.waiting, *c.running.values(), *(h.seq for h in c.held.values())]}
    assert all(c.in_flight(f"t{i}") == (f"t{i}" in admitted) for i in range(7))


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    role=st.sampled_from([Role.COLOCATED, Role.PREFILL, Role.DECODE]),
    dp=st.sampled_from([1, 2, 4]),
    capacity=st.integers(3_000, 20_000),
    host_kv_ratio=st.sampled_from([0.0, 2.0]),
    admission=st.sampled_from(["sglang", "vllm"]),
)
def test_the_ledger_equals_a_count_over_every_sequence(seed, role, dp, capacity, host_kv_ratio, admission):
    rng = random.Random(seed)
    preset = replace(PRESET, kv_capacity_tokens=capacity, dp_ranks=dp)
    c = EngineCore("e0", role, preset, 1024, 16, 16, admission=admission, host_kv_ratio=host_kv_ratio)
    version, now_s, n = 0, 0.0, 0
    for _ in range(120):
        op = rng.random()
        if op < 0.35:  # new work arrives
            n += 1
            w = work(
                n,
                rng.choice([0, rng.randint(1, capacity // 3)]),
                rng.randint(1, capacity // 4),
                rng.randint(1, 300),
                version,
                rng.choice(["", "p"]),
            )
            if role is Role.DECODE:
                handle = KvHandle(engine_id="e9", handle_id=w.work_id, tokens=w.context_tokens, kv_bytes=1, expires_at_s=1.0)
                c.admit_decode(
                    DecodeWork(prefill=w, kv=handle, prefilled_at_s=now_s, cached_prefix_tokens=rng.randint(0, w.context_tokens))
                )
            else:
                c.admit_prefill(w)
        elif op < 0.8:  # a step
            batch = c.plan(max_advance_s=rng.choice([0.05, 0.5, 5.0]), repeat_prefill=rng.random() < 0.5)
            if batch is not None:
                now_s += batch.duration_s
                for kind, seq in c.complete(batch):
                    if kind == "prefill_done" and seq.handoff:
                        c.hold(seq, seq.key, now_s + rng.choice([0.0, 10.0]))
        elif op < 0.88 and c.held:  # a decode engine takes a held KV, or it expires
            handle = rng.choice(list(c.held))
            c.release(handle, now_s) if rng.random() < 0.7 else c.expire(now_s + 1.0)
        elif op < 0.93:
            c.detach_running()  # a switch migrates the decodes away
        elif op < 0.96:
            version += 1
            c.interrupt(version)  # a weight update cuts in
        else:
            c.hand_off_waiting()
        assert_ledger_counts(c)
