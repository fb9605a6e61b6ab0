"""Ctrl-C reaches the embedded nats-server too (one process group): a server that dies while
the launcher is being interrupted is not restarted, so nothing outlives the launcher."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from actors.base.connection import close
from bus_schemas import streams
from ops.launch import Bus
from ops.natsserver import EmbeddedNats
from ops.procs import Supervision
from ops.supervise import supervise

pytestmark = pytest.mark.bus

POLL_DEADLINE_WALL_S = 30.0  # each wait on the supervisor's state below fails after this


async def until(condition, run: asyncio.Task, what: str) -> None:
    """Poll the supervisor's state until `condition()`; fail if it ends first or takes too long."""
    try:
        async with asyncio.timeout(POLL_DEADLINE_WALL_S):
            while not condition():
                if run.done():
                    raise AssertionError(f"the supervisor ended ({run.result()!r}) before {what}")
                await asyncio.sleep(0.01)  # barrier-ok: polls the supervisor's state, under the deadline above
    except TimeoutError:
        raise AssertionError(f"{what}: not within {POLL_DEADLINE_WALL_S} s") from None


async def test_a_server_that_dies_while_interrupted_is_not_restarted(tmp_path: Path):
    server = EmbeddedNats(tmp_path / "nats")
    bus = Bus(server.start())
    nc = await bus.connect("setup")
    await streams.ensure_streams(nc.jetstream())
    await close(nc)
    interrupted = asyncio.Event()

    async def respawn(spec):  # no actor dies in this test
        raise AssertionError(f"{spec} respawned")

    supervision = Supervision("restart", 3, 0.5)
    notes: dict = {}
    run = asyncio.create_task(supervise({}, tmp_path, bus, 0, interrupted, supervision, respawn, notes, server))
    try:
        await until(lambda: "lifecycle_alerts" in notes, run, "the supervisor is watching")  # it notes its alerts then
        original = server.proc.pid
        server.proc.send_signal(signal.SIGINT)  # the group's Ctrl-C reaches the server first ...
        await until(lambda: bool(supervision.deaths), run, "the supervisor counted the death")  # it then backs off 0.5 s
        interrupted.set()  # ... and the launcher's own handler runs during the restart's backoff
        status = await asyncio.wait_for(run, timeout=30)
    finally:
        if not run.done():  # a failed wait above: leave no supervisor behind
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
        server.stop()
    assert status == "interrupted"
    assert server.proc.pid == original and server.proc.poll() is not None  # never started again
