"""The in-process bus keeps each consumer's count of messages still to deliver
(`num_pending`, read on every prefill step by the PD admission gate) as messages are stored,
delivered, acked, terminated, given back and purged: it always equals a count over the
stream."""

from __future__ import annotations

import asyncio
import random

import pytest
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import api

from actors.base.inproc import InProcServer
from actors.base.virtual import VirtualTimeLoop

SUBJECTS = ("q.work.a", "q.work.b", "q.other")


async def _drive(seed: int, retention: api.RetentionPolicy) -> int:
    rng = random.Random(seed)
    server = InProcServer()
    nc = server.connect("t")
    js = nc.jetstream()
    await js.add_stream(name="Q", subjects=["q.>"], retention=retention)
    explicit = api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT, ack_wait=5.0)
    subs = [await js.pull_subscribe("q.work.a", durable="a", config=explicit)]
    subs.append(
        await js.pull_subscribe("q.work.b", durable="b", config=api.ConsumerConfig(ack_policy=api.AckPolicy.EXPLICIT, ack_wait=5.0))
    )
    if retention != api.RetentionPolicy.WORK_QUEUE:  # overlapping and ack-less consumers, where a work queue allows none
        subs.append(await js.pull_subscribe("q.>", durable="all", config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE)))
    consumers = [sub._consumer for sub in subs]
    held = []  # delivered, not yet acked
    checks = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.4:
            await js.publish(rng.choice(SUBJECTS), b"x")
        elif op < 0.65:
            try:
                held += await rng.choice(subs).fetch(rng.randint(1, 3), timeout=rng.choice([0.0, 0.5]))
            except NatsTimeoutError:
                pass
        elif op < 0.8 and held:
            msg = held.pop(rng.randrange(len(held)))
            await rng.choice([msg.ack, msg.term, msg.nak])()
        elif op < 0.9:  # a pull handed a message, then cancelled: it is given back
            sub = rng.choice(subs)
            fetch = asyncio.ensure_future(sub.fetch(1, timeout=1.0))
            await asyncio.sleep(0)  # barrier-ok: the pull is open
            await js.publish(rng.choice(SUBJECTS), b"y")
            fetch.cancel()
            try:
                held += await fetch
            except (asyncio.CancelledError, NatsTimeoutError):
                pass
        elif op < 0.93:
            await js.purge_stream("Q")
            held.clear()
        else:
            await asyncio.sleep(rng.choice([1.0, 6.0]))  # barrier-ok: virtual time, past the ack wait: redeliveries
        for consumer in consumers:
            assert consumer.num_pending() == consumer.count_undelivered()
            checks += 1
    return checks


@pytest.mark.parametrize("retention", [api.RetentionPolicy.WORK_QUEUE, api.RetentionPolicy.LIMITS])
@pytest.mark.parametrize("seed", range(6))
def test_the_kept_pending_count_equals_a_count_over_the_stream(seed, retention):
    loop = VirtualTimeLoop()
    try:
        assert loop.run_until_complete(_drive(seed, retention)) > 0
    finally:
        loop.close()
