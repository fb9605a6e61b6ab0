"""The lifecycle publisher never blocks the actor and never loses an event: a publish the bus
refuses is counted and retried with the same id until it is stored, once."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from actors.base.inproc import InProcServer
from actors.base.lifecycle import LifecyclePublisher
from actors.base.virtual import LoopClock, VirtualTimeLoop
from bus_schemas import streams
from bus_schemas.lifecycle import EventKind, LifecycleEvent


def event(event_id: str) -> LifecycleEvent:
    return LifecycleEvent(event_id=event_id, kind=EventKind.PREFILL_QUEUED, at_s=0.0, actor_id="t")


async def publish_before_and_after_the_stream_exists() -> tuple[Counter, int]:
    js = InProcServer().connect("t").jetstream()
    counters: Counter = Counter()
    publisher = LifecyclePublisher(js, counters, logging.getLogger("test"), LoopClock())
    publisher.start()
    publisher.emit(event("early"))  # no LIFECYCLE stream yet: the bus has no responders
    for _ in range(10_000):  # virtual time: the retry waits cost nothing
        if counters["lifecycle_publish_retries"] >= 3:
            break
        await asyncio.sleep(0.05)  # barrier-ok: virtual time, polls a counter
    else:
        raise AssertionError(f"only {counters['lifecycle_publish_retries']} retries in 500 virtual s")
    assert not publisher._idle.is_set()  # still owed
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
