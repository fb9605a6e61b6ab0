"""Durability settings on the real nats-server: poison work is dead-lettered with its reason,
publish retries stop inside the duplicate window, a size-limited lifecycle log refuses new
events (never drops old ones) and the launcher's watch alerts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

import pytest
from nats.js import api
from nats.js.errors import APIError

from actors.base.clock import ScaledClock
from actors.base.publish import _RETRY_WALL_S, ACK_TIMEOUT_WALL_S, GIVE_UP_WALL_S, PublishFailed, publish_durable, pull_one
from bus_schemas import streams, subjects
from bus_schemas.codec import encode
from ops.bus_guard import REASON_HEADER, DeadLetters, LifecycleFill, read_dead_letters
from tests.test_engine_core import work

pytestmark = pytest.mark.bus
LOG = logging.getLogger("test")


async def test_work_never_acked_is_dead_lettered_with_its_reason_after_max_deliver(bus):
    js = bus.jetstream()
    dead = DeadLetters(bus, LOG)
    await dead.start()
    sub = await streams.pull_subscription(js, streams.prefill_consumer(), ack_wait_s=0.3, max_deliver=2)
    poison = encode(work("poison", new=10, out=1))
    await js.publish(subjects.work_prefill(), poison)
    deliveries = 0
    deadline = time.monotonic() + 20
    while dead.moved == 0:  # a consumer that takes the item and never acks it (it crashes on it, say)
        assert time.monotonic() < deadline, f"not dead-lettered after {deliveries} deliveries"
        if await pull_one(sub, 0.2) is not None:
            deliveries += 1
    assert deliveries == 2  # delivered max_deliver times, then no more
    assert (await js.stream_info(streams.WORK_PREFILL.name)).state.messages == 0  # out of the queue
    [letter] = await read_dead_letters(js)
    assert letter == {"subject": subjects.work_prefill(), "stream": "WORK_PREFILL", "reason": letter["reason"], "bytes": len(poison)}
    assert "2 deliveries" in letter["reason"] and "prefill" in letter["reason"]
    stored = await js.get_last_msg(streams.DEAD.name, subjects.dead_letter("WORK_PREFILL"))
    assert stored.data == poison and REASON_HEADER in stored.headers  # the poison message itself, kept
    assert not dead.fatal.is_set()  # a turn, not a whole trajectory


async def test_a_dead_lettered_task_assignment_fails_the_run(bus):
    js = bus.jetstream()
    dead = DeadLetters(bus, LOG)
    ack = await js.publish(subjects.train_tasks(), b"assignment")
    await dead.move(streams.TASKS.name, ack.seq, "test")
    assert dead.fatal.is_set() and "dead-lettered" in dead.fatal_reason
    assert (await js.stream_info(streams.TASKS.name)).state.messages == 0


async def test_publish_retries_give_up_inside_the_duplicate_window_with_a_counted_error(bus):
    assert GIVE_UP_WALL_S + _RETRY_WALL_S + ACK_TIMEOUT_WALL_S < streams.DUPLICATE_WINDOW_S  # the default does too
    counters: Counter = Counter()
    started = time.monotonic()
    with pytest.raises(PublishFailed):  # no stream takes this subject: every try fails
        await publish_durable(
            bus.jetstream(), "test.no-stream", b"x", "id-1", counters, LOG, asyncio.Event(), ScaledClock(1.0), give_up_wall_s=6.0
        )
    assert counters["publish_failures"] == 1 and counters["publish_retries"] >= 2
    assert time.monotonic() - started < 6.0  # no try started that could end past the budget


async def test_a_full_lifecycle_log_refuses_new_events_keeps_the_old_and_alerts(bus):
    js = bus.jetstream()
    alerts: list[str] = []
    fill = LifecycleFill(js, alerts.append)
    await streams.ensure_streams(js, streams.LifecycleLimits(max_msgs=10))
    try:
        assert api.DiscardPolicy((await js.stream_info(streams.LIFECYCLE.name)).config.discard) is api.DiscardPolicy.NEW
        for i in range(9):
            await js.publish(subjects.lifecycle("started"), f"event {i}".encode())
        assert await fill.check() == pytest.approx(0.9) and len(alerts) == 1 and "90% full" in alerts[0]
        await js.publish(subjects.lifecycle("started"), b"event 9")
        with pytest.raises(APIError, match="maximum messages"):
            await js.publish(subjects.lifecycle("started"), b"event 10")  # refused, not stored over the first
        assert await fill.check() == 1.0 and len(alerts) == 2 and "full: new lifecycle events are refused" in alerts[1]
        assert (await js.get_msg(streams.LIFECYCLE.name, (await js.stream_info(streams.LIFECYCLE.name)).state.first_seq)).data == b"event 0"
        await fill.check()
        assert len(alerts) == 2  # each alert once
        await streams.ensure_streams(js)  # an actor's ensure_streams keeps the launcher's limits
        assert (await js.stream_info(streams.LIFECYCLE.name)).config.max_msgs == 10
    finally:
        await streams.ensure_streams(js, streams.LifecycleLimits())  # the session server's other tests


def test_lifecycle_storage_is_configurable_and_always_discards_new():
    config = streams.LIFECYCLE.config(streams.LifecycleLimits(storage="memory", max_bytes=1 << 20))
    assert config.storage is api.StorageType.MEMORY and config.max_bytes == 1 << 20 and config.discard is api.DiscardPolicy.NEW
    assert streams.LIFECYCLE.config().storage is api.StorageType.FILE
    assert streams.WORK_PREFILL.config().discard is not api.DiscardPolicy.NEW  # work queues keep the server default


async def test_a_dead_lettered_turn_reruns_its_trajectory_from_the_start(bus, tiny_config):
    from actors.environment.actor import EnvironmentActor
    from bus_schemas.codec import decode
    from bus_schemas.train import TaskAssignment
    from bus_schemas.work import PrefillWork
    from tests.actor_helpers import build
    from tests.test_switch_protocol import until

    js = bus.jetstream()
    dead = DeadLetters(bus, LOG)
    task = TaskAssignment(
        trajectory_id="s0-k0-g0", task_id="s0-k0", task_family="math", sample_index=0, step=0, policy_version=0, seed=1, assigned_at_s=0.0
    )
    await js.publish(subjects.train_tasks(), encode(task))
    env = build(EnvironmentActor, "env0", tiny_config, bus)
    running = asyncio.create_task(env.run())
    try:
        await until(lambda: env.counters.get("lifecycle_events", 0) >= 2)  # started, prefill_queued
        first = (await js.stream_info(streams.WORK_PREFILL.name)).state
        assert first.messages == 1
        await dead.move(streams.WORK_PREFILL.name, first.last_seq, "test: poison turn")
        await until(lambda: (env.counters["trajectories_dead_lettered"], env.counters["trajectories_rerun"]) == (1, 1))
        await until(lambda: env.counters.get("lifecycle_events", 0) >= 4)  # the rerun's started, prefill_queued
        again = await js.get_msg(streams.WORK_PREFILL.name, (await js.stream_info(streams.WORK_PREFILL.name)).state.last_seq)
        poisoned = decode(PrefillWork, (await js.get_last_msg(streams.DEAD.name, subjects.dead_letter("WORK_PREFILL"))).data)
        rerun = decode(PrefillWork, again.data)
        assert rerun.trajectory_id == poisoned.trajectory_id and rerun.turn == 0 and rerun.work_id != poisoned.work_id
        assert env.counters["finished"] == 0  # nothing reported complete
    finally:
        env.request_stop("test over")
        await asyncio.wait_for(running, timeout=20)


@pytest.mark.parametrize("first_logged", [True, False])
async def test_a_rerun_of_a_trajectory_already_reported_is_reported_and_logged_once(bus, tiny_config, first_logged: bool):
    """The environment died, or its ack of a finished task was lost, after it reported the
    trajectory: the task is redelivered and rerun, and the stream says its FinishedTrajectory
    is a duplicate. The log holds one `finished` for it, whether or not the first run's was
    stored before it died: the rerun's has the same id."""
    from actors.engine.actor import EngineActor
    from actors.environment.actor import EnvironmentActor
    from bus_schemas.control import Role
    from bus_schemas.lifecycle import EventKind, LifecycleEvent
    from bus_schemas.train import TaskAssignment
    from ops.export import read_stream
    from tests.actor_helpers import build, clock_for
    from tests.test_switch_protocol import until

    js = bus.jetstream()
    clock = clock_for(tiny_config)
    env = build(EnvironmentActor, "env0", tiny_config, bus, clock=clock)
    engine = build(EngineActor, "e0", tiny_config, bus, Role.COLOCATED, clock=clock)
    await js.publish(subjects.train_finished(), b"reported before", headers={"Nats-Msg-Id": f"{env.run_tag}/s0-k0-g0"})
    if first_logged:
        first = LifecycleEvent(
            event_id=f"{env.run_tag}/s0-k0-g0/finished", kind=EventKind.FINISHED, at_s=1.0, actor_id="env0", trajectory_id="s0-k0-g0"
        )
        await js.publish(subjects.lifecycle("finished"), encode(first), headers={"Nats-Msg-Id": first.event_id})
    task = TaskAssignment(
        trajectory_id="s0-k0-g0", task_id="s0-k0", task_family="math", sample_index=0, step=0, policy_version=0, seed=1, assigned_at_s=0.0
    )
    await js.publish(subjects.train_tasks(), encode(task))
    running = [asyncio.create_task(a.run()) for a in (engine, env)]
    try:
        await until(lambda: env.counters["finished_again"] == 1, timeout_wall_s=60)
        await env.lifecycle.flush()
        assert (await js.stream_info(streams.TRAIN.name)).state.messages == 1  # stored once
        assert env.counters["finished"] == 1 and not env.live  # the task is done (acked)
        events = await read_stream(js, streams.LIFECYCLE, subjects.lifecycle_all(), LifecycleEvent)
        finished = [e for e in events if e.kind == EventKind.FINISHED]
        assert [(e.trajectory_id, e.actor_id) for e in finished] == [("s0-k0-g0", "env0")]
        assert (finished[0].at_s == 1.0) == first_logged  # the first run's, where it was stored
    finally:
        for a in (env, engine):
            a.request_stop("test over")
        await asyncio.wait_for(asyncio.gather(*running), timeout=30)
