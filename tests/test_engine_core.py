"""The scheduler core on hand-built work: no bus, no clock."""

from __future__ import annotations

import pytest

from actors.engine.core import EngineCore
from actors.engine.emulated.costmodel import PRESETS, decode_run_s, iteration_s
from bus_schemas.control import Role
from bus_schemas.work import DecodeWork, KvHandle, PrefillWork

PRESET = PRESETS["h100-qwen3-8b"]


def work(traj="t0", turn=0, context=0, new=1000, out=50, version=0, cap=4096) -> PrefillWork:
    return PrefillWork(
        work_id=f"{traj}/n/t{turn}/a0",
        trajectory_id=traj,
        turn=turn,
        env_id="env0",
        task_family="swe",
        policy_version=version,
        context_tokens=context,
        new_tokens=new,
        max_output_tokens=cap,
        target_output_tokens=out,
        queued_at_s=0.0,
    )


def core(role=Role.COLOCATED, budget=2048, max_waiting=8, max_decode=16) -> EngineCore:
    return EngineCore("e0", role, PRESET, budget, max_decode, max_waiting)


def run_to_idle(c: EngineCore, max_advance_s=1.0):
    done, steps = [], 0
    while (batch := c.plan(max_advance_s)) is not None:
        done += c.complete(batch)
        steps += 1
    return done, steps


def test_prefill_is_chunked_under_the_token_budget():
    c = core(budget=2048)
    c.admit_prefill(work("a", new=3000))
    c.admit_prefill(work("b", new=500))
    first = c.plan(1.0)
    assert [(s.work.trajectory_id, n) for s, n in first.prefill] == [("a", 2048)]
    assert [k for k, _ in first.started] == ["prefill_started"]
    c.complete(first)
    second = c.plan(1.0)
    assert [(s.work.trajectory_id, n) for s, n in second.prefill] == [("a", 952), ("b", 500)]


def test_colocated_turn_goes_prefill_then_decode_to_its_target():
    c = core()
    c.admit_prefill(work(out=40))
    done, _ = run_to_idle(c)
    assert [k for k, _ in done] == ["prefill_done", "decode_done"]
    assert done[-1][1].generated == 40 and c.idle


def test_decode_only_steps_advance_to_the_next_finish_in_one_go():
    c = core()
    c.admit_prefill(work("a", new=100, out=30))
    c.admit_prefill(work("b", new=100, out=300))
    c.complete(c.plan(10.0))  # both prefilled in one step
    batch = c.plan(10.0)
    assert batch.prefill == [] and batch.iterations == 29  # "a" finishes; "b" keeps going
    assert batch.duration_s == pytest.approx(decode_run_s(PRESET, 2, 200 + 2, 29))
    done = c.complete(batch)
    assert [(k, s.work.trajectory_id) for k, s in done] == [("decode_done", "a")]


def test_max_advance_bounds_a_decode_step():
    c = core()
    c.admit_prefill(work(new=100, out=10_000))
    c.complete(c.plan(1.0))
    one_s = iteration_s(PRESET, (), 1, 101)
    assert c.plan(max_advance_s=10 * one_s).iterations == 10


def test_returning_trajectory_hits_the_prefix_cache():
    c = core()
    c.admit_prefill(work("a", turn=0, new=2000, out=100))
    run_to_idle(c)
    seq = c.admit_prefill(work("a", turn=1, context=2100, new=300, out=10))
    assert seq.cached_prefix_tokens == 2100 and seq.prefill_tokens == 300
    other_version = c.admit_prefill(work("a", turn=1, context=2100, new=300, version=1))
    assert other_version.cached_prefix_tokens == 0  # stale-policy KV is never reused


def test_prefill_role_holds_kv_until_released_or_expired():
    c = core(role=Role.PREFILL)
    c.admit_prefill(work("a", new=1000))
    c.admit_prefill(work("b", new=1000))
    done, _ = run_to_idle(c)
    assert [k for k, _ in done] == ["prefill_done", "prefill_done"]
    for _, seq in done:
        c.hold(seq, seq.key, expires_at_s=10.0)
    assert c.kv_used_tokens == 2 * 1001
    assert c.release("a/n/t0/a0", now_s=5.0).work.trajectory_id == "a"
    assert c.release("a/n/t0/a0", now_s=5.0) is None  # a handle is fetched once
    assert [s.work.trajectory_id for s in c.expire(now_s=11.0)] == ["b"]
    assert c.kv_used_tokens == 0 and not c.held


def test_decode_role_admits_prefilled_work_with_its_first_token():
    c = core(role=Role.DECODE)
    w = work("a", context=500, new=100, out=20)
    handle = KvHandle(engine_id="e9", handle_id=w.work_id, tokens=600, kv_bytes=1, expires_at_s=1.0)
    seq = c.admit_decode(DecodeWork(prefill=w, kv=handle, prefilled_at_s=0.0))
    assert seq.generated == 1 and seq.kv_tokens == 601
    done, _ = run_to_idle(c)
    assert [k for k, _ in done] == ["decode_done"] and done[0][1].prefill_engine_id == "e9"


def test_room_respects_queue_and_kv_limits():
    c = core(max_waiting=2)
    assert c.room() == 2 and c.has_room()
    c.admit_prefill(work("a", new=PRESET.kv_capacity_tokens))  # fills the KV pool
    assert c.room() == 0 and not c.has_room()
    roomy = core(max_waiting=1)
    roomy.admit_prefill(work("b", new=8))  # the queue is full, the KV pool nearly empty
    assert roomy.room() == 0 and not roomy.has_room()


def test_iteration_time_grows_with_work():
    base = iteration_s(PRESET, [(512, 0)], 8, 8000)
    assert iteration_s(PRESET, [(1024, 0)], 8, 8000) > base
    assert iteration_s(PRESET, [(512, 4000)], 8, 8000) > base
    assert iteration_s(PRESET, [(512, 0)], 16, 16000) > base
    assert iteration_s(PRESET, [], 0, 0) == 0.0


def test_a_full_kv_pool_preempts_the_newest_sequence_and_recomputes_it():
    """Greedy admission (vLLM's): both start, and the pool runs out as they grow."""
    from dataclasses import replace

    small = EngineCore("e0", Role.COLOCATED, replace(PRESET, kv_capacity_tokens=2_100), 8192, 16, 8, admission="vllm")
    small.admit_prefill(work("old", new=1000, out=200))
    small.admit_prefill(work("new", new=1000, out=200))
    small.complete(small.plan(1.0))  # both prefilled: 2002 of 2100 tokens in use
    batch = small.plan(10.0)  # 2 x 49 more tokens fit; beyond that "new" must go
    assert small.preemptions == 0 and batch.iterations == 49
    small.complete(batch)
    small.plan(1.0)
    assert small.preemptions == 1 and [s.work.trajectory_id for s in small.waiting] == ["new"]
    assert small.kv_resident_tokens <= small.kv_capacity_tokens
    done, _ = run_to_idle(small)
    assert sorted((k, s.work.trajectory_id, s.generated) for k, s in done) == [
        ("decode_done", "new", 200),
        ("decode_done", "old", 200),
    ]  # the preempted sequence was recomputed (no second prefill_done) and finished its turn


def decode_work(traj: str, context: int, out: int) -> DecodeWork:
    w = work(traj, context=context, new=0, out=out)
    return DecodeWork(
        prefill=w, kv=KvHandle(engine_id="e9", handle_id=w.work_id, tokens=context, kv_bytes=1, expires_at_s=1.0), prefilled_at_s=0.0
    )


@pytest.mark.parametrize("role", [Role.DECODE, Role.COLOCATED])
@pytest.mark.parametrize("capacity", [2_600, 3_300, 5_000])
def test_an_engine_with_a_host_tier_out_of_kv_parks_kv_in_host_memory_and_never_recomputes(capacity, role):
    """With a host KV tier (SGLang's PD decode server; a colocated one with the hierarchical
    cache), a retracted decode keeps its tokens and KV, takes no prefill step, and costs a
    host copy each way; no new request is taken while one is parked."""
    from dataclasses import replace

    from actors.engine.emulated.costmodel import host_copy_s

    c = EngineCore("e0", role, replace(PRESET, kv_capacity_tokens=capacity), 8192, 16, 8, admission="sglang", host_kv_ratio=2.0)
    for i in range(4):
        c.admit_decode(decode_work(f"t{i}", context=500, out=400 + 50 * i))
    decoded, copied, parked_seen = {}, [], False
    for _ in range(10_000):
        before = {s.key: s.kv_tokens for s in c.retracted}
        batch = c.plan(max_advance_s=0.5)
        if batch is None:
            break
        assert not batch.prefill  # nothing is computed again
        assert c.kv_resident_tokens <= capacity
        if c.retracted:
            parked_seen = True
            assert c.room() == 0
        moved = [s for s in c.retracted if s.key not in before] + [s for s in batch.decode if s.key in before]
        if moved:  # parked or brought back this step: the rank's copy, before the step
            tokens = sum(before.get(s.key, s.kv_tokens) for s in moved)
            assert batch.host_copy_s == pytest.approx(host_copy_s(c.preset, tokens))
            copied.append(tokens)
        else:
            assert batch.host_copy_s == 0.0
        for kind, seq in c.complete(batch):
            decoded[seq.work.trajectory_id] = (kind, seq.generated)
    assert c.idle and decoded == {f"t{i}": ("decode_done", 400 + 50 * i) for i in range(4)}
    assert c.preemptions == 0
    assert parked_seen == (c.retractions > 0) == (capacity < 5_000)  # the largest pool holds all four
    assert sum(copied) == 2 * c.retracted_kv_tokens  # each parked token went out and came back


def test_parked_decodes_leave_with_a_switch_and_are_recomputed_after_a_weight_update():
    """A parked decode is still this engine's: a switch migrates it with the running ones, and
    an interrupting weight update recomputes it under the new version (its host KV is old)."""
    from dataclasses import replace

    def parked_engine() -> EngineCore:
        c = EngineCore("e0", Role.DECODE, replace(PRESET, kv_capacity_tokens=2_600), 8192, 16, 8, admission="sglang", host_kv_ratio=2.0)
        for i in range(4):
            c.admit_decode(decode_work(f"t{i}", context=500, out=600))
        while not c.retracted:
            c.complete(c.plan(max_advance_s=0.5))
        return c

    c = parked_engine()
    parked = {s.key for s in c.retracted}
    assert c.holds(next(iter(parked))) and not c.idle and len(c.decoding) == 4
    assert {s.key for s in c.detach_running()} >= parked and c.idle
    c = parked_engine()
    cut = c.interrupt(version=1)
    assert parked <= {s.key for s in cut} and not c.retracted
    assert all(s.preempted and s.work.policy_version == 1 for s in c.waiting)


from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 3000), st.integers(1, 400)), min_size=1, max_size=12),
    st.integers(3_500, 12_000),
    st.sampled_from([1, 2, 4]),
    st.sampled_from(["sglang", "vllm"]),
)
def test_any_workload_finishes_without_overflowing_the_kv_pool(turns, capacity, dp, admission):
    from dataclasses import replace

    preset = replace(PRESET, kv_capacity_tokens=capacity, dp_ranks=dp)
    c = EngineCore("e0", Role.COLOCATED, preset, 1024, 16, 16, admission=admission)
    for i, (new, out) in enumerate(turns):
        c.admit_prefill(work(f"t{i}", new=min(new, capacity // 2), out=out))
    decoded: dict[str, int] = {}
    for _ in range(100_000):
        batch = c.plan(max_advance_s=0.5)
        if batch is None:
            break
        for kind, seq in c.complete(batch):
            if kind == "decode_done":
                decoded[seq.work.trajectory_id] = seq.generated
        assert c.kv_resident_tokens <= capacity
    assert c.idle and decoded == {f"t{i}": out for i, (_, out) in enumerate(turns)}


def timeline(c: EngineCore, repeat_prefill: bool, max_advance_s: float = 1.0):
    """(model time, kind, trajectory) of every finish, and the number of steps taken."""
    now_s, done, steps = 0.0, [], 0
    while (batch := c.plan(max_advance_s, repeat_prefill)) is not None:
        now_s += batch.duration_s
        done += [(round(now_s, 9), kind, s.work.trajectory_id, s.generated) for kind, s in c.complete(batch)]
        steps += 1
    return done, steps


@pytest.mark.parametrize("max_advance_s", [1.0, 0.2])  # 0.2: about two iterations a step
def test_repeated_prefill_iterations_give_the_same_timeline_in_fewer_steps(max_advance_s):
    def loaded() -> EngineCore:
        c = core(budget=2048)
        c.admit_prefill(work("d", new=200, out=40))
        c.complete(c.plan(1.0))  # "d" decodes while the long prompts prefill in chunks beside it
        c.admit_prefill(work("p", new=20_000, out=30))
        c.admit_prefill(work("q", context=0, new=9_000, out=5))
        return c

    one_by_one, steps_one = timeline(loaded(), False, max_advance_s)
    repeated, steps_repeated = timeline(loaded(), True, max_advance_s)
    assert [(k, t, g) for _, k, t, g in repeated] == [(k, t, g) for _, k, t, g in one_by_one]
    assert [at for at, *_ in repeated] == pytest.approx([at for at, *_ in one_by_one], rel=1e-9)
    assert steps_repeated < steps_one


def test_a_repeated_prefill_step_stops_before_a_decode_finishes():
    c = core(budget=2048)
    c.admit_prefill(work("d", new=200, out=4))
    c.complete(c.plan(1.0))
    c.admit_prefill(work("p", new=20_000, out=30))
    batch = c.plan(10.0, repeat_prefill=True)
    assert [(s.work.trajectory_id, n) for s, n in batch.prefill] == [("p", 2047)]
    assert batch.iterations == 3  # "d" has 3 tokens left: it finishes at the end of this step
    assert batch.prefill_tokens == 3 * 2047 and len(batch.ends_s) == 3
    assert [k for k, _ in c.complete(batch)] == ["decode_done"]
