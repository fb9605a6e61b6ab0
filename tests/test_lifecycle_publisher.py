"""The lifecycle publisher never blocks the actor and never loses an event: a publish the bus
refuses is counted and retried with the same id until it is stored, once; retries stop
inside the duplicate window with a counted error; at most `window` events are in flight;
a nats-server killed mid-burst and restarted on its store loses and duplicates nothing."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path

import pytest

from actors.base.clock import ScaledClock
from actors.base.connection import close, connect
from actors.base.inproc import InProcServer
from actors.base.lifecycle import _YIELD_EVERY, LifecyclePublisher, read_ack
from actors.base.publish import ACK_TIMEOUT_WALL_S, GIVE_UP_WALL_S, PublishFailed
from actors.base.virtual import LoopClock, VirtualTimeLoop
from bus_schemas import streams, subjects
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from ops.export import read_stream
from ops.natsserver import EmbeddedNats
from tests.test_switch_protocol import until

LOG = logging.getLogger("test")


def event(event_id: str) -> LifecycleEvent:
    return LifecycleEvent(event_id=event_id, kind=EventKind.PREFILL_QUEUED, at_s=0.0, actor_id="t")


async def stored_ids(js) -> Counter:
    return Counter(e.event_id for e in await read_stream(js, streams.LIFECYCLE, subjects.lifecycle_all(), LifecycleEvent))


async def publish_before_and_after_the_stream_exists() -> tuple[Counter, int]:
    js = InProcServer().connect("t").jetstream()
    counters: Counter = Counter()
    publisher = LifecyclePublisher(js, counters, LOG, LoopClock())
    publisher.start()
    publisher.emit(event("early"))  # no LIFECYCLE stream yet: the bus has no responders
    for _ in range(10_000):  # virtual time: the retry waits cost nothing
        if counters["lifecycle_publish_retries"] >= 3:
            break
        await asyncio.sleep(0.05)  # barrier-ok: virtual time, polls a counter
    else:
        raise AssertionError(f"only {counters['lifecycle_publish_retries']} retries in 500 virtual s")
    assert publisher.owed == 1  # still owed
    await streams.ensure_streams(js)
    await asyncio.wait_for(publisher.flush(), timeout=10.0)
    retries = counters["lifecycle_publish_retries"]
    publisher.emit(event("late"))  # the stream exists: stored at the first attempt
    await asyncio.wait_for(publisher.flush(), timeout=10.0)
    assert counters["lifecycle_publish_retries"] == retries
    await publisher.close()
    return counters, (await js.stream_info(streams.LIFECYCLE.name)).state.messages


def test_a_refused_lifecycle_publish_is_retried_until_stored_once():
    loop = VirtualTimeLoop()
    try:
        counters, stored = loop.run_until_complete(publish_before_and_after_the_stream_exists())
    finally:
        loop.close()
    assert stored == 2
    assert counters["lifecycle_events"] == 2
    assert counters["lifecycle_publish_retries"] >= 3
    assert counters["lifecycle_publish_failures"] == 0


async def a_burst_in_process() -> tuple[list[str], int]:
    js = InProcServer().connect("t").jetstream()
    await streams.ensure_streams(js)
    publisher = LifecyclePublisher(js, Counter(), LOG, LoopClock())
    publisher.start()
    ids = [f"e{i}" for i in range(2 * _YIELD_EVERY + 5)]  # more than one batch between yields
    for event_id in ids:
        publisher.emit(event(event_id))
    await asyncio.wait_for(publisher.flush(), timeout=10.0)
    stored = await read_stream(js, streams.LIFECYCLE, subjects.lifecycle_all(), LifecycleEvent)
    in_flight = publisher.peak_in_flight
    await publisher.close()
    assert publisher.owed == 0
    return [e.event_id for e in stored], in_flight


def test_a_burst_on_the_in_process_bus_is_stored_once_in_the_order_emitted():
    """Stored by callbacks, `_YIELD_EVERY` at a time, with nothing left in flight between."""
    loop = VirtualTimeLoop()
    try:
        stored, peak = loop.run_until_complete(a_burst_in_process())
    finally:
        loop.close()
    assert stored == [f"e{i}" for i in range(2 * _YIELD_EVERY + 5)]
    assert peak == 1  # each stored and acked on the spot


async def never_stored() -> tuple[Counter, float, LifecyclePublisher]:
    js = InProcServer().connect("t").jetstream()  # no LIFECYCLE stream, ever
    counters: Counter = Counter()
    publisher = LifecyclePublisher(js, counters, LOG, LoopClock())
    publisher.start()
    started_s = asyncio.get_running_loop().time()
    publisher.emit(event("doomed"))
    with pytest.raises(PublishFailed, match="1 lifecycle events"):
        await publisher.flush()
    elapsed_s = asyncio.get_running_loop().time() - started_s
    await publisher.flush()  # reported once
    await publisher.close()
    return counters, elapsed_s, publisher


def test_lifecycle_retries_stop_inside_the_duplicate_window_with_a_counted_error():
    loop = VirtualTimeLoop()
    try:
        counters, elapsed_s, publisher = loop.run_until_complete(never_stored())
    finally:
        loop.close()
    assert counters["lifecycle_publish_failures"] == 1 and publisher.owed == 0
    # tried until no further try could end inside the window, and no longer
    assert GIVE_UP_WALL_S - ACK_TIMEOUT_WALL_S <= elapsed_s < GIVE_UP_WALL_S < streams.DUPLICATE_WINDOW_S
    assert counters["lifecycle_publish_retries"] >= (GIVE_UP_WALL_S - ACK_TIMEOUT_WALL_S) / 0.25


def test_stream_answers_are_read_as_stored_duplicate_or_failed():
    assert read_ack(b'{"stream":"LIFECYCLE","seq":7}', None) == (None, False)
    assert read_ack(b'{"stream":"LIFECYCLE","seq":7,"duplicate":true}', None) == (None, True)
    why, _ = read_ack(b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"}}', None)
    assert "maximum messages exceeded" in why
    why, _ = read_ack(b"", {"Status": "503"})  # no stream takes the subject
    assert "status 503" in why
    assert read_ack(b'{"seq":1}', None)[0] is not None


@pytest.mark.bus
async def test_the_window_bounds_the_events_in_flight_and_every_event_is_stored_once(bus):
    js = bus.jetstream()
    counters: Counter = Counter()
    publisher = LifecyclePublisher(js, counters, LOG, ScaledClock(1.0), window=8)
    publisher.start()
    for i in range(2000):
        publisher.emit(event(f"w{i}"))
        assert publisher.in_flight <= 8
        if i % 100 == 0:
            await asyncio.sleep(0)  # barrier-ok: yields to the sender, as an actor's loop would between emits
    await asyncio.wait_for(publisher.flush(), timeout=60)
    await publisher.close()
    assert publisher.peak_in_flight == 8  # the window filled, and never overflowed
    assert await stored_ids(js) == Counter(f"w{i}" for i in range(2000))
    assert counters["lifecycle_publish_retries"] == 0


@pytest.mark.bus
async def test_retries_on_nats_server_give_up_inside_the_window_with_a_counted_error(tmp_path: Path):
    with EmbeddedNats(tmp_path / "nats") as server:  # no streams: every try is answered "no responders"
        nc = await connect(server.url, "test", LOG)
        try:
            counters: Counter = Counter()
            publisher = LifecyclePublisher(nc.jetstream(), counters, LOG, ScaledClock(1.0), give_up_wall_s=ACK_TIMEOUT_WALL_S + 1.0)
            publisher.start()
            publisher.emit(event("doomed"))
            with pytest.raises(PublishFailed):
                await asyncio.wait_for(publisher.flush(), timeout=30)
            await publisher.close()
        finally:
            await close(nc)
    assert counters["lifecycle_publish_failures"] == 1 and counters["lifecycle_publish_retries"] >= 2


@pytest.mark.bus
async def test_a_nats_server_killed_mid_burst_loses_and_duplicates_no_lifecycle_event(tmp_path: Path):
    """`kill -9` of the server (sync_interval always) with events in flight, more emitted
    while it is down, then a restart on the same store: every event stored exactly once."""
    server = EmbeddedNats(tmp_path / "nats")
    server.start()
    nc = await connect(server.url, "test", LOG)
    try:
        js = nc.jetstream()
        await streams.ensure_streams(js)
        counters: Counter = Counter()
        publisher = LifecyclePublisher(js, counters, LOG, ScaledClock(1.0))
        publisher.start()
        for i in range(20_000):
            publisher.emit(event(f"b{i}"))
        await until(lambda: publisher.owed <= 18_000, timeout_wall_s=60)  # acks are coming in
        server.proc.kill()  # a crash: mid-burst
        server.proc.wait(timeout=10)
        assert publisher.owed > 0 and publisher.in_flight > 0
        await until(lambda: not nc.is_connected)
        for i in range(20_000, 21_000):
            publisher.emit(event(f"b{i}"))  # emitted while the server is down: queued, not lost
        server.start()  # the same store and port
        await asyncio.wait_for(publisher.flush(), timeout=120)
        await publisher.close()
        assert await stored_ids(js) == Counter(f"b{i}" for i in range(21_000))  # none missing, none twice
        assert counters["lifecycle_publish_retries"] > 0 and counters["lifecycle_publish_failures"] == 0
    finally:
        await close(nc)
        server.stop()


@pytest.mark.bus
async def test_settled_waits_for_the_events_emitted_before_it_and_not_for_later_ones(tmp_path: Path):
    """An actor reports work done only once its log is stored: `settled` returns when every
    event emitted before the call is stored, not before (here the stream appears late), and
    events emitted while it waits do not hold it (a window of 8 keeps most of them queued)."""
    with EmbeddedNats(tmp_path / "nats") as server:  # no streams yet: every try is retried
        nc = await connect(server.url, "test", LOG)
        try:
            js = nc.jetstream()
            counters: Counter = Counter()
            publisher = LifecyclePublisher(js, counters, LOG, ScaledClock(1.0), window=8)
            publisher.start()
            for i in range(20):
                publisher.emit(event(f"before{i}"))
            settled = asyncio.create_task(publisher.settled())
            owed_then: list[int] = []
            settled.add_done_callback(lambda _: owed_then.append(publisher.owed))
            await until(lambda: publisher.in_flight > 0)
            for i in range(2000):
                publisher.emit(event(f"after{i}"))
            await until(lambda: counters["lifecycle_publish_retries"] >= 16)  # every one of the window's tries refused, twice
            assert not settled.done()  # nothing is stored yet
            await streams.ensure_streams(js)
            await asyncio.wait_for(settled, timeout=30)
            assert 1000 < owed_then[0] <= 2000  # the 20 before it were stored; it did not wait for the later ones
            await asyncio.wait_for(publisher.flush(), timeout=60)
            stored = await stored_ids(js)
            assert stored == Counter([f"before{i}" for i in range(20)] + [f"after{i}" for i in range(2000)])
            await publisher.close()
        finally:
            await close(nc)
