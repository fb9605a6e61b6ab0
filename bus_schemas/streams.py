"""Every JetStream stream and durable consumer Prorsa uses, defined in one place.

Work queues (prefill, decode, tasks, results) use work-queue retention: a message leaves
the stream when a consumer acks it, and un-acked work is redelivered after ``ack_wait``
(a crashed engine loses nothing). The lifecycle log, the training record and the final
reports use limits retention: they are the run's history.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import BadRequestError, NotFoundError

from bus_schemas import subjects

DUPLICATE_WINDOW_S = 120.0  # Nats-Msg-Id deduplication window


@dataclass(frozen=True, slots=True)
class StreamDef:
    name: str
    subjects: tuple[str, ...]
    work_queue: bool

    def config(self) -> api.StreamConfig:
        return api.StreamConfig(
            name=self.name,
            subjects=list(self.subjects),
            retention=api.RetentionPolicy.WORK_QUEUE if self.work_queue else api.RetentionPolicy.LIMITS,
            storage=api.StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
        )


LIFECYCLE = StreamDef("LIFECYCLE", (subjects.lifecycle_all(),), work_queue=False)
WORK_PREFILL = StreamDef(
    "WORK_PREFILL", (subjects.work_prefill(), subjects.work_prefill() + ".*"), work_queue=True
)
WORK_DECODE = StreamDef("WORK_DECODE", (subjects.work_decode(), subjects.work_decode() + ".*"), work_queue=True)
RESULTS = StreamDef("RESULTS", (subjects.result_all(),), work_queue=True)
TASKS = StreamDef("TASKS", (subjects.train_tasks(),), work_queue=True)
TRAIN = StreamDef(
    "TRAIN", (subjects.train_finished(), subjects.train_policy(), subjects.train_step()), work_queue=False
)
REPORTS = StreamDef("REPORTS", (subjects.report_all(),), work_queue=False)

ALL_STREAMS = (LIFECYCLE, WORK_PREFILL, WORK_DECODE, RESULTS, TASKS, TRAIN, REPORTS)


@dataclass(frozen=True, slots=True)
class ConsumerDef:
    """A durable pull consumer with explicit acks."""

    stream: StreamDef
    durable: str
    filter_subject: str

    def config(self, ack_wait_s: float) -> api.ConsumerConfig:
        return api.ConsumerConfig(
            durable_name=self.durable,
            name=self.durable,
            filter_subject=self.filter_subject,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait_s,
            deliver_policy=api.DeliverPolicy.ALL,
            max_ack_pending=-1,
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


async def ensure_streams(js: JetStreamContext) -> None:
    """Create every stream, or bring an existing one to this definition. Idempotent."""
    for stream in ALL_STREAMS:
        try:
            await js.stream_info(stream.name)
        except NotFoundError:
            try:
                await js.add_stream(stream.config())
            except BadRequestError as err:  # another actor created it between the two calls
                if "already in use" not in str(err):
                    raise
        else:
            await js.update_stream(stream.config())


async def pull_subscription(js: JetStreamContext, consumer: ConsumerDef, ack_wait_s: float):
    """Bind to (creating if needed) a durable pull consumer."""
    return await js.pull_subscribe(
        consumer.filter_subject,
        durable=consumer.durable,
        stream=consumer.stream.name,
        config=consumer.config(ack_wait_s),
    )
