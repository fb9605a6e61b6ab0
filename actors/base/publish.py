"""At-least-once JetStream publishing for work items, results and training messages.

``publish_durable`` retries until the stream acks (same ``Nats-Msg-Id`` on every try, so
the stream stores the message once), counting each retry; it gives up only when the actor
is stopping, and then raises so the caller leaves its input un-acked for redelivery.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter

from nats.js.client import JetStreamContext

from actors.base.clock import Clock
from actors.base.connection import BUS_ERRORS

_ACK_TIMEOUT_WALL_S = 5.0
_RETRY_WALL_S = 0.25


class PublishAborted(RuntimeError):
    """The actor stopped before the stream acked the publish."""


async def publish_durable(
    js: JetStreamContext,
    subject: str,
    data: bytes,
    msg_id: str,
    counters: Counter,
    log: logging.Logger,
    stopping: asyncio.Event,
    clock: Clock,
) -> None:
    attempt = 0
    while True:
        try:
            await js.publish(subject, data, timeout=clock.loop_s(_ACK_TIMEOUT_WALL_S), headers={"Nats-Msg-Id": msg_id})
            return
        except BUS_ERRORS as err:  # bus trouble: count, log, retry with the same id
            attempt += 1
            counters["publish_retries"] += 1
            if attempt in (1, 10, 100):
                log.warning("publish to %s failed (attempt %d): %s", subject, attempt, err)
            if stopping.is_set():
                raise PublishAborted(f"stopped before {subject} acked {msg_id}") from err
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
    except TimeoutError:
        return None
