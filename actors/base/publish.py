"""At-least-once JetStream publishing for work items, results and training messages.

``publish_durable`` retries until the stream acks (same ``Nats-Msg-Id`` on every try, so
the stream stores the message once), counting each retry. It gives up when the actor is
stopping (``PublishAborted``), or when another try could land after the stream's duplicate
window (``PublishFailed``, counted as ``publish_failures``): past that window a retry of a
publish that was stored but whose ack was lost would be stored twice. Either way it raises,
so the caller leaves its input un-acked for redelivery (an actor that cannot publish for
that long stops, and the launcher restarts it).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from nats.js.client import JetStreamContext
from nats.js.errors import ServiceUnavailableError

from actors.base.clock import Clock
from actors.base.connection import BUS_ERRORS
from bus_schemas.streams import DUPLICATE_WINDOW_S

ACK_TIMEOUT_WALL_S = 5.0
_RETRY_WALL_S = 0.25
# the last try must be acked (or time out) inside the duplicate window, with a margin
GIVE_UP_WALL_S = DUPLICATE_WINDOW_S - 2 * ACK_TIMEOUT_WALL_S


class PublishAborted(RuntimeError):
    """The actor stopped before the stream acked the publish."""


class PublishFailed(PublishAborted):
    """No try was acked before another could outlive the stream's duplicate window."""


async def publish_durable(
    js: JetStreamContext,
    subject: str,
    data: bytes,
    msg_id: str,
    counters: Counter,
    log: logging.Logger,
    stopping: asyncio.Event,
    clock: Clock,
    give_up_wall_s: float = GIVE_UP_WALL_S,
):
    """The stream's ack (its `duplicate` says the message was already stored under `msg_id`).
    `give_up_wall_s`: no try starts later than this after the first one that could still
    be unacked when the duplicate window (from the first try) closes."""
    attempt = 0
    first_s = clock.now_s()
    while True:
        try:
            return await js.publish(subject, data, timeout=clock.loop_s(ACK_TIMEOUT_WALL_S), headers={"Nats-Msg-Id": msg_id})
        except BUS_ERRORS as err:  # bus trouble: count, log, retry with the same id
            attempt += 1
            counters["publish_retries"] += 1
            if attempt in (1, 10, 100):
                log.warning("publish to %s failed (attempt %d): %s", subject, attempt, err)
            if stopping.is_set():
                raise PublishAborted(f"stopped before {subject} acked {msg_id}") from err
            elapsed_wall_s = (clock.now_s() - first_s) / clock.time_scale
            if elapsed_wall_s + _RETRY_WALL_S + ACK_TIMEOUT_WALL_S > give_up_wall_s:
                counters["publish_failures"] += 1
                log.error(
                    "publish to %s (id %s) not acked after %d tries in %.0f s: giving up inside the duplicate window",
                    subject,
                    msg_id,
                    attempt,
                    elapsed_wall_s,
                )
                raise PublishFailed(f"{subject} did not ack {msg_id} within {give_up_wall_s:g} s") from err
            await clock.sleep_wall(_RETRY_WALL_S)


async def pull_one(sub, timeout_wall_s: float):
    """The next message of a pull consumer, or None after `timeout_wall_s`.

    One message per pull request, on purpose: nats-py's batch fetch holds back the first
    message until the whole batch arrives or the request expires, which would add up to a
    full poll interval of latency to every hand-off. A single-message pull returns the
    moment the message is there (one loopback round trip each).
    """
    try:
        return (await sub.fetch(1, timeout=timeout_wall_s))[0]
    except (TimeoutError, ServiceUnavailableError):  # nothing yet, or a stream electing its leader
        task = asyncio.current_task()
        if task is not None and task.cancelling():  # nats-py turns a cancelled fetch into a timeout
            raise asyncio.CancelledError from None
        return None
