"""SGLang's admission in the scheduler core (actors/engine/admission.py): a new request
starts only if the free KV also holds the expected growth of what runs; the ratio that
estimates that growth decays, jumps back after a preemption and resets when idle; a PD
decode engine keeps a fixed reservation per request; a PD prefill engine starts a hand-off
only while the decode side asks for work (on a real nats-server). `admission = "vllm"`
stays greedy."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace

import msgspec
import pytest

from actors.engine import admission
from actors.engine.actor import EngineActor
from actors.engine.core import EngineCore
from actors.engine.emulated.costmodel import PRESETS
from bus_schemas import streams, subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import Role
from bus_schemas.work import DecodeWork, KvHandle
from tests.actor_helpers import at_scale, build
from tests.test_engine_core import work
from tests.test_switch_protocol import until

PRESET = PRESETS["h100-qwen3-8b"]


def engine(capacity: int, mode: str, role: Role = Role.COLOCATED, max_decode: int = 64) -> EngineCore:
    return EngineCore("e0", role, replace(PRESET, kv_capacity_tokens=capacity), 8192, max_decode, 64, admission=mode)


def prefilling(batch) -> list[str]:
    return [seq.work.trajectory_id for seq, _ in batch.prefill]


def test_a_new_request_waits_until_the_growth_of_what_runs_fits_with_it():
    c = engine(6_000, "sglang")
    c.admit_prefill(work("running", out=3000))
    c.complete(c.plan(1.0))  # prefilled: 1,001 tokens resident, up to 4,095 more to come
    c.admit_prefill(work("new"))
    growth = admission.growth_tokens(4096, 1, c.new_token_ratio.current)
    free = c.kv_capacity_tokens - c.kv_resident_tokens - 1
    assert 1000 < free and 1000 + admission.growth_tokens(4096, 0, c.new_token_ratio.current) > free - growth  # fits now, not with growth
    batch = c.plan(1.0)
    assert prefilling(batch) == [] and [s.work.trajectory_id for s in batch.decode] == ["running"]
    greedy = engine(6_000, "vllm")
    greedy.admit_prefill(work("running", out=3000))
    greedy.complete(greedy.plan(1.0))
    greedy.admit_prefill(work("new"))
    assert prefilling(greedy.plan(1.0)) == ["new"]
    done = []  # as the running request's remaining growth shrinks (and the ratio decays), the new one starts
    while (batch := c.plan(5.0)) is not None:
        done += [(kind, s.work.trajectory_id) for kind, s in c.complete(batch)]
    assert ("prefill_done", "new") in done and ("decode_done", "new") in done and c.preemptions == 0


def test_first_come_first_served_a_later_small_request_does_not_jump_a_blocked_one():
    c = engine(6_000, "sglang")
    c.admit_prefill(work("running", out=3000))
    c.complete(c.plan(1.0))
    c.admit_prefill(work("big"))
    c.admit_prefill(work("small", new=10, cap=16))
    assert prefilling(c.plan(1.0)) == []


def test_an_engine_with_nothing_running_starts_a_request_whatever_its_growth():
    c = engine(2_100, "sglang")  # 1,000 + 0.7 x 4,096 does not fit; nothing else would ever run
    c.admit_prefill(work("alone", out=200))
    assert prefilling(c.plan(1.0)) == ["alone"]


def test_the_ratio_decays_per_decode_step_to_its_floor_and_resets_when_idle():
    c = engine(200_000, "sglang")
    c.admit_prefill(work("a", new=100, out=800))
    c.complete(c.plan(1.0))
    batch = c.plan(0.05)
    c.complete(batch)
    step = (admission.INIT_NEW_TOKEN_RATIO * (1 - admission.MIN_NEW_TOKEN_RATIO_FACTOR)) / admission.NEW_TOKEN_RATIO_DECAY_STEPS
    assert c.new_token_ratio.current == pytest.approx(admission.INIT_NEW_TOKEN_RATIO - step * batch.iterations)
    while c.running:
        c.complete(c.plan(100.0))
    assert c.new_token_ratio.current == pytest.approx(
        admission.INIT_NEW_TOKEN_RATIO * admission.MIN_NEW_TOKEN_RATIO_FACTOR
    )  # 799 steps > 600
    assert c.plan(1.0) is None and c.new_token_ratio.current == admission.INIT_NEW_TOKEN_RATIO


def test_a_preemption_sets_the_ratio_from_the_batch_that_stays():
    ratio = admission.NewTokenRatio(current=0.098)
    ratio.after_preemption([300, 100], [4096, 4096])
    assert ratio.current == pytest.approx((400 + 2 * admission.RETRACT_DECODE_STEPS) / 8193)
    ratio.after_preemption([4000], [4096])
    assert ratio.current == pytest.approx(min(1.0, 4020 / 4097))


def test_a_decode_engine_keeps_a_reservation_per_request():
    capacity = 10_000
    c, greedy = engine(capacity, "sglang", Role.DECODE), engine(capacity, "vllm", Role.DECODE)
    for i in range(8):  # 8 x 1,001 resident: 2,000 free, less than 8 x 512 reserved
        item = DecodeWork(
            prefill=work(f"t{i}", out=900),
            kv=KvHandle(engine_id="p0", handle_id=f"h{i}", tokens=1000, kv_bytes=1, expires_at_s=9.0),
            cached_prefix_tokens=0,
            generated_tokens=1,
            prefilled_at_s=0.0,
        )
        c.admit_decode(item)
        greedy.admit_decode(item)
    assert c.room() == 0 and greedy.room() > 0
    assert (
        engine(capacity, "sglang", Role.DECODE).room(pending=capacity // admission.RESERVED_DECODE_TOKENS + 1) == 0
    )  # transfers on their way count


def test_reserving_growth_preempts_less_than_greedy_admission_on_a_tight_pool():
    """Twelve long turns on a pool that holds a few of them at full length: greedy admission
    starts them all and preempts as they grow; reserving growth keeps preemptions rare.
    Both finish every turn with the same output."""
    results = {}
    for mode in ("sglang", "vllm"):
        c = engine(24_000, mode)
        for i in range(12):
            c.admit_prefill(work(f"t{i}", new=1500, out=2500))
        done = []
        for _ in range(100_000):
            batch = c.plan(0.5)
            if batch is None:
                break
            done += [(s.work.trajectory_id, s.generated) for kind, s in c.complete(batch) if kind == "decode_done"]
        results[mode] = (c.preemptions, sorted(done))
    assert results["sglang"][1] == results["vllm"][1] == sorted((f"t{i}", 2500) for i in range(12))
    assert results["sglang"][0] < results["vllm"][0] / 2


# --- SGLang's PD gate on the real bus: a prefill engine computes a turn only while the decode side asks for work
@contextlib.asynccontextmanager
async def prefill_engine_beside_an_untaken_turn(bus, config, untaken: str):
    """A prefill engine p0, started with a prefilled turn `untaken` already in the decode
    queue that no decode engine has taken; stopped on the way out. (Each test uses its own
    work ids: JetStream drops a repeated message id for a while.)"""
    stale = DecodeWork(
        prefill=work(untaken), kv=KvHandle(engine_id="p9", handle_id="h", tokens=1000, kv_bytes=1, expires_at_s=1e9), prefilled_at_s=0.0
    )
    await bus.jetstream().publish(subjects.work_decode(), encode(stale))
    p0 = build(EngineActor, "p0", at_scale(config, 100.0), bus, Role.PREFILL)
    running = asyncio.create_task(p0.run())
    try:
        await asyncio.wait_for(p0.ready.wait(), timeout=10)
        yield p0
    finally:
        p0.request_stop("test over")
        await asyncio.wait_for(running, timeout=15)


@pytest.mark.bus
async def test_a_prefill_engine_starts_no_handoff_while_the_decode_side_takes_no_work(bus, tiny_config):
    js = bus.jetstream()
    async with prefill_engine_beside_an_untaken_turn(bus, tiny_config, "waiting") as p0:
        await js.publish(subjects.work_prefill(), encode(work("new", new=300, out=12)))
        await until(lambda: p0.counters["prefill_gated"] >= 3 and p0.core.waiting)
        assert [s.work.trajectory_id for s in p0.core.waiting] == ["new"] and p0.core.waiting[0].prefill_done_tokens == 0
        decode_side = await streams.pull_subscription(js, streams.decode_consumer(), 30.0)
        [taken] = await decode_side.fetch(1, timeout=5)  # a decode engine takes the waiting turn ...
        assert decode(DecodeWork, taken.data).prefill.trajectory_id == "waiting"
        await taken.ack()
        gated = p0.counters["prefill_gated"]
        await until(lambda: p0.counters["prefill_gated"] >= gated + 3)  # ... but asks for no more: still held back
        assert p0.core.waiting and p0.core.waiting[0].prefill_done_tokens == 0
        [handed] = await decode_side.fetch(1, timeout=10)  # now it asks: the turn is prefilled and handed over
        assert decode(DecodeWork, handed.data).prefill.trajectory_id == "new"
        await handed.ack()


@pytest.mark.bus
async def test_greedy_admission_prefills_whatever_the_decode_side_does(bus, tiny_config):
    js = bus.jetstream()
    greedy = msgspec.structs.replace(tiny_config, engines=msgspec.structs.replace(tiny_config.engines, admission="vllm"))
    async with prefill_engine_beside_an_untaken_turn(bus, greedy, "stale") as p0:
        await js.publish(subjects.work_prefill(), encode(work("other", new=300, out=12)))
        decode_side = await streams.pull_subscription(js, streams.decode_consumer(), 30.0)
        got = []
        while "other" not in got:  # the turn is prefilled and handed over with "stale" still untaken
            [msg] = await decode_side.fetch(1, timeout=10)
            got.append(decode(DecodeWork, msg.data).prefill.trajectory_id)
            await msg.ack()
        assert got == ["stale", "other"] and p0.counters["prefill_gated"] == 0
