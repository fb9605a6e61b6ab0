"""An in-process bus with the NATS semantics Prorsa relies on, for simulation in one process.

It implements the part of nats-py's client API that the actors use (the *bus interface*:
`InProcClient` here, streams and consumers in `inproc_store`), so the very same actor code runs on a real `nats-server` or here:

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
import itertools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError

from actors.base.inproc_store import InProcMsg, _Consumer, _KeyValue, _PullSubscription, _Stream
from bus_schemas.subjects import has_wildcard
from bus_schemas.subjects import matches as subject_matches

MsgCallback = Callable[[InProcMsg], Awaitable[None]]
INBOX_PREFIX = "_INBOX."  # a request's reply subject (`InProcClient.request`), each used once


def may_match_inbox(pattern: str) -> bool:
    """Could `pattern` match a request's inbox (`_INBOX.<n>`)? Only by its first token."""
    return pattern.split(".", 1)[0] in ("*", ">", "_INBOX")


class InProcJetStream:
    def __init__(self, client: InProcClient) -> None:
        self._client = client
        self._server = client.server

    async def publish(
        self, subject: str, payload: bytes = b"", timeout: float | None = None, stream: str | None = None, headers=None
    ) -> api.PubAck:
        target, seq, duplicate = self.store(subject, payload, headers)
        return api.PubAck(stream=target.config.name, seq=seq, duplicate=duplicate or None)

    def store(self, subject: str, payload: bytes, headers=None) -> tuple[_Stream, int, bool]:
        """`publish` without the coroutine and the PubAck (the in-process bus answers at once):
        (the stream, its sequence, whether it had the message already)."""
        target = self._server.stream_for(subject)
        if target is None:
            raise NoRespondersError
        seq, duplicate = target.store(subject, payload, headers, self._server.time())
        self._server.deliver_now(subject, payload, "", headers)
        return target, seq, duplicate

    def stored_messages(self, stream_name: str, subject: str) -> list[tuple[str, bytes]]:
        """Every message of `subject` in the stream, oldest first, as (subject, payload): what a
        no-ack consumer reading the whole stream is handed (the export), without a message
        object, metadata and fetch per batch. Reading changes nothing in the stream."""
        stored = self._server.stream(stream_name).messages  # in sequence order: each is stored under the next one
        wanted: dict[str, bool] = {}  # a stream has few subjects and many messages

        def wants(published_on: str) -> bool:
            if published_on not in wanted:
                wanted[published_on] = subject_matches(subject, published_on)
            return wanted[published_on]

        return [(m.subject, m.data) for m in stored.values() if wants(m.subject)]

    async def publish_async(self, subject: str, payload: bytes = b"", wait_stall=None, stream=None, headers=None) -> asyncio.Future:
        future = self._server.loop().create_future()
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

    async def pull_subscribe(
        self, subject: str, durable: str | None = None, stream: str | None = None, config: api.ConsumerConfig | None = None, **_
    ) -> _PullSubscription:
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
            consumer = target.consumers[name] = _Consumer(target, config, self._server.loop)
        return _PullSubscription(self._client, consumer)

    async def get_msg(
        self, stream_name: str, seq: int | None = None, subject: str | None = None, direct: bool = False, next: bool = False
    ) -> Any:
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
        self.client.server.remove_sub(self)
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
            except Exception as err:  # as nats-py: any failing callback goes to the error callback (counted there)
                await self.client.on_error(err)


class InProcServer:
    """The shared state of one simulated bus; `connect()` gives each actor its own client."""

    def __init__(self) -> None:
        self.streams: dict[str, _Stream] = {}
        self.subs: dict[_CoreSub, int] = {}  # subscription -> its creation order (= delivery order)
        self.buckets: dict[str, _KeyValue] = {}
        self.ids = itertools.count(1)
        self.callback_errors = 0  # subscription callbacks that raised, on any client
        self._literal: dict[str, list[_CoreSub]] = {}  # subject without wildcards -> its subscriptions
        self._wildcard: dict[_CoreSub, None] = {}  # subscriptions with `*` or `>` (few: one per kind of interest)
        self._routes: dict[str, list[_CoreSub]] = {}  # subject -> matching subscriptions, in creation order
        self._stream_of: dict[str, _Stream | None] = {}  # subject -> capturing stream (inboxes not kept)
        self._inbox_captured = False  # does any stream capture subjects an inbox may have?
        self._inbox_wildcards: dict[_CoreSub, None] = {}  # the wildcard subscriptions an inbox may match
        try:  # the loop it serves, if created in one (each get_running_loop call costs a getpid)
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None

    def add_sub(self, sub: _CoreSub) -> None:
        """Index a subscription. A literal one (a request's inbox, most often) changes only its
        own subject's route; a wildcard one, every route."""
        self.subs[sub] = next(self.ids)
        if has_wildcard(sub.subject):
            self._wildcard[sub] = None
            if may_match_inbox(sub.subject):
                self._inbox_wildcards[sub] = None
            self._routes.clear()
        else:
            self._literal.setdefault(sub.subject, []).append(sub)
            self._routes.pop(sub.subject, None)

    def remove_sub(self, sub: _CoreSub) -> None:
        if self.subs.pop(sub, None) is None:
            return
        if sub in self._wildcard:
            del self._wildcard[sub]
            self._inbox_wildcards.pop(sub, None)
            self._routes.clear()
            return
        same = self._literal[sub.subject]
        same.remove(sub)
        if not same:
            del self._literal[sub.subject]
        self._routes.pop(sub.subject, None)

    def drop_messages(self) -> None:
        """Forget every stream's messages and message ids (a finished simulation, once its
        export has read them: the export's frames then have that memory)."""
        for stream in self.streams.values():
            stream.purge()
            stream.forget_ids()

    def streams_changed(self) -> None:
        self._stream_of.clear()
        self._inbox_captured = any(may_match_inbox(p) for s in self.streams.values() for p in s.config.subjects or ())

    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop or asyncio.get_running_loop()

    def time(self) -> float:
        return self.loop().time()

    def connect(self, name: str = "", on_error: Callable[[Exception], Awaitable[None]] | None = None) -> InProcClient:
        return InProcClient(self, name, on_error)

    def stream(self, name: str) -> _Stream:
        if name not in self.streams:
            raise NotFoundError(description=f"stream {name} not found")
        return self.streams[name]

    def stream_for(self, subject: str) -> _Stream | None:
        if subject in self._stream_of:
            return self._stream_of[subject]
        inbox = subject.startswith(INBOX_PREFIX)
        if inbox and not self._inbox_captured:
            return None
        stream = next((s for s in self.streams.values() if s.captures(subject)), None)
        if not inbox:  # an inbox is replied to once: remembering it would only grow the map
            self._stream_of[subject] = stream
        return stream

    def _route(self, subject: str) -> list[_CoreSub]:
        route = self._routes.get(subject)
        if route is None:
            wildcards = self._inbox_wildcards if subject.startswith(INBOX_PREFIX) else self._wildcard
            route = [*self._literal.get(subject, ()), *(s for s in wildcards if subject_matches(s.subject, subject))]
            route.sort(key=self.subs.__getitem__)
            self._routes[subject] = route
        return route

    def has_interest(self, subject: str) -> bool:
        return bool(self._route(subject))

    async def deliver_core(self, sender: InProcClient, subject: str, data: bytes, reply: str, headers) -> None:
        self.deliver_now(subject, data, reply, headers)

    def deliver_now(self, subject: str, data: bytes, reply: str, headers) -> None:
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

    def has_interest(self, subject: str) -> bool:
        """Does any subscription match `subject`? (nats-py cannot know; callers check for it.)"""
        return self.server.has_interest(subject)

    async def on_error(self, err: Exception) -> None:
        self.server.callback_errors += 1
        if self._on_error is not None:
            await self._on_error(err)
        else:
            logging.getLogger("prorsa.inproc").error("%s: subscription callback failed: %r", self.name, err, exc_info=err)

    async def publish(self, subject: str, payload: bytes = b"", reply: str = "", headers=None) -> None:
        self.publish_now(subject, payload, reply, headers)

    def publish_now(self, subject: str, payload: bytes = b"", reply: str = "", headers=None) -> None:
        """`publish` as a plain call: the in-process bus stores and delivers on the spot."""
        stream = self.server.stream_for(subject)
        if stream is not None:
            stream.store(subject, payload, headers, self.server.time())
        self.server.deliver_now(subject, payload, reply, headers)

    async def subscribe(self, subject: str, queue: str = "", cb: MsgCallback | None = None, **_) -> _CoreSub:
        sub = _CoreSub(self, subject, cb)
        self.server.add_sub(sub)
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
