"""`pull_one` maps a pull's 'nothing yet' answers to None, and never hides a cancellation.

The subscriptions here are stand-ins for a nats-py pull subscription's `fetch`, to drive the
two answers a real server gives only in a fault (a stream electing its leader answers 503;
nats-py turns a cancelled fetch into a timeout); the bus itself is exercised elsewhere."""

from __future__ import annotations

import asyncio

import pytest
from nats.js.errors import ServiceUnavailableError

from actors.base.publish import pull_one


class _Electing:
    async def fetch(self, batch: int, timeout: float):
        raise ServiceUnavailableError()


class _Swallowing:
    def __init__(self) -> None:
        self.waiting = asyncio.Event()

    async def fetch(self, batch: int, timeout: float):
        self.waiting.set()
        try:
            await asyncio.sleep(3600)  # barrier-ok: a fetch that never answers, until cancelled
        except asyncio.CancelledError:
            raise TimeoutError from None  # what nats-py's fetch does with a cancellation


async def test_a_stream_electing_its_leader_is_nothing_yet() -> None:
    assert await pull_one(_Electing(), 1.0) is None


async def test_a_cancelled_pull_stays_cancelled() -> None:
    sub = _Swallowing()
    task = asyncio.create_task(pull_one(sub, 3600.0))
    await sub.waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
