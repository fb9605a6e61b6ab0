"""JetStream semantics the design relies on, on the real nats-server."""

from __future__ import annotations

import nats
import pytest
from nats.js import api
from nats.js.errors import BadRequestError

from bus_schemas import streams, subjects
from bus_schemas.codec import decode, encode
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.work import PrefillWork
from ops.export import read_stream
from ops.natsserver import EmbeddedNats
from tests.test_engine_core import work

pytestmark = pytest.mark.bus


async def test_unacked_work_is_redelivered_after_ack_wait(bus):
    js = bus.jetstream()
    await js.publish(subjects.work_prefill(), encode(work("a")), headers={"Nats-Msg-Id": "a"})
    sub = await streams.pull_subscription(js, streams.prefill_consumer(), ack_wait_s=0.5)
    first = await sub.fetch(1, timeout=2)
    assert first[0].metadata.num_delivered == 1  # fetched, never acked: the engine "died"
    again = await sub.fetch(1, timeout=5)  # the server redelivers once ack_wait passes
    assert decode(PrefillWork, again[0].data) == work("a")
    assert again[0].metadata.num_delivered == 2
    await again[0].ack_sync()
    info = await js.stream_info(streams.WORK_PREFILL.name)
    assert info.state.messages == 0  # acked work leaves the work queue


async def test_work_goes_to_one_consumer_only(bus):
    js = bus.jetstream()
    for name in "abcd":
        await js.publish(subjects.work_prefill(), encode(work(name)))
    sub1 = await streams.pull_subscription(js, streams.prefill_consumer(), ack_wait_s=30)
    sub2 = await streams.pull_subscription(js, streams.prefill_consumer(), ack_wait_s=30)
    got1 = await sub1.fetch(2, timeout=2)
    got2 = await sub2.fetch(2, timeout=2)
    ids = [decode(PrefillWork, m.data).trajectory_id for m in got1 + got2]
    assert sorted(ids) == list("abcd")  # shared durable consumer: each item to exactly one puller


async def test_a_publish_no_stream_answers_is_asked_again_and_a_bad_request_is_not(bus):
    """What a launcher meets on a new replicated bucket whose leader is not elected yet: the
    server has no stream to answer the publish. `streams.answered` asks again."""
    js = bus.jetstream()
    attempts = []

    async def publish():
        attempts.append(len(attempts))
        if len(attempts) == 2:  # the stream appears between the first try and the second
            await js.add_stream(api.StreamConfig(name="LATE", subjects=["late.>"]))
        return await js.publish("late.x", b"1")

    ack = await streams.answered(publish)
    assert len(attempts) == 2 and ack.stream == "LATE" and ack.seq == 1
    attempts.clear()

    async def bad_request():  # the server refuses: another stream holds these subjects
        attempts.append(len(attempts))
        return await js.add_stream(api.StreamConfig(name="OVERLAP", subjects=["late.>"]))

    with pytest.raises(BadRequestError):
        await streams.answered(bad_request)
    assert len(attempts) == 1
    await js.delete_stream("LATE")


async def test_retried_publish_with_the_same_id_is_stored_once(bus):
    js = bus.jetstream()
    event = LifecycleEvent(event_id="once", kind=EventKind.TOOL_DONE, at_s=1.0, actor_id="t")
    first = await js.publish(subjects.lifecycle("tool_done"), encode(event), headers={"Nats-Msg-Id": event.event_id})
    retry = await js.publish(subjects.lifecycle("tool_done"), encode(event), headers={"Nats-Msg-Id": event.event_id})
    assert not first.duplicate and retry.duplicate
    assert (await js.stream_info(streams.LIFECYCLE.name)).state.messages == 1


async def test_lifecycle_events_survive_a_server_crash_and_restart(tmp_path):
    """The lifecycle log is durable: events acked before the server is killed (SIGKILL, no
    shutdown) are all there, unchanged, after it restarts on the same store."""
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    try:
        nc = await nats.connect(server.url)
        js = nc.jetstream()
        await streams.ensure_streams(js)
        info = await js.stream_info(streams.LIFECYCLE.name)
        assert info.config.storage == api.StorageType.FILE and info.config.retention == api.RetentionPolicy.LIMITS
        sent = [LifecycleEvent(event_id=f"ev{i}", kind=EventKind.TOOL_DONE, at_s=float(i), actor_id="t") for i in range(5)]
        for event in sent:
            await js.publish(subjects.lifecycle(event.kind.value), encode(event), headers={"Nats-Msg-Id": event.event_id})
        await nc.close()
        server.proc.kill()  # a crash: nothing flushed on the way out
        server.proc.wait(timeout=10)
        server.start()  # the same store directory and port
        nc = await nats.connect(server.url)
        kept = await read_stream(nc.jetstream(), streams.LIFECYCLE, subjects.lifecycle_all(), LifecycleEvent)
        await nc.close()
    finally:
        server.stop()
    assert kept == sent
