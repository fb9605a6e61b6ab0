"""The role switch protocol on the real bus: drain, the hand-off at the deadline, a crash
mid-switch, and an allocator restarted over a fleet it did not configure."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from actors.allocator.actor import AllocatorActor
from actors.base.connection import close, connect
from actors.config import with_policy
from actors.engine.actor import EngineActor
from actors.engine.emulated.costmodel import PRESETS
from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.control import Drain, Role, SetRole
from bus_schemas.lifecycle import EventKind
from tests.actor_helpers import at_scale, build
from tests.test_engine_actor import command, events, results
from tests.test_engine_core import work

pytestmark = pytest.mark.bus
SCALE = 100.0  # model seconds per wall second


async def until(predicate, timeout_wall_s: float = 20.0) -> None:
    """Wait for a state the engines reach on their own (a barrier on observed state)."""
    deadline = time.monotonic() + timeout_wall_s
    while not predicate():
        assert time.monotonic() < deadline, "state not reached in time"
        await asyncio.sleep(0.01)  # barrier-ok: polls engine state, no timing assumption


def start(nc, config, engine_id: str, role: Role) -> tuple[EngineActor, asyncio.Task]:
    actor = build(EngineActor, engine_id, at_scale(config, SCALE), nc, role)
    return actor, asyncio.create_task(actor.run())


async def stop(*pairs) -> None:
    for actor, _task in pairs:
        actor.request_stop("test over")
    await asyncio.wait_for(asyncio.gather(*(t for _, t in pairs)), timeout=20)


async def test_decodes_left_at_the_drain_deadline_migrate_with_their_kv(bus, tiny_config):
    js = bus.jetstream()
    for i in range(3):
        await js.publish(subjects.work_prefill(), encode(work(f"long{i}", new=500, out=20_000)))
    e0 = start(bus, tiny_config, "e0", Role.COLOCATED)
    await until(lambda: len(e0[0].core.running) == 3)  # all three are decoding on e0
    e1 = start(bus, tiny_config, "e1", Role.DECODE)
    await asyncio.wait_for(e1[0].ready.wait(), timeout=10)
    try:
        ack = await command(bus, "e0", SetRole(role=Role.PREFILL, epoch=1, drain_deadline_s=1.0))
        assert ack.ok and ack.role is Role.PREFILL and ack.epoch == 1
        assert (
            1.0 <= ack.drain_s < 100.0
        )  # it waited for the deadline, then handed off (20k tokens take far longer; 100 model s is 1 s of wall time)
        assert e0[0].counters["decodes_migrated"] == 3
        await until(
            lambda: (
                e1[0].counters.get("lifecycle_events", 0) > 0
                and not e1[0].core.running
                and e1[0]._pending_transfers == 0
                and not e0[0].core.held
            ),
            30,
        )
    finally:
        await stop(e0, e1)
    got = await results(bus)
    assert sorted((r.trajectory_id, r.output_tokens, r.prefill_engine_id, r.decode_engine_id) for r in got) == [
        (f"long{i}", 20_000, "e0", "e1") for i in range(3)
    ]  # every token of the turn, finished on e1 from the KV e0 held
    log = await events(bus)
    migrated = [e for e in log if e.kind is EventKind.DECODE_MIGRATED]
    assert sorted(e.trajectory_id for e in migrated) == ["long0", "long1", "long2"] and all(
        e.engine_id == "e1" and e.detail == "e0" for e in migrated
    )
    per_token = PRESETS[tiny_config.engines.preset].kv_bytes_per_token  # the config's model, not another's
    for e in migrated:  # the KV moved is the 500-token prompt *and* the tokens generated before the deadline
        assert e.kv_bytes % per_token == 0 and e.kv_bytes // per_token > 500, (e.kv_bytes, per_token)
    assert [e.role for e in log if e.kind is EventKind.ROLE_SWITCHED] == ["prefill"]
    started = [e for e in log if e.kind is EventKind.DECODE_STARTED]
    assert len(started) == 3  # a migrated decode does not start twice


async def test_a_repeated_command_during_a_switch_waits_for_it_and_a_newer_one_follows(bus, tiny_config):
    await bus.jetstream().publish(subjects.work_prefill(), encode(work("busy", new=500, out=20_000)))
    e0 = start(bus, tiny_config, "e0", Role.COLOCATED)
    await until(lambda: len(e0[0].core.running) == 1)
    try:  # to prefill, the decode must leave first: a switch that takes a while
        first = asyncio.create_task(command(bus, "e0", SetRole(role=Role.PREFILL, epoch=4, drain_deadline_s=300), timeout=10))
        await until(lambda: e0[0].switching)
        again = await command(bus, "e0", SetRole(role=Role.PREFILL, epoch=4), timeout=10)  # a retry while draining
        assert again.ok and again.role is Role.PREFILL and not e0[0].switching
        assert (await first).ok and (await first).drain_s > 100  # it waited for the 20k-token decode to end
        newer = await command(bus, "e0", SetRole(role=Role.DECODE, epoch=5, drain_deadline_s=300))
        assert newer.ok and newer.role is Role.DECODE and newer.epoch == 5 and newer.drain_s < 0.1  # nothing had to leave
        refused = await command(bus, "e0", SetRole(role=Role.PREFILL, epoch=4))
        assert not refused.ok and refused.epoch == 5
    finally:
        await stop(e0)


async def test_an_engine_killed_mid_switch_loses_no_work(bus, nats_server, tiny_config):
    """e0 dies (its connection cut, no teardown) while draining for a switch: JetStream
    redelivers its un-acked turns and e1 finishes every one of them."""
    config = with_policy(tiny_config, "colocated")
    js = bus.jetstream()
    for i in range(4):
        await js.publish(subjects.work_prefill(), encode(work(f"k{i}", new=300, out=30_000)))
    nc0 = await connect(nats_server.url, "e0", logging.getLogger("test.e0"))
    e0 = start(nc0, config, "e0", Role.COLOCATED)
    await until(lambda: len(e0[0].core.running) == 4)
    switching = asyncio.create_task(command(bus, "e0", SetRole(role=Role.PREFILL, epoch=1, drain_deadline_s=10_000)))
    await until(lambda: e0[0].switching)
    e0[1].cancel()  # the process is gone: nothing acked, nothing handed back
    await close(nc0)
    with pytest.raises((asyncio.CancelledError, TimeoutError, Exception)):
        await switching  # the switch never acks
    e1 = start(bus, config, "e1", Role.COLOCATED)
    try:
        await until(lambda: e1[0].counters.get("lifecycle_events", 0) >= 4 * 4 and not e1[0].core.running, 60)
    finally:
        await stop(e1)
    assert sorted(r.trajectory_id for r in await results(bus)) == ["k0", "k1", "k2", "k3"]
    assert {r.decode_engine_id for r in await results(bus)} == {"e1"}


async def test_a_restarted_allocator_continues_above_the_fleet_epoch(bus, tiny_config):
    config = with_policy(tiny_config, "static")  # e0 prefill, e1 decode
    e0 = start(bus, config, "e0", Role.PREFILL)
    e1 = start(bus, config, "e1", Role.PREFILL)  # drifted: the static split wants it decoding
    await asyncio.wait_for(asyncio.gather(e0[0].ready.wait(), e1[0].ready.wait()), timeout=10)
    assert (await command(bus, "e0", SetRole(role=Role.PREFILL, epoch=7))).epoch == 7  # an earlier allocator's epoch
    allocator = build(AllocatorActor, "allocator", at_scale(config, SCALE), bus)
    task = asyncio.create_task(allocator.run())
    try:
        await until(lambda: allocator.counters["switches"] == 1)
        assert allocator.epoch == 8 and e1[0].epoch == 8 and e1[0].core.role is Role.DECODE
        assert e0[0].core.role is Role.PREFILL and e0[0].epoch == 7  # left alone
    finally:
        allocator.request_stop("test over")
        await asyncio.wait_for(task, timeout=10)
        await stop(e0, e1)


async def test_an_engine_that_does_not_ack_is_left_out_until_it_answers(bus, nats_server, tiny_config):
    config = with_policy(tiny_config, "static")  # e0 prefill, e1 decode
    e0 = start(bus, config, "e0", Role.PREFILL)
    nc1 = await connect(nats_server.url, "e1", logging.getLogger("test.e1"))
    e1 = start(nc1, config, "e1", Role.PREFILL)  # drifted from the split
    allocator = build(AllocatorActor, "allocator", at_scale(config, SCALE), bus)
    await allocator.setup()
    await until(lambda: {"e0", "e1"} <= set(allocator.statuses))
    await stop(e1)
    await close(nc1)  # e1 is gone: its heartbeat is stale, nothing answers its commands
    [change] = await allocator.decide_once()
    assert (change.engine_id, change.role) == ("e1", Role.DECODE)
    await until(lambda: allocator.counters["unacked_commands"] == 1)
    assert [s.responsive for s in allocator.fleet().engines] == [True, False]
    assert await allocator.decide_once() == []  # left out of the next decision
    e1 = start(bus, config, "e1", Role.PREFILL)  # restarted: its first heartbeat readmits it
    await until(lambda: "e1" not in allocator.unresponsive)
    [change] = await allocator.decide_once()
    await until(lambda: allocator.counters["switches"] == 1)
    assert e1[0].core.role is Role.DECODE and e1[0].epoch == allocator.epoch == 2
    await stop(e0, e1)


async def test_a_set_role_to_the_same_role_ends_a_drain(bus, tiny_config):
    e0 = start(bus, tiny_config, "e0", Role.COLOCATED)
    await asyncio.wait_for(e0[0].ready.wait(), timeout=10)
    try:
        drained = await command(bus, "e0", Drain(reason="test"))
        assert drained.ok and not e0[0]._pulling
        await bus.jetstream().publish(subjects.work_prefill(), encode(work("after-drain", new=100, out=5)))
        ack = await command(bus, "e0", SetRole(role=Role.COLOCATED, epoch=1))
        assert ack.ok and ack.epoch == 1 and ack.role is Role.COLOCATED
        await until(lambda: e0[0].counters.get("lifecycle_events", 0) > 0 and e0[0].core.idle and not e0[0]._msgs)
    finally:
        await stop(e0)
    got = await results(bus)
    assert [(r.trajectory_id, r.output_tokens) for r in got] == [("after-drain", 5)]  # served once the drain ended
