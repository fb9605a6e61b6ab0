"""What the launcher watches on the bus during a run: dead letters and the lifecycle log's fill.

Dead letters: work that `max_deliver` deliveries did not get acked, moved out of its queue.

    $JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>  (NATS, when a consumer gives up)
        ──▶ DeadLetters: the message, read by its stream sequence
        ──▶ prorsa.dead.<stream> (DEAD stream, kept) with the reason in its headers
        ──▶ deleted from the work queue

The launcher runs one for the whole run. A dead-lettered task assignment means a trajectory
that cannot finish: the run fails, naming it, instead of waiting forever.

The lifecycle log's fill: a LIFECYCLE stream with a size limit refuses new events when full
(`discard: new`, so nothing logged is ever dropped); `LifecycleFill` alerts at 90% and when full.
"""

from __future__ import annotations

import asyncio
import json
import logging

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from actors.base.connection import BUS_ERRORS
from actors.base.tasks import stop_if_cancelled
from bus_schemas import streams, subjects

REASON_HEADER = "Prorsa-Dead-Reason"
SUBJECT_HEADER = "Prorsa-Dead-Subject"  # where the message was published
LOG = logging.getLogger("prorsa.bus_guard")
FILL_WARN = 0.9  # share of the LIFECYCLE stream's limit that raises the first alert


class DeadLetters:
    def __init__(self, nc: NATS, log: logging.Logger = LOG) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.log = log
        self.moved = 0
        self.errors = 0
        self.fatal = asyncio.Event()  # a task assignment was dead-lettered: the run cannot complete
        self.fatal_reason = ""

    async def start(self) -> None:
        await self.nc.subscribe(subjects.max_deliveries_advisory(), cb=self._on_advisory)

    async def _on_advisory(self, msg: Msg) -> None:
        try:
            advisory = json.loads(msg.data)
            stream, consumer, seq = advisory["stream"], advisory["consumer"], int(advisory["stream_seq"])
        except (ValueError, KeyError, TypeError) as err:
            self.errors += 1
            self.log.error("unreadable max-deliveries advisory on %s: %s", msg.subject, err)
            return
        reason = f"not acked after {advisory.get('deliveries', '?')} deliveries (consumer {consumer}, max_deliver)"
        try:
            await self.move(stream, seq, reason)
        except BUS_ERRORS as err:
            self.errors += 1
            self.log.error("could not dead-letter %s #%d: %r", stream, seq, err)

    async def move(self, stream: str, seq: int, reason: str) -> None:
        """Copy message `seq` of `stream` to the dead-letter subject with `reason`, then delete it."""
        try:
            stored = await self.js.get_msg(stream, seq)
        except NotFoundError:
            return  # acked (or moved) meanwhile
        headers = {REASON_HEADER: reason, SUBJECT_HEADER: stored.subject or "", "Nats-Msg-Id": f"dead/{stream}/{seq}"}
        await self.js.publish(subjects.dead_letter(stream), stored.data or b"", headers=headers)
        await self.js.delete_msg(stream, seq)
        self.moved += 1
        self.log.error("dead-lettered %s #%d (%s): %s", stream, seq, stored.subject, reason)
        if stream == streams.TASKS.name:
            self.fatal_reason = f"task assignment {stored.subject} #{seq} dead-lettered: {reason}"
            self.fatal.set()


async def read_dead_letters(js) -> list[dict]:
    """Every dead letter of the run: {subject, stream, reason, bytes}."""
    info = await streams.answered(lambda: js.stream_info(streams.DEAD.name))
    letters = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        try:
            msg = await streams.answered(lambda: js.get_msg(streams.DEAD.name, seq))  # noqa: B023 (awaited at once)
        except NotFoundError:
            continue
        headers = msg.headers or {}
        letters.append(
            {
                "subject": headers.get(SUBJECT_HEADER, ""),
                "stream": (msg.subject or "").rsplit(".", 1)[-1],
                "reason": headers.get(REASON_HEADER, ""),
                "bytes": len(msg.data or b""),
            }
        )
    return letters


class LifecycleFill:
    """Alerts (once each) when the LIFECYCLE stream reaches 90% of its limit and when it is full."""

    def __init__(self, js, alert) -> None:
        self.js = js
        self.alert = alert  # called with one line of text
        self.alerts: list[str] = []

    async def check(self) -> float:
        """The stream's fill (0..1; 0 without a limit); alert on crossing 90% and 100%."""
        info = await self.js.stream_info(streams.LIFECYCLE.name)
        shares = [
            used / limit
            for used, limit in ((info.state.bytes, info.config.max_bytes), (info.state.messages, info.config.max_msgs))
            if limit and limit > 0
        ]
        fill = max(shares, default=0.0)
        for level, text in (
            (1.0, "full: new lifecycle events are refused (discard new) and retried; raise bus.lifecycle_max_bytes/_msgs"),
            (FILL_WARN, "90% full"),
        ):
            if fill >= level:
                line = f"the LIFECYCLE stream is {text} ({info.state.messages} events, {info.state.bytes} bytes)"
                if not any(a.startswith(f"the LIFECYCLE stream is {text}") for a in self.alerts):
                    self.alerts.append(line)
                    self.alert(line)
                break
        return fill

    async def watch(self, period_wall_s: float = 1.0) -> None:
        while True:
            try:
                await self.check()
            except BUS_ERRORS as err:
                LOG.warning("could not read the LIFECYCLE stream's fill: %r", err)
            stop_if_cancelled()  # a cancel the request swallowed (actors/base/tasks.py)
            await asyncio.sleep(period_wall_s)
