"""Every JetStream stream and durable consumer Prorsa uses, defined in one place.

Work queues (prefill, decode, tasks, results) use work-queue retention: a message leaves
the stream when a consumer acks it, and un-acked work is redelivered after ``ack_wait``
(a crashed engine loses nothing), at most ``max_deliver`` times: a message no consumer acks
by then (a poison message) is moved to the DEAD stream with the reason (the launcher does
this, `ops/deadletter.py`). The lifecycle log, the training record, the final reports and
the dead letters use limits retention: they are the run's history. The LIFECYCLE stream's
storage and size are `LifecycleLimits`; a full one refuses new events (`discard: new`), and
the launcher alerts, so nothing already logged is ever dropped.

On a JetStream cluster every stream (and so every durable consumer, which inherits it) is
stored on `replicas` servers (`[bus] replicas`: 3 on a 3-server cluster keeps every stream,
its acks and its redeliveries through the loss of one server); 1 on a lone server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError, NoStreamResponseError, NotFoundError, ServiceUnavailableError

from bus_schemas import subjects

DUPLICATE_WINDOW_S = 120.0  # Nats-Msg-Id deduplication window
DEFAULT_MAX_DELIVER = 10  # deliveries of one work item before it is dead-lettered (run.max_deliver)
DEFAULT_REPLICAS = 1  # servers holding each stream ([bus] replicas)
JETSTREAM_READY_TRIES = 12  # a starting cluster's JetStream API answers within about a minute (5 s request timeout each)
JETSTREAM_RETRY_WALL_S = 0.5
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LifecycleLimits:
    """How the LIFECYCLE stream is stored (`[bus]` in the config). -1: no limit."""

    storage: str = "file"  # "file" (survives a server crash) or "memory"
    max_bytes: int = -1
    max_msgs: int = -1


@dataclass(frozen=True, slots=True)
class StreamDef:
    name: str
    subjects: tuple[str, ...]
    work_queue: bool

    def config(self, limits: LifecycleLimits | None = None, replicas: int = DEFAULT_REPLICAS) -> api.StreamConfig:
        """`limits` apply to the LIFECYCLE stream (with `discard: new`: a full log refuses, never drops)."""
        config = api.StreamConfig(
            name=self.name,
            num_replicas=replicas,
            subjects=list(self.subjects),
            retention=api.RetentionPolicy.WORK_QUEUE if self.work_queue else api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
        )
        if self.name == "LIFECYCLE":
            config.discard = api.DiscardPolicy.NEW
            if limits is not None:
                config.storage = api.StorageType(limits.storage)
                config.max_bytes = limits.max_bytes
                config.max_msgs = limits.max_msgs
        return config


LIFECYCLE = StreamDef("LIFECYCLE", (subjects.lifecycle_all(),), work_queue=False)
WORK_PREFILL = StreamDef("WORK_PREFILL", (subjects.work_prefill(), subjects.work_prefill() + ".*"), work_queue=True)
WORK_DECODE = StreamDef("WORK_DECODE", (subjects.work_decode(), subjects.work_decode() + ".*"), work_queue=True)
RESULTS = StreamDef("RESULTS", (subjects.result_all(),), work_queue=True)
TASKS = StreamDef("TASKS", (subjects.train_tasks(),), work_queue=True)
TRAIN = StreamDef("TRAIN", (subjects.train_finished(), subjects.train_policy(), subjects.train_step()), work_queue=False)
REPORTS = StreamDef("REPORTS", (subjects.report_all(),), work_queue=False)
DEAD = StreamDef("DEAD", (subjects.dead_letter_all(),), work_queue=False)

ALL_STREAMS = (LIFECYCLE, WORK_PREFILL, WORK_DECODE, RESULTS, TASKS, TRAIN, REPORTS, DEAD)


@dataclass(frozen=True, slots=True)
class ConsumerDef:
    """A durable pull consumer with explicit acks."""

    stream: StreamDef
    durable: str
    filter_subject: str

    def config(self, ack_wait_s: float, max_deliver: int = DEFAULT_MAX_DELIVER) -> api.ConsumerConfig:
        return api.ConsumerConfig(
            durable_name=self.durable,
            name=self.durable,
            filter_subject=self.filter_subject,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            deliver_policy=api.DeliverPolicy.ALL,
            max_ack_pending=-1,
            max_deliver=max_deliver,
        )


def prefill_consumer() -> ConsumerDef:
    return ConsumerDef(WORK_PREFILL, "prefill", subjects.work_prefill())


def affinity_consumer(engine_id: str) -> ConsumerDef:
    """Turns routed to one engine because it holds their trajectory's prefix."""
    return ConsumerDef(WORK_PREFILL, f"prefill-{engine_id}", subjects.work_prefill(engine_id))


def decode_consumer() -> ConsumerDef:
    return ConsumerDef(WORK_DECODE, "decode", subjects.work_decode())


def tasks_consumer() -> ConsumerDef:
    return ConsumerDef(TASKS, "environments", subjects.train_tasks())


def results_consumer(env_id: str) -> ConsumerDef:
    return ConsumerDef(RESULTS, f"results-{env_id}", subjects.result(env_id))


def finished_consumer() -> ConsumerDef:
    return ConsumerDef(TRAIN, "trainer-finished", subjects.train_finished())


async def ensure_streams(js: JetStreamContext, limits: LifecycleLimits | None = None, replicas: int | None = None) -> None:
    """Create every stream, or bring an existing one to this definition. Idempotent. Without
    `limits`, an existing LIFECYCLE stream keeps the storage and size its creator (the
    launcher) gave it; without `replicas`, an existing stream keeps its replica count (a new
    one gets DEFAULT_REPLICAS). A JetStream API that does not answer yet (a cluster still
    electing its meta leader: a timeout or a 503) is asked again, JETSTREAM_READY_TRIES times."""
    await answered(lambda: _ensure_streams(js, limits, replicas))


async def answered(call: Callable[[], Awaitable[T]]) -> T:
    """`call()`'s result, asking again while JetStream does not answer, up to
    JETSTREAM_READY_TRIES times: a cluster electing a leader after a server died or started
    (a timeout or a 503), or a stream created a moment ago whose leader is not elected yet
    (a publish gets no response from the stream)."""
    for attempt in range(1, JETSTREAM_READY_TRIES + 1):
        try:
            return await call()
        except (TimeoutError, ServiceUnavailableError, NoStreamResponseError):
            if attempt == JETSTREAM_READY_TRIES:
                raise
            await asyncio.sleep(JETSTREAM_RETRY_WALL_S)
    raise AssertionError("unreachable")


async def _ensure_streams(js: JetStreamContext, limits: LifecycleLimits | None, replicas: int | None) -> None:
    for stream in ALL_STREAMS:
        try:
            info = await js.stream_info(stream.name)
        except NotFoundError:
            try:
                await js.add_stream(stream.config(limits, replicas or DEFAULT_REPLICAS))
            except BadRequestError as err:  # another actor created it between the two calls
                if "already in use" not in str(err):
                    raise
        else:
            keep = limits
            if keep is None and stream is LIFECYCLE:
                have = info.config
                keep = LifecycleLimits(api.StorageType(have.storage or "file").value, have.max_bytes or -1, have.max_msgs or -1)
            keep_replicas = replicas or info.config.num_replicas or DEFAULT_REPLICAS
            await js.update_stream(stream.config(keep if stream is LIFECYCLE else None, keep_replicas))


async def pull_subscription(js: JetStreamContext, consumer: ConsumerDef, ack_wait_s: float, max_deliver: int = DEFAULT_MAX_DELIVER):
    """Bind to (creating if needed) a durable pull consumer."""
    return await js.pull_subscribe(
        consumer.filter_subject,
        durable=consumer.durable,
        stream=consumer.stream.name,
        config=consumer.config(ack_wait_s, max_deliver),
    )
