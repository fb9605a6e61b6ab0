"""The engine actor on the real bus, in process: bad input, commands, the KV hand-off."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.engine.actor import EngineActor
from bus_schemas import streams, subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import CommandAck, LoadPolicy, Role, SetRole, command_subject
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.work import DecodeWork, KvHandle, TurnResult
from ops.export import read_stream
from tests.actor_helpers import at_scale, build
from tests.test_engine_core import work

pytestmark = pytest.mark.bus


def engine(bus, config, engine_id="e0", role=Role.COLOCATED) -> EngineActor:
    return build(EngineActor, engine_id, at_scale(config, 100.0), bus, role)


async def results(bus) -> list[TurnResult]:
    return await read_stream(bus.jetstream(), streams.RESULTS, subjects.result_all(), TurnResult)


async def events(bus) -> list[LifecycleEvent]:
    return await read_stream(bus.jetstream(), streams.LIFECYCLE, subjects.lifecycle_all(), LifecycleEvent)


async def command(bus, engine_id: str, message, timeout: float = 5) -> CommandAck:
    subject = command_subject(engine_id, message) if not isinstance(message, bytes) else subjects.ctl_engine(engine_id)
    reply = await bus.request(subject, encode(message) if not isinstance(message, bytes) else message, timeout=timeout)
    return decode(CommandAck, reply.data)


async def test_malformed_work_is_rejected_counted_and_the_engine_keeps_serving(bus, tiny_config):
    js = bus.jetstream()
    await js.publish(subjects.work_prefill(), b"\xc1 not msgpack")
    await js.publish(subjects.work_prefill(), msgspec.msgpack.encode({"work_id": "w", "turn": "x"}))
    await js.publish(subjects.work_prefill(), encode(work("good", new=300, out=12)))
    e0 = engine(bus, tiny_config)
    await asyncio.wait_for(e0.run(burst=True), timeout=30)
    assert e0.counters["invalid_messages"] == 2
    [result] = await results(bus)
    assert (result.trajectory_id, result.output_tokens, result.decode_engine_id) == ("good", 12, "e0")
    assert (await js.stream_info(streams.WORK_PREFILL.name)).state.messages == 0  # bad items are not redelivered
    kinds = [e.kind for e in await events(bus) if e.trajectory_id == "good"]
    assert kinds == [EventKind.PREFILL_STARTED, EventKind.PREFILL_DONE, EventKind.DECODE_STARTED, EventKind.DECODE_DONE]


async def test_commands_epochs_and_a_malformed_command(bus, tiny_config):
    e0 = engine(bus, tiny_config, role=Role.PREFILL)
    running = asyncio.create_task(e0.run())
    await asyncio.wait_for(e0.ready.wait(), timeout=10)
    try:
        bad = await command(bus, "e0", b"garbage")
        assert not bad.ok and "malformed" in bad.error
        assert (await command(bus, "e0", LoadPolicy(version=2))).policy_version == 2
        assert not (await command(bus, "e0", LoadPolicy(version=1))).ok  # never go back
        switched = await command(bus, "e0", SetRole(role=Role.DECODE, epoch=1, drain_deadline_s=5, reason="0:1 -> 0:1 (test)"))
        assert switched.ok and switched.role is Role.DECODE and switched.epoch == 1
        again = await command(bus, "e0", SetRole(role=Role.DECODE, epoch=1))
        assert again.ok and again.role is Role.DECODE  # idempotent
        stale = await command(bus, "e0", SetRole(role=Role.PREFILL, epoch=0))
        assert not stale.ok and "stale epoch" in stale.error and stale.role is Role.DECODE
        assert e0.counters["invalid_messages"] == 1
        # each command family on its own subject: the other's is refused, counted, and changes nothing
        crossed = decode(CommandAck, (await bus.request(subjects.ctl_engine("e0"), encode(LoadPolicy(version=3)), timeout=5)).data)
        assert not crossed.ok and "ctl.policy" in crossed.error and crossed.policy_version == 2
        crossed = decode(
            CommandAck, (await bus.request(subjects.ctl_policy("e0"), encode(SetRole(role=Role.PREFILL, epoch=2)), timeout=5)).data
        )
        assert not crossed.ok and "ctl.engine" in crossed.error and crossed.role is Role.DECODE
        assert e0.counters["commands_on_wrong_subject"] == 2
    finally:
        e0.request_stop("test over")
        await asyncio.wait_for(running, timeout=15)
    switches = [e for e in await events(bus) if e.kind is EventKind.ROLE_SWITCHED]
    assert [(s.engine_id, s.role, s.detail) for s in switches] == [("e0", "decode", "0:1 -> 0:1 (test)")]  # the reason, logged


async def test_a_new_policy_drops_the_older_policys_cached_prefixes(bus, tiny_config):
    """Sync RL: KV of an older policy is never reused, so loading a new one drops it. It must not
    stay in the heartbeat's cached prefix either: the allocator reads that as KV the fleet holds
    (a working set the decode side would have to take), and step 1 of a run looked full of
    step 0's histories."""
    done = asyncio.get_running_loop().create_future()

    async def on_result(msg) -> None:
        if not done.done():
            done.set_result(decode(TurnResult, msg.data))

    sub = await bus.subscribe(subjects.result_all(), cb=on_result)
    e0 = engine(bus, tiny_config)
    running = asyncio.create_task(e0.run())
    try:
        await asyncio.wait_for(e0.ready.wait(), timeout=10)
        await bus.jetstream().publish(subjects.work_prefill(), encode(work("kept", new=300, out=12)))
        await asyncio.wait_for(done, timeout=30)
        cached_before = e0.heartbeat().cached_prefix_tokens
        ack = await command(bus, "e0", LoadPolicy(version=1))
        cached_after = e0.heartbeat().cached_prefix_tokens
    finally:
        e0.request_stop("test over")
        await asyncio.wait_for(running, timeout=15)
        await sub.unsubscribe()
    assert cached_before == 312  # the finished turn's history, kept for its next turn under policy 0
    assert ack.ok and ack.policy_version == 1 and cached_after == 0


async def test_prefill_to_decode_hand_off_between_two_engines(bus, tiny_config):
    js = bus.jetstream()
    for i in range(3):
        await js.publish(subjects.work_prefill(), encode(work(f"t{i}", context=0, new=800, out=20)))
    prefill = engine(bus, tiny_config, "e0", Role.PREFILL)
    decode_ = engine(bus, tiny_config, "e1", Role.DECODE)
    await asyncio.wait_for(asyncio.gather(prefill.run(burst=True), decode_.run(burst=True)), timeout=30)
    got = await results(bus)
    assert sorted(r.trajectory_id for r in got) == ["t0", "t1", "t2"]
    assert {(r.prefill_engine_id, r.decode_engine_id, r.output_tokens) for r in got} == {("e0", "e1", 20)}
    transfers = [e for e in await events(bus) if e.kind is EventKind.KV_TRANSFER_DONE]
    assert len(transfers) == 3 and all(e.kv_bytes == 800 * 147_456 and e.duration_s > 0 for e in transfers)
    assert not prefill.core.held  # every handle was fetched and released


async def test_lost_kv_sends_the_turn_back_to_prefill(bus, tiny_config):
    """A decode item whose KV holder is gone is re-prefilled, never decoded on missing KV."""
    js = bus.jetstream()
    w = work("orphan", new=500, out=5)
    handle = KvHandle(engine_id="e7", handle_id=w.work_id, tokens=500, kv_bytes=1, expires_at_s=1e9)
    await js.publish(subjects.work_decode(), encode(DecodeWork(prefill=w, kv=handle, prefilled_at_s=0.0)))
    e1 = engine(bus, tiny_config, "e1", Role.DECODE)
    await asyncio.wait_for(e1.run(burst=True), timeout=30)
    assert e1.counters["reprefills"] == 1 and not await results(bus)
    requeued = await read_stream(js, streams.WORK_PREFILL, subjects.work_prefill(), type(w))
    assert [(r.trajectory_id, r.attempt, r.work_id) for r in requeued] == [("orphan", 1, "orphan/n/t0/a1")]
    resent = [e for e in await events(bus) if e.trajectory_id == "orphan"]
    assert [e.kind for e in resent] == [EventKind.REPREFILL]
    assert (resent[0].new_tokens, resent[0].context_tokens) == (w.new_tokens, w.context_tokens)  # the turn's, for the forecaster
