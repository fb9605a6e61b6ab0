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

from actors.base.clock import Clock
from actors.base.connection import BUS_ERRORS

from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.lifecycle import LifecycleEvent

_MAX_IN_FLIGHT = 512
_RETRY_WALL_S = 0.2
_ACK_TIMEOUT_WALL_S = 5.0


class LifecyclePublisher:
    def __init__(self, js: JetStreamContext, counters: Counter, log: logging.Logger, clock: Clock) -> None:
        self._js = js
        self._clock = clock
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
            data, subject = encode(event), subjects.lifecycle(event.kind.value)
            future = await self._publish_once(event, subject, data)
            if isinstance(future, asyncio.Future) and future.done() and not future.cancelled() and future.exception() is None:
                self._acked()  # (the in-process bus acks at once: no task per event)
                continue
            task = asyncio.create_task(self._publish(event, subject, data, future))
            in_flight.add(task)
            task.add_done_callback(in_flight.discard)

    async def _publish_once(self, event: LifecycleEvent, subject: str, data: bytes) -> asyncio.Future | Exception:
        """Send once: the ack's future, or why it could not be sent."""
        try:
            return await self._js.publish_async(subject, data, headers={"Nats-Msg-Id": event.event_id})
        except BUS_ERRORS as err:
            return err

    async def _publish(self, event: LifecycleEvent, subject: str, data: bytes, future: asyncio.Future | Exception) -> None:
        """Wait for the ack of an attempt (`future`, or the error that stopped it being sent),
        retrying with the same id until one is acked."""
        attempt = 0
        while True:
            try:
                if isinstance(future, Exception):
                    raise future
                if not future.done():
                    await asyncio.wait_for(future, timeout=self._clock.loop_s(_ACK_TIMEOUT_WALL_S))
                future.result()
                break
            except BUS_ERRORS as err:  # any bus failure: count, log, retry with the same id
                attempt += 1
                self._counters["lifecycle_publish_retries"] += 1
                if attempt in (1, 10, 100):
                    self._log.warning("lifecycle publish of %s failed (attempt %d): %s", event.kind.value, attempt, err)
                await self._clock.sleep_wall(_RETRY_WALL_S)
                future = await self._publish_once(event, subject, data)
        self._acked()

    def _acked(self) -> None:
        self._unacked -= 1
        if self._unacked == 0:
            self._idle.set()
