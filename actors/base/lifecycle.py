"""Publishing lifecycle events to the durable LIFECYCLE stream without stalling the actor.

``emit`` never blocks: events go to a queue that one task publishes with ``publish_async``
(many in flight), each with ``Nats-Msg-Id = event_id`` so a retried publish is stored once.
A publish that fails is retried with the same id; ``flush`` waits until every event is acked.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from nats.js.client import JetStreamContext

from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.lifecycle import LifecycleEvent

_MAX_IN_FLIGHT = 512
_RETRY_WALL_S = 0.2
_ACK_TIMEOUT_WALL_S = 5.0


class LifecyclePublisher:
    def __init__(self, js: JetStreamContext, counters: Counter, log: logging.Logger) -> None:
        self._js = js
        self._counters = counters
        self._log = log
        self._queue: asyncio.Queue[LifecycleEvent] = asyncio.Queue()
        self._unacked = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="lifecycle-publisher")

    def emit(self, event: LifecycleEvent) -> None:
        self._idle.clear()
        self._unacked += 1
        self._queue.put_nowait(event)
        self._counters["lifecycle_events"] += 1

    async def flush(self) -> None:
        """Return once every emitted event is stored in the stream."""
        await self._idle.wait()

    async def close(self) -> None:
        await self.flush()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        in_flight: set[asyncio.Task] = set()
        while True:
            event = await self._queue.get()
            while len(in_flight) >= _MAX_IN_FLIGHT:
                _, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
            task = asyncio.create_task(self._publish(event))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)

    async def _publish(self, event: LifecycleEvent) -> None:
        data = encode(event)
        subject = subjects.lifecycle(event.kind.value)
        attempt = 0
        while True:
            try:
                future = await self._js.publish_async(subject, data, headers={"Nats-Msg-Id": event.event_id})
                if not future.done():  # (the in-process bus acks at once)
                    await asyncio.wait_for(future, timeout=_ACK_TIMEOUT_WALL_S)
                future.result()
                break
            except asyncio.CancelledError:
                raise
            except Exception as err:  # any bus failure: count, log, retry with the same id
                attempt += 1
                self._counters["lifecycle_publish_retries"] += 1
                if attempt in (1, 10, 100):
                    self._log.warning("lifecycle publish of %s failed (attempt %d): %s", event.kind.value, attempt, err)
                await asyncio.sleep(_RETRY_WALL_S)
        self._unacked -= 1
        if self._unacked == 0:
            self._idle.set()
