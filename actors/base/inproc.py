"""An in-process bus with the NATS semantics Prorsa relies on, for simulation in one process.

It implements the part of nats-py's client API that the actors use (the *bus interface*:
`BusClient` below), so the very same actor code runs on a real `nats-server` or here:

* core NATS: publish, subscribe with a callback (one task per subscription, messages in
  publish order), request/reply with timeouts and "no responders";
* JetStream: streams capturing subjects (wildcards `*` and `>`), `Nats-Msg-Id`
  de-duplication within the stream's window, limits and work-queue retention, durable pull
  consumers with explicit acks (work-queue exclusivity, redelivery after `ack_wait`,
  `nak(delay)`, `term`, `in_progress`), direct reads by sequence;
* key-value buckets with create-if-absent.

All waiting goes through the event loop's clock, so under `actors.base.virtual`'s loop a
simulated run takes only the CPU time of its logic. `tests/test_bus_conformance.py` runs
the same checks against this bus and a real `nats-server`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.errors import BadRequestError, BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from bus_schemas.subjects import matches as subject_matches

MsgCallback = Callable[["InProcMsg"], Awaitable[None]]
_EPS_S = 1e-9  # times closer than this are equal (float sums of timeouts drift by ~1e-16)


@dataclass(slots=True)
class _Stored:
    seq: int
    subject: str
    data: bytes
    headers: dict[str, str] | None


@dataclass(slots=True)
class _Pending:
    redeliver_at: float
    deliveries: int


class InProcMsg:
    """A delivered message: core (`respond`) or JetStream (`ack`, `nak`, `term`, `in_progress`)."""

    def __init__(self, client: InProcClient, subject: str, data: bytes, reply: str = "", headers=None) -> None:
        self._client = client
        self.subject = subject
        self.data = data
        self.reply = reply
        self.headers = headers
        self._consumer: _Consumer | None = None
        self._seq = 0
        self.metadata: Any = None

    async def respond(self, data: bytes) -> None:
        await self._client.publish(self.reply, data)

    async def ack(self) -> None:
        if self._consumer is not None:
            self._consumer.ack(self._seq)

    async def ack_sync(self, timeout: float = 1.0) -> InProcMsg:
        await self.ack()
        return self

    async def nak(self, delay: float | None = None) -> None:
        if self._consumer is not None:
            self._consumer.nak(self._seq, delay or 0.0)

    async def term(self) -> None:
        if self._consumer is not None:
            self._consumer.ack(self._seq)  # never redelivered; leaves a work queue

    async def in_progress(self) -> None:
        if self._consumer is not None:
            self._consumer.touch(self._seq)


class _Stream:
    def __init__(self, config: api.StreamConfig) -> None:
        self.config = config
        self.messages: dict[int, _Stored] = {}
        self.next_seq = 1
        self.dedup: dict[str, tuple[int, float]] = {}  # msg id -> (seq, stored at)
        self.consumers: dict[str, _Consumer] = {}
        self.changed = asyncio.Event()

    @property
    def work_queue(self) -> bool:
        return self.config.retention == api.RetentionPolicy.WORK_QUEUE

    def captures(self, subject: str) -> bool:
        return any(subject_matches(p, subject) for p in self.config.subjects or ())

    def store(self, subject: str, data: bytes, headers: dict[str, str] | None, now: float) -> tuple[int, bool]:
        msg_id = (headers or {}).get("Nats-Msg-Id")
        window = self.config.duplicate_window or 120.0
        if msg_id is not None:
            seen = self.dedup.get(msg_id)
            if seen is not None and now - seen[1] < window:
                return seen[0], True
        seq = self.next_seq
        self.next_seq += 1
        self.messages[seq] = _Stored(seq, subject, data, headers)
        if msg_id is not None:
            self.dedup[msg_id] = (seq, now)
        self.changed.set()
        self.changed = asyncio.Event()
        return seq, False

    def purge(self) -> None:
        self.messages.clear()
        for consumer in self.consumers.values():
            consumer.pending.clear()
            consumer._timers.clear()
            consumer.cursor = self.next_seq


class _Consumer:
    def __init__(self, stream: _Stream, config: api.ConsumerConfig, loop_time: Callable[[], float]) -> None:
        self.stream = stream
        self.config = config
        self.name = config.durable_name or config.name or ""
        self.filter = config.filter_subject or ">"
        self.explicit = config.ack_policy != api.AckPolicy.NONE
        self.ack_wait_s = config.ack_wait or 30.0
        self.cursor = 1  # next stream sequence never delivered
        self.pending: dict[int, _Pending] = {}
        self._timers: list[tuple[float, int]] = []  # (redeliver_at, seq), stale entries skipped
        self._time = loop_time

    def _matches(self, stored: _Stored) -> bool:
        return subject_matches(self.filter, stored.subject)

    def _schedule(self, seq: int, at_s: float) -> None:
        self.pending[seq].redeliver_at = at_s
        heapq.heappush(self._timers, (at_s, seq))

    def _live_timer(self) -> tuple[float, int] | None:
        while self._timers:
            at_s, seq = self._timers[0]
            p = self.pending.get(seq)
            if p is not None and p.redeliver_at == at_s and seq in self.stream.messages:
                return at_s, seq
            heapq.heappop(self._timers)
        return None

    def next_message(self) -> tuple[_Stored, int] | None:
        """A message due now: the oldest redelivery, else the next undelivered one."""
        now = self._time()
        timer = self._live_timer()
        if timer is not None and timer[0] <= now + _EPS_S:
            seq = heapq.heappop(self._timers)[1]
            pending = self.pending[seq]
            pending.deliveries += 1
            self._schedule(seq, now + self.ack_wait_s)
            return self.stream.messages[seq], pending.deliveries
        for seq in range(self.cursor, self.stream.next_seq):
            stored = self.stream.messages.get(seq)
            self.cursor = seq + 1
            if stored is None or not self._matches(stored):
                continue
            if self.explicit:
                self.pending[seq] = _Pending(0.0, 1)
                self._schedule(seq, now + self.ack_wait_s)
            return stored, 1
        return None

    def next_redelivery_at(self) -> float | None:
        timer = self._live_timer()
        return None if timer is None else timer[0]

    def num_pending(self) -> int:
        return sum(1 for seq, m in self.stream.messages.items() if seq >= self.cursor and self._matches(m))

    def ack(self, seq: int) -> None:
        if self.pending.pop(seq, None) is not None and self.stream.work_queue:
            self.stream.messages.pop(seq, None)

    def nak(self, seq: int, delay_s: float) -> None:
        if seq in self.pending:
            self._schedule(seq, self._time() + delay_s)
            self.stream.changed.set()
            self.stream.changed = asyncio.Event()

    def touch(self, seq: int) -> None:
        if seq in self.pending:
            self._schedule(seq, self._time() + self.ack_wait_s)


class _Metadata:
    """JetStream delivery metadata; `num_pending` is counted only when asked for."""

    def __init__(self, consumer: _Consumer, seq: int, deliveries: int) -> None:
        self._consumer = consumer
        self.num_delivered = deliveries
        self.sequence = SimpleNamespace(stream=seq, consumer=seq)
        self.stream = consumer.stream.config.name
        self.consumer = consumer.name

    @property
    def num_pending(self) -> int:
        return self._consumer.num_pending()


class _PullSubscription:
    def __init__(self, client: InProcClient, consumer: _Consumer) -> None:
        self._client = client
        self._consumer = consumer

    async def fetch(self, batch: int = 1, timeout: float | None = 5, heartbeat: float | None = None) -> list[InProcMsg]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout if timeout is not None else 1e18)
        while True:
            msgs = []
            while len(msgs) < batch and (found := self._consumer.next_message()) is not None:
                msgs.append(self._deliver(*found))
            if msgs:
                return msgs
            now = loop.time()
            if now >= deadline - _EPS_S:
                raise NatsTimeoutError
            wake_at = min(t for t in (deadline, self._consumer.next_redelivery_at()) if t is not None)
            try:
                await asyncio.wait_for(self._consumer.stream.changed.wait(), timeout=max(0.0, wake_at - now))
            except TimeoutError:
                pass

    def _deliver(self, stored: _Stored, deliveries: int) -> InProcMsg:
        msg = InProcMsg(self._client, stored.subject, stored.data, headers=stored.headers)
        if self._consumer.explicit:
            msg._consumer, msg._seq = self._consumer, stored.seq
        msg.metadata = _Metadata(self._consumer, stored.seq, deliveries)
        return msg

    async def consumer_info(self) -> Any:
        return SimpleNamespace(name=self._consumer.name, num_pending=self._consumer.num_pending())

    async def unsubscribe(self) -> None:
        if not self._consumer.name.startswith("_eph"):
            return
        self._consumer.stream.consumers.pop(self._consumer.name, None)


class _KeyValue:
    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.entries: dict[str, tuple[bytes, int]] = {}
        self.revision = itertools.count(1)

    async def get(self, key: str) -> Any:
        if key not in self.entries:
            raise KeyNotFoundError
        value, revision = self.entries[key]
        return SimpleNamespace(key=key, value=value, revision=revision)

    async def put(self, key: str, value: bytes) -> int:
        revision = next(self.revision)
        self.entries[key] = (value, revision)
        return revision

    async def create(self, key: str, value: bytes) -> int:
        if key in self.entries:
            raise KeyWrongLastSequenceError(description=f"key {key} exists")
        return await self.put(key, value)


class InProcJetStream:
    def __init__(self, client: InProcClient) -> None:
        self._client = client
        self._server = client.server

    async def publish(self, subject: str, payload: bytes = b"", timeout: float | None = None, stream: str | None = None, headers=None) -> api.PubAck:
        target = self._server.stream_for(subject)
        if target is None:
            raise NoRespondersError
        seq, duplicate = target.store(subject, payload, headers, self._server.time())
        await self._server.deliver_core(self._client, subject, payload, "", headers)
        return api.PubAck(stream=target.config.name, seq=seq, duplicate=duplicate or None)

    async def publish_async(self, subject: str, payload: bytes = b"", wait_stall=None, stream=None, headers=None) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        future.set_result(await self.publish(subject, payload, headers=headers))
        return future

    async def add_stream(self, config: api.StreamConfig | None = None, **params) -> Any:
        config = config or api.StreamConfig(**params)
        if config.name in self._server.streams:
            raise BadRequestError(description="stream name already in use")
        self._server.streams[config.name] = _Stream(config)
        self._server.streams_changed()
        return await self.stream_info(config.name)

    async def update_stream(self, config: api.StreamConfig | None = None, **params) -> Any:
        config = config or api.StreamConfig(**params)
        self._server.stream(config.name).config = config
        self._server.streams_changed()
        return await self.stream_info(config.name)

    async def stream_info(self, name: str, subjects_filter: str | None = None) -> Any:
        s = self._server.stream(name)
        state = SimpleNamespace(messages=len(s.messages), first_seq=min(s.messages, default=0), last_seq=s.next_seq - 1)
        return SimpleNamespace(config=s.config, state=state)

    async def purge_stream(self, name: str) -> bool:
        self._server.stream(name).purge()
        return True

    async def consumers_info(self, stream: str) -> list[Any]:
        return [SimpleNamespace(name=n) for n in self._server.stream(stream).consumers]

    async def delete_consumer(self, stream: str, consumer: str) -> bool:
        self._server.stream(stream).consumers.pop(consumer, None)
        return True

    async def pull_subscribe(self, subject: str, durable: str | None = None, stream: str | None = None, config: api.ConsumerConfig | None = None, **_) -> _PullSubscription:
        target = self._server.stream(stream) if stream else self._server.stream_for(subject)
        if target is None:
            raise NotFoundError(description=f"no stream captures {subject}")
        config = config or api.ConsumerConfig()
        name = durable or f"_eph{next(self._server.ids)}"
        consumer = target.consumers.get(name)
        if consumer is None:
            if target.work_queue and config.ack_policy == api.AckPolicy.NONE:
                raise BadRequestError(description="consumer in pull mode requires explicit ack policy on workqueue stream")
            config.filter_subject = config.filter_subject or subject
            config.durable_name = durable
            config.name = name
            consumer = target.consumers[name] = _Consumer(target, config, self._server.time)
        return _PullSubscription(self._client, consumer)

    async def get_msg(self, stream_name: str, seq: int | None = None, subject: str | None = None, direct: bool = False, next: bool = False) -> Any:
        s = self._server.stream(stream_name)
        for candidate in sorted(k for k in s.messages if k >= (seq or 1)):
            stored = s.messages[candidate]
            if subject is None or subject_matches(subject, stored.subject):
                return api.RawStreamMsg(subject=stored.subject, seq=stored.seq, data=stored.data, headers=stored.headers)
            if not next:
                break
        raise NotFoundError(description="no message found")

    async def key_value(self, bucket: str) -> _KeyValue:
        if bucket not in self._server.buckets:
            raise BucketNotFoundError
        return self._server.buckets[bucket]

    async def create_key_value(self, bucket: str | None = None, **_) -> _KeyValue:
        return self._server.buckets.setdefault(bucket or "", _KeyValue(bucket or ""))


@dataclass(eq=False)
class _CoreSub:
    client: InProcClient
    subject: str
    cb: MsgCallback | None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    task: asyncio.Task | None = None

    async def unsubscribe(self) -> None:
        self.client.server.subs.pop(self, None)
        self.client.server.subscriptions_changed()
        if self.task is not None:
            self.task.cancel()

    async def next_msg(self, timeout: float | None = None) -> InProcMsg:
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except TimeoutError:
            raise NatsTimeoutError from None

    async def _run(self) -> None:
        while True:
            msg = await self.queue.get()
            try:
                await self.cb(msg)  # type: ignore[misc]
            except Exception as err:  # as nats-py: a failing callback goes to the error callback
                await self.client.on_error(err)


class InProcServer:
    """The shared state of one simulated bus; `connect()` gives each actor its own client."""

    def __init__(self) -> None:
        self.streams: dict[str, _Stream] = {}
        self.subs: dict[_CoreSub, None] = {}  # an ordered set: delivery order is creation order
        self.buckets: dict[str, _KeyValue] = {}
        self.ids = itertools.count(1)
        self._routes: dict[str, list[_CoreSub]] = {}  # subject -> matching subscriptions
        self._stream_of: dict[str, _Stream | None] = {}  # subject -> capturing stream

    def subscriptions_changed(self) -> None:
        self._routes.clear()

    def streams_changed(self) -> None:
        self._stream_of.clear()

    def time(self) -> float:
        return asyncio.get_running_loop().time()

    def connect(self, name: str = "", on_error: Callable[[Exception], Awaitable[None]] | None = None) -> InProcClient:
        return InProcClient(self, name, on_error)

    def stream(self, name: str) -> _Stream:
        if name not in self.streams:
            raise NotFoundError(description=f"stream {name} not found")
        return self.streams[name]

    def stream_for(self, subject: str) -> _Stream | None:
        if subject not in self._stream_of:
            self._stream_of[subject] = next((s for s in self.streams.values() if s.captures(subject)), None)
        return self._stream_of[subject]

    def _route(self, subject: str) -> list[_CoreSub]:
        if subject not in self._routes:
            self._routes[subject] = [s for s in self.subs if subject_matches(s.subject, subject)]
        return self._routes[subject]

    def has_interest(self, subject: str) -> bool:
        return bool(self._route(subject))

    async def deliver_core(self, sender: InProcClient, subject: str, data: bytes, reply: str, headers) -> None:
        for sub in self._route(subject):
            sub.queue.put_nowait(InProcMsg(sub.client, subject, data, reply, headers))


class InProcClient:
    """One actor's connection (the subset of `nats.aio.client.Client` the actors use)."""

    def __init__(self, server: InProcServer, name: str, on_error) -> None:
        self.server = server
        self.name = name
        self._on_error = on_error
        self._closed = False

    is_connected = property(lambda self: not self._closed)
    is_closed = property(lambda self: self._closed)
    is_draining = property(lambda self: False)

    async def on_error(self, err: Exception) -> None:
        if self._on_error is not None:
            await self._on_error(err)

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "", headers=None) -> None:
        stream = self.server.stream_for(subject)
        if stream is not None:
            stream.store(subject, payload, headers, self.server.time())
        await self.server.deliver_core(self, subject, payload, reply, headers)

    async def subscribe(self, subject: str, queue: str = "", cb: MsgCallback | None = None, **_) -> _CoreSub:
        sub = _CoreSub(self, subject, cb)
        self.server.subs[sub] = None
        self.server.subscriptions_changed()
        if cb is not None:
            sub.task = asyncio.create_task(sub._run(), name=f"sub {subject}")
        return sub

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 0.5, headers=None) -> InProcMsg:
        if not self.server.has_interest(subject):
            raise NoRespondersError
        inbox = f"_INBOX.{next(self.server.ids)}"
        sub = await self.subscribe(inbox)
        try:
            await self.server.deliver_core(self, subject, payload, inbox, headers)
            return await sub.next_msg(timeout)
        finally:
            await sub.unsubscribe()

    async def flush(self, timeout: float = 10) -> None:
        await asyncio.sleep(0)

    async def close(self) -> None:
        self._closed = True
        for sub in [s for s in self.server.subs if s.client is self]:
            await sub.unsubscribe()

    async def drain(self) -> None:
        await self.close()

    def jetstream(self, **_) -> InProcJetStream:
        return InProcJetStream(self)
