"""JetStream state of the in-process bus: streams, durable pull consumers, key-value
buckets, and the messages they deliver (see `actors.base.inproc`)."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import msgspec
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from actors.base.flag import resolve_if_pending
from bus_schemas.subjects import matches as subject_matches

if TYPE_CHECKING:
    from actors.base.inproc import InProcClient

EPS_S = 1e-9  # times closer than this are equal (float sums of timeouts drift by ~1e-16)
_FORGET_EVERY = 256  # ids stored between two sweeps for those out of the duplicate window (a sweep is memory only)


_MSG_ID = "Nats-Msg-Id"


class _Stored(msgspec.Struct, gc=False):
    """A message in a stream. Not tracked by the garbage collector (`gc=False`: it holds
    only an int, strings, bytes and a dict of strings, so it can be in no reference cycle):
    a long simulation stores hundreds of thousands, which every full collection would
    otherwise walk. Headers that are only a message id (every lifecycle event's) are kept as
    that id, without a dict per message; each reader gets a dict of its own."""

    seq: int
    subject: str
    data: bytes
    msg_id: str | None = None  # the headers were {"Nats-Msg-Id": msg_id}
    other_headers: dict[str, str] | None = None  # any other headers, as published

    @classmethod
    def of(cls, seq: int, subject: str, data: bytes, headers: dict[str, str] | None) -> _Stored:
        if headers is not None and len(headers) == 1 and _MSG_ID in headers:
            return cls(seq, subject, data, msg_id=headers[_MSG_ID])
        return cls(seq, subject, data, other_headers=headers)

    @property
    def headers(self) -> dict[str, str] | None:
        if self.msg_id is not None:
            return {_MSG_ID: self.msg_id}
        return self.other_headers


@dataclass(slots=True)
class _Pending:
    redeliver_at: float
    deliveries: int


class InProcMsg:
    """A delivered message: core (`respond`) or JetStream (`ack`, `nak`, `term`, `in_progress`)."""

    __slots__ = ("_client", "subject", "data", "reply", "headers", "_consumer", "_seq", "metadata")

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
        self._dedup_order: deque[tuple[float, str]] = deque()  # (stored at, msg id), oldest first
        self.consumers: dict[str, _Consumer] = {}

    @property
    def work_queue(self) -> bool:
        return self.config.retention == api.RetentionPolicy.WORK_QUEUE

    def captures(self, subject: str) -> bool:
        return any(subject_matches(p, subject) for p in self.config.subjects or ())

    def store(self, subject: str, data: bytes, headers: dict[str, str] | None, now: float) -> tuple[int, bool]:
        msg_id = None if headers is None else headers.get(_MSG_ID)
        if msg_id is not None:
            window = self.config.duplicate_window or 120.0
            if len(self._dedup_order) % _FORGET_EVERY == 0:
                self._forget_old_ids(now, window)
            seen = self.dedup.get(msg_id)
            if seen is not None and now - seen[1] < window:
                return seen[0], True
        seq = self.next_seq
        self.next_seq += 1
        self.messages[seq] = _Stored.of(seq, subject, data, headers)
        if msg_id is not None:
            self.dedup[msg_id] = (seq, now)
            self._dedup_order.append((now, msg_id))
        for consumer in self.consumers.values():
            if consumer.wants(subject):
                consumer.undelivered += 1  # stored at the stream's end, past every cursor
                consumer.offer()
        return seq, False

    def _forget_old_ids(self, now: float, window: float) -> None:
        """Drop the ids stored a `window` or more ago (a message with one of them would be
        stored again anyway), as nats-server does, so a long run does not keep every id. The
        test is the very one `store` makes; an id stored again since keeps its newer entry.
        Only memory: `store` checks each id's age itself, so a sweep may come late."""
        order, dedup = self._dedup_order, self.dedup
        while order and now - order[0][0] >= window:
            stored_at, msg_id = order.popleft()
            if dedup.get(msg_id, (0, None))[1] == stored_at:
                del dedup[msg_id]

    def forget_ids(self) -> None:
        self.dedup.clear()
        self._dedup_order.clear()

    def purge(self) -> None:
        self.messages.clear()
        for consumer in self.consumers.values():
            consumer.pending.clear()
            consumer._timers.clear()
            consumer.cursor = self.next_seq
            consumer.undelivered = 0

    def remove(self, seq: int) -> None:
        """Drop a stored message (acked on a work queue): a consumer whose cursor has not
        passed it no longer has it to deliver."""
        stored = self.messages.pop(seq, None)
        if stored is None:
            return
        for consumer in self.consumers.values():
            if consumer.cursor <= seq and consumer.wants(stored.subject):
                consumer.undelivered -= 1


class _Consumer:
    def __init__(self, stream: _Stream, config: api.ConsumerConfig, loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
        self.stream = stream
        self.config = config
        self.name = config.durable_name or config.name or ""
        self.filter = config.filter_subject or ">"
        self.explicit = config.ack_policy != api.AckPolicy.NONE
        self.ack_wait_s = config.ack_wait or 30.0
        self.cursor = 1  # next stream sequence never delivered
        self.pending: dict[int, _Pending] = {}
        self._timers: list[tuple[float, int]] = []  # (redeliver_at, seq), stale entries skipped
        self._loop = loop  # the bus's loop
        self._waiters: list[asyncio.Future] = []  # open pulls waiting for a message, oldest first
        self._wants: dict[str, bool] = {}  # subject -> matches the filter
        # messages from the cursor on that match the filter (`num_pending`), kept as they are
        # stored, delivered, removed or given back
        self.undelivered = self.count_undelivered()

    def wants(self, subject: str) -> bool:
        wanted = self._wants.get(subject)
        if wanted is None:
            wanted = self._wants[subject] = subject_matches(self.filter, subject)
        return wanted

    def _matches(self, stored: _Stored) -> bool:
        return self.wants(stored.subject)

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
        now = self._loop().time()
        timer = self._live_timer()
        if timer is not None and timer[0] <= now + EPS_S:
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
            self.undelivered -= 1
            if self.explicit:
                self.pending[seq] = _Pending(0.0, 1)
                self._schedule(seq, now + self.ack_wait_s)
            return stored, 1
        return None

    def next_messages(self, limit: int) -> list[tuple[_Stored, int]]:
        """Up to `limit` messages due now, as that many `next_message` calls would hand them
        out. Without acks there are no redeliveries: a plain walk from the cursor (an export
        reads a whole stream this way)."""
        if self.explicit:
            found: list[tuple[_Stored, int]] = []
            while len(found) < limit and (one := self.next_message()) is not None:
                found.append(one)
            return found
        messages, wants, seq, end = self.stream.messages, self.wants, self.cursor, self.stream.next_seq
        found = []
        while seq < end and len(found) < limit:
            stored = messages.get(seq)
            seq += 1
            if stored is not None and wants(stored.subject):
                found.append((stored, 1))
        self.cursor = seq
        self.undelivered -= len(found)
        return found

    def next_redelivery_at(self) -> float | None:
        timer = self._live_timer()
        return None if timer is None else timer[0]

    def num_pending(self) -> int:
        """Messages this consumer has not delivered yet."""
        return self.undelivered

    def count_undelivered(self) -> int:
        """`num_pending` counted over the stream. Walks whichever is shorter: the sequences
        from the cursor on, or the stream (a work queue keeps only unacked ones)."""
        messages, cursor, end, wants = self.stream.messages, self.cursor, self.stream.next_seq, self.wants
        if end - cursor <= len(messages):
            found = map(messages.get, range(cursor, end))
            return sum(1 for m in found if m is not None and wants(m.subject))
        return sum(1 for seq, m in messages.items() if seq >= cursor and wants(m.subject))

    def ack(self, seq: int) -> None:
        if self.pending.pop(seq, None) is not None and self.stream.work_queue:
            self.stream.remove(seq)

    def nak(self, seq: int, delay_s: float) -> None:
        if seq in self.pending:
            self._schedule(seq, self._loop().time() + delay_s)
            if delay_s > 0:
                self._look_again()
            else:
                self.offer()

    async def wait(self, timeout_s: float) -> tuple[_Stored, int] | None:
        """Open a pull: the message handed to it (`offer`), or None after `timeout_s` or when
        asked to look again."""
        loop = self._loop()
        future = loop.create_future()
        self._waiters.append(future)
        timer = loop.call_later(max(0.0, timeout_s), resolve_if_pending, future, None)
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.result() is not None:
                self._give_back(future.result()[0].seq)  # handed over, then cancelled
            raise
        finally:
            timer.cancel()
            if future in self._waiters:
                self._waiters.remove(future)

    def num_waiting(self) -> int:
        return sum(1 for future in self._waiters if not future.done())

    def offer(self) -> None:
        """Hand the messages due now to the open pulls, the one that has waited longest first,
        as nats-server serves pull requests: a pull opened later cannot overtake it."""
        while True:
            while self._waiters and self._waiters[0].done():
                self._waiters.pop(0)
            if not self._waiters:
                return
            found = self.next_message()
            if found is None:
                return
            self._waiters.pop(0).set_result(found)

    def _look_again(self) -> None:
        """Every open pull recomputes when to look (a redelivery time changed)."""
        waiters, self._waiters = self._waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(None)

    def touch(self, seq: int) -> None:
        if seq in self.pending:
            self._schedule(seq, self._loop().time() + self.ack_wait_s)

    def _give_back(self, seq: int) -> None:
        if seq in self.pending:
            self.pending[seq].deliveries -= 1
            self._schedule(seq, self._loop().time())
        elif seq == self.cursor - 1:
            self.cursor = seq
            stored = self.stream.messages.get(seq)
            if stored is not None and self._matches(stored):
                self.undelivered += 1
        self.offer()


class _Metadata:
    """JetStream delivery metadata, each field worked out only when asked for (a consumer
    reading a whole stream asks for none)."""

    __slots__ = ("_consumer", "_seq", "num_delivered")

    def __init__(self, consumer: _Consumer, seq: int, deliveries: int) -> None:
        self._consumer = consumer
        self._seq = seq
        self.num_delivered = deliveries

    @property
    def sequence(self) -> SimpleNamespace:
        return SimpleNamespace(stream=self._seq, consumer=self._seq)

    @property
    def stream(self) -> str:
        return self._consumer.stream.config.name

    @property
    def consumer(self) -> str:
        return self._consumer.name

    @property
    def num_pending(self) -> int:
        return self._consumer.num_pending()


class _PullSubscription:
    def __init__(self, client: InProcClient, consumer: _Consumer) -> None:
        self._client = client
        self._consumer = consumer

    async def fetch(self, batch: int = 1, timeout: float | None = 5, heartbeat: float | None = None) -> list[InProcMsg]:
        loop = self._consumer._loop()
        deadline = loop.time() + (timeout if timeout is not None else 1e18)
        while True:
            msgs = [self._deliver(stored, deliveries) for stored, deliveries in self._consumer.next_messages(batch)]
            if msgs:
                return msgs
            now = loop.time()
            if now >= deadline - EPS_S:
                raise NatsTimeoutError
            wake_at = min(t for t in (deadline, self._consumer.next_redelivery_at()) if t is not None)
            found = await self._consumer.wait(wake_at - now)
            if found is not None:
                more = self._consumer.next_messages(batch - 1) if batch > 1 else []
                return [self._deliver(*found), *(self._deliver(stored, deliveries) for stored, deliveries in more)]

    def _deliver(self, stored: _Stored, deliveries: int) -> InProcMsg:
        msg = InProcMsg(self._client, stored.subject, stored.data, headers=stored.headers)
        if self._consumer.explicit:
            msg._consumer, msg._seq = self._consumer, stored.seq
        msg.metadata = _Metadata(self._consumer, stored.seq, deliveries)
        return msg

    async def consumer_info(self) -> Any:
        c = self._consumer
        return SimpleNamespace(name=c.name, num_pending=c.num_pending(), num_waiting=c.num_waiting())

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
