"""Publishing lifecycle events to the durable LIFECYCLE stream without stalling the actor.

    emit(event) ─► queue ─► sender task ─► PUB prorsa.lc.<kind>  Nats-Msg-Id = event_id
    (never blocks)          (at most `window`     reply <own inbox>.<n>
                             events in flight) ◄─ the stream's ack on <inbox>.<n>, one subscription

1. ``emit`` appends to a queue and returns; every event is counted (`lifecycle_events`).
2. One sender task takes events while fewer than ``window`` are in flight (sent, not yet
   acked) and publishes each once, with ``Nats-Msg-Id = event_id`` so the stream stores it
   once however often it is sent. On nats-server these are core publishes whose reply subject
   names the event; the stream's acks come back on one wildcard subscription of the actor's
   inbox: no future, task or timer per event (nats-py's ``publish_async`` spends about half
   the time of a publish on those). The in-process bus answers ``js.publish`` at once.
3. A try refused by the stream, or not acked within ``ACK_TIMEOUT_WALL_S``, is sent again
   with the same bytes and id after ``_RETRY_WALL_S`` (`lifecycle_publish_retries`; an ack
   saying `duplicate` counts `lifecycle_publish_duplicates`). Nothing is sent while the
   connection is down (nats-py would buffer it and send it at some later reconnect).
4. No try starts later than ``give_up_wall_s - ACK_TIMEOUT_WALL_S`` after an event's first
   one, so every try ends inside the stream's duplicate window: past that an event is given
   up, counted (`lifecycle_publish_failures`) and logged; ``flush`` then raises PublishFailed.
5. ``flush`` returns once every emitted event is acked; ``close`` flushes (counting, not
   raising) and stops the sender. ``settled`` returns once every event emitted before the
   call is acked or given up, whatever is emitted meanwhile: an actor reports a piece of
   work done only after its log is stored (a kill -9 between the two would otherwise lose
   events of work the rest of the system counts as done).

Owed events are checked every ``_TICK_WALL_S`` (a loop timer, armed only while any is owed)
for a lost ack or a retry that is due.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.js.client import JetStreamContext

from actors.base.clock import Clock
from actors.base.connection import BUS_ERRORS
from actors.base.publish import ACK_TIMEOUT_WALL_S, GIVE_UP_WALL_S, PublishFailed
from actors.base.tasks import CANCEL_WAIT_S, cancel_and_wait
from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.lifecycle import EventKind, LifecycleEvent

WINDOW = 1024  # events in flight (sent, not yet acked or given up), at most
_RETRY_WALL_S = 0.2  # from a failed try to the next
_TICK_WALL_S = 0.1  # how often owed events are checked for a lost ack or a retry due
_YIELD_EVERY = 128  # sends between yields to the actor's other tasks

OnReply = Callable[[int, "str | None", bool], None]  # (token, why it failed or None, duplicate)


class _Owed:
    """One event sent at least once and not yet acked or given up."""

    __slots__ = ("token", "event_id", "subject", "data", "first_s", "at_s")

    def __init__(self, token: int, event_id: str, subject: str, data: bytes, first_s: float) -> None:
        self.token = token  # names the event's reply subject
        self.event_id = event_id
        self.subject = subject
        self.data = data
        self.first_s = first_s  # model s: its first try (the duplicate window counts from there)
        self.at_s = first_s  # model s: when its try was sent (awaiting), or when the next is due (retrying)


class _ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubAck(msgspec.Struct):
    """The stream's answer to a publish (JSON): an ack, or an error."""

    stream: str = ""
    seq: int = 0
    duplicate: bool = False  # already stored under this Nats-Msg-Id
    error: _ApiError | None = None


_PUB_ACK = msgspec.json.Decoder(_PubAck)


def read_ack(data: bytes, headers: dict | None) -> tuple[str | None, bool]:
    """(why the publish failed, or None if stored; whether the stream had it already)."""
    try:
        ack = _PUB_ACK.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):  # e.g. 503 no responders: no stream yet
        return f"no stream ack (status {(headers or {}).get('Status', 'none')}, {len(data)} bytes)", False
    if ack.error is not None:
        return f"stream error {ack.error.code}/{ack.error.err_code}: {ack.error.description}", False
    if not ack.stream:
        return f"not a stream ack: {data[:80]!r}", False
    return None, ack.duplicate


class _NatsAcks:
    """nats-server: core publishes with a reply subject; acks arrive on one subscription."""

    store_now = None  # acks come later, on the inbox

    def __init__(self, nc: NATS, on_reply: OnReply) -> None:
        self._nc = nc
        self._on_reply = on_reply
        self._prefix = ""
        self._sub = None

    @property
    def connected(self) -> bool:
        return self._nc.is_connected

    async def open(self) -> None:
        self._prefix = self._nc.new_inbox() + "."  # under the user's own inbox (ops/access.py)
        self._sub = await self._nc.subscribe(self._prefix + "*", cb=self._on_msg)

    async def send(self, owed: _Owed) -> None:
        await self._nc.publish(owed.subject, owed.data, reply=self._prefix + str(owed.token), headers={"Nats-Msg-Id": owed.event_id})

    async def _on_msg(self, msg) -> None:
        try:
            token = int(msg.subject[len(self._prefix) :])
        except ValueError:
            return  # not an ack of ours (nobody else may publish to this inbox)
        self._on_reply(token, *read_ack(msg.data, msg.headers))

    async def close(self) -> None:
        if self._sub is not None and not self._nc.is_closed:
            await self._sub.unsubscribe()


class _AwaitedPublish:
    """The in-process bus: `js.publish` stores and answers at once."""

    connected = True

    def __init__(self, js, on_reply: OnReply) -> None:
        self._js = js
        self._on_reply = on_reply
        self._store = getattr(js, "store", None)  # the in-process bus's publish without the coroutine and the PubAck
        self.store_now = None if self._store is None else self._store_at_once

    def _store_at_once(self, subject: str, data: bytes, event_id: str) -> bool:
        """Store one event; True if the stream had it already."""
        return self._store(subject, data, {"Nats-Msg-Id": event_id})[2]

    async def open(self) -> None:
        pass

    async def send(self, owed: _Owed) -> None:
        ack = await self._js.publish(owed.subject, owed.data, headers={"Nats-Msg-Id": owed.event_id})
        self._on_reply(owed.token, None, bool(ack.duplicate))

    async def close(self) -> None:
        pass


def transport(js: JetStreamContext, on_reply: OnReply) -> _NatsAcks | _AwaitedPublish:
    nc = getattr(js, "_nc", None)  # nats-py's JetStreamContext keeps its connection here
    return _NatsAcks(nc, on_reply) if isinstance(nc, NATS) else _AwaitedPublish(js, on_reply)


class LifecyclePublisher:
    def __init__(
        self,
        js: JetStreamContext,
        counters: Counter,
        log: logging.Logger,
        clock: Clock,
        window: int = WINDOW,
        give_up_wall_s: float = GIVE_UP_WALL_S,
    ) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self.peak_in_flight = 0  # the most events in flight at once (never above `window`)
        self._clock = clock
        self._counters = counters
        self._log = log
        self._transport = transport(js, self._on_reply)
        self._subjects = {kind: subjects.lifecycle(kind.value) for kind in EventKind}
        scale = clock.time_scale  # model seconds per wall second
        self._ack_timeout_s = ACK_TIMEOUT_WALL_S * scale
        self._retry_s = _RETRY_WALL_S * scale
        self._last_try_s = (give_up_wall_s - ACK_TIMEOUT_WALL_S) * scale  # after the first try, no later
        self._queue: deque[LifecycleEvent] = deque()  # emitted, never sent
        self._awaiting: dict[int, _Owed] = {}  # sent, no answer yet; in the order sent
        self._retrying: dict[int, _Owed] = {}  # a try failed; in the order the next is due
        self._next_token = 0
        self._owed = 0  # emitted, neither acked nor given up
        self._given_up = 0  # since the last flush
        self._emitted = 0  # events emitted so far: the n-th is sent under token n
        self._waiters: list[tuple[int, asyncio.Future]] = []  # (token, settled): `settled` calls waiting
        self._idle = asyncio.Event()
        self._idle.set()
        self._wake = asyncio.Event()
        self._ticked = False
        self._timer: asyncio.TimerHandle | None = None
        self._task: asyncio.Task | None = None
        # the in-process bus stores on the spot: events are stored by a callback queued where
        # the sender task's wake-up would be, instead of a step of the task (`_drain`)
        self._direct = self._transport.store_now is not None
        self._drain_queued = False

    @property
    def owed(self) -> int:
        """Events emitted and neither acked nor given up."""
        return self._owed

    @property
    def stores_on_the_spot(self) -> bool:
        """The in-process bus: it stores an event in this process, and dies with it."""
        return self._direct

    @property
    def in_flight(self) -> int:
        return len(self._awaiting) + len(self._retrying)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="lifecycle-publisher")
        if self._direct:  # where the task's first step would store what is emitted before it
            self._queue_drain()

    def emit(self, event: LifecycleEvent) -> None:
        self._queue.append(event)
        self._emitted += 1
        self._owed += 1
        self._idle.clear()
        self._counters["lifecycle_events"] += 1
        if not self._direct:
            self._wake.set()
        elif not self._drain_queued and self._task is not None:
            self._queue_drain()

    async def flush(self) -> None:
        """Return once every emitted event is stored in the stream; raise PublishFailed if
        any was given up since the last flush (counted in `lifecycle_publish_failures`)."""
        await self._wait_idle()
        given_up, self._given_up = self._given_up, 0
        if given_up:
            raise PublishFailed(f"{given_up} lifecycle events not acked inside the duplicate window: given up")

    async def settled(self) -> None:
        """Return once every event emitted before this call is stored in the stream or given up
        (counted); events emitted meanwhile do not hold it. The in-process bus returns at once:
        it lives and dies with the actor, so no crash can separate an event from the work it
        logs (and the simulation's order of loop turns stays the same)."""
        if self._direct or self._settled_through(self._emitted):
            return
        if self._task is None:
            raise RuntimeError("settled before start: nothing would ever be sent")
        settled = asyncio.get_running_loop().create_future()
        self._waiters.append((self._emitted, settled))
        await asyncio.wait({settled, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if not settled.done():
            self._task.result()  # the sender crashed: say why
            raise RuntimeError("lifecycle publisher stopped with events owed")

    def _settled_through(self, token: int) -> bool:
        """Is every event up to the `token`-th sent and acked or given up?"""
        if self._next_token < token:
            return False
        return all(t > token for t in self._awaiting) and all(t > token for t in self._retrying)

    async def close(self) -> None:
        """Flush (events given up are counted and logged, not raised) and stop."""
        if self._task is not None:
            await self._wait_idle()
            await cancel_and_wait([self._task], self._log, self._clock.loop_s(CANCEL_WAIT_S))
        if self._timer is not None:
            self._timer.cancel()
        try:
            await self._transport.close()
        except BUS_ERRORS as err:  # the connection closes next anyway
            self._log.warning("closing the lifecycle ack subscription failed: %r", err)

    async def _wait_idle(self) -> None:
        if self._idle.is_set():
            return
        if self._task is None:
            raise RuntimeError("flush before start: nothing would ever be sent")
        idle = asyncio.ensure_future(self._idle.wait())
        try:
            await asyncio.wait({idle, self._task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            idle.cancel()
        if not self._idle.is_set():
            self._task.result()  # the sender crashed: say why
            raise RuntimeError("lifecycle publisher stopped with events owed")

    # --- the sender -------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self._transport.open()
                break
            except BUS_ERRORS as err:
                self._log.warning("lifecycle ack subscription failed, retrying: %r", err)
                await self._clock.sleep_wall(_RETRY_WALL_S)
        while True:
            await self._wake.wait()
            self._wake.clear()
            now = self._clock.now_s()
            self._expire(now)  # 1. tries whose ack is overdue: retry
            if self._ticked:  # 2. retries that could no longer end inside the window: give up
                self._ticked = False
                for owed in [o for o in self._retrying.values() if now - o.first_s > self._last_try_s]:
                    del self._retrying[owed.token]
                    self._give_up(owed, now)
            if self._transport.connected:  # 3. due retries, then new events while there is room
                await self._send(now)
            if self._owed and self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self._clock.loop_s(_TICK_WALL_S), self._tick)

    def _queue_drain(self) -> None:
        self._drain_queued = True
        asyncio.get_running_loop().call_soon(self._drain)

    def _drain(self) -> None:
        """The sender task's step on the in-process bus, as a callback: store the queued
        events, `_YIELD_EVERY` at a time (the rest in a callback queued after the others, as
        the task's `sleep(0)` would). A failed store leaves its event to the task's retries."""
        self._drain_queued = False
        if self._retrying or self._awaiting:  # a store failed: the task retries, in order
            self._wake.set()
            return
        now = self._clock.now_s()
        for _ in range(_YIELD_EVERY):
            if not self._queue or self._retrying:
                return
            self._next_token += 1
            self._store_now(self._transport.store_now, self._queue.popleft(), now)
        self._queue_drain()

    async def _send(self, now: float) -> None:
        while self._retrying:
            owed = next(iter(self._retrying.values()))
            if owed.at_s > now:
                break
            del self._retrying[owed.token]
            if now - owed.first_s > self._last_try_s:
                self._give_up(owed, now)
            else:
                await self._try(owed, now)
        sent = 0
        store_now = self._transport.store_now
        while self._queue and len(self._awaiting) + len(self._retrying) < self.window:
            event = self._queue.popleft()
            self._next_token += 1
            if store_now is not None:
                self._store_now(store_now, event, now)
            else:
                await self._try(_Owed(self._next_token, event.event_id, self._subjects[event.kind], encode(event), now), now)
            sent += 1
            if sent % _YIELD_EVERY == 0:
                await asyncio.sleep(0)  # let the actor (and the acks) run
                now = self._clock.now_s()
                if not self._transport.connected:
                    return

    async def _try(self, owed: _Owed, now: float) -> None:
        owed.at_s = now
        self._awaiting[owed.token] = owed
        in_flight = len(self._awaiting) + len(self._retrying)
        if in_flight > self.peak_in_flight:
            self.peak_in_flight = in_flight
        try:
            await self._transport.send(owed)
        except BUS_ERRORS as err:  # not sent (connection lost, say): retry
            self._on_reply(owed.token, repr(err), False)

    def _store_now(self, store_now: Callable[[str, bytes, str], bool], event: LifecycleEvent, now: float) -> None:
        """`_try` and its `_on_reply` on a transport that stores and acks on the spot (the
        in-process bus), without the bookkeeping of an event in flight: nothing else can
        happen between the two. A failed try is owed and retried as `_try` would."""
        subject, data = self._subjects[event.kind], encode(event)
        in_flight = len(self._awaiting) + len(self._retrying) + 1
        if in_flight > self.peak_in_flight:
            self.peak_in_flight = in_flight
        try:
            duplicate = store_now(subject, data, event.event_id)
        except BUS_ERRORS as err:
            self._retry(_Owed(self._next_token, event.event_id, subject, data, now), repr(err))
            return
        if duplicate:
            self._counters["lifecycle_publish_duplicates"] += 1
        self._settle()

    def _on_reply(self, token: int, error: str | None, duplicate: bool) -> None:
        owed = self._awaiting.pop(token, None)
        if owed is None:  # an answer to an earlier try of an event already retried, or settled
            owed = self._retrying.pop(token, None) if error is None else None
            if owed is None:
                return
        if error is not None:
            self._retry(owed, error)
            return
        if duplicate:
            self._counters["lifecycle_publish_duplicates"] += 1
        self._settle()

    def _expire(self, now: float) -> None:
        while self._awaiting:
            owed = next(iter(self._awaiting.values()))
            if now - owed.at_s <= self._ack_timeout_s:
                break
            del self._awaiting[owed.token]
            self._retry(owed, f"no ack within {ACK_TIMEOUT_WALL_S:g} s")

    def _retry(self, owed: _Owed, why: str) -> None:
        self._counters["lifecycle_publish_retries"] += 1
        n = self._counters["lifecycle_publish_retries"]
        if n & (n - 1) == 0 or n % 1000 == 0:  # the 1st, 2nd, 4th ... and every 1000th
            self._log.warning("lifecycle publish of %s failed (%d retries so far): %s", owed.subject, n, why)
        owed.at_s = self._clock.now_s() + self._retry_s
        self._retrying[owed.token] = owed
        self._wake.set()

    def _give_up(self, owed: _Owed, now: float) -> None:
        self._counters["lifecycle_publish_failures"] += 1
        self._given_up += 1
        n = self._counters["lifecycle_publish_failures"]
        if n & (n - 1) == 0 or n % 1000 == 0:
            self._log.error(
                "lifecycle event %s on %s not acked %.0f s after its first try: given up inside the duplicate window (%d so far)",
                owed.event_id,
                owed.subject,
                (now - owed.first_s) / self._clock.time_scale,
                n,
            )
        self._settle()

    def _settle(self) -> None:
        self._owed -= 1
        if self._owed == 0:
            self._idle.set()
        if self._waiters:
            self._wake_settled()
        if not self._direct or self._retrying:
            self._wake.set()  # room in the window (stored on the spot, an event never waits for it)

    def _wake_settled(self) -> None:
        waiting = []
        for token, settled in self._waiters:
            if settled.done():
                continue
            if self._settled_through(token):
                settled.set_result(None)
            else:
                waiting.append((token, settled))
        self._waiters = waiting

    def _tick(self) -> None:
        self._timer = None
        self._ticked = True
        self._wake.set()
