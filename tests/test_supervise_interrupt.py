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
        while "lifecycle_alerts" not in notes:  # the supervisor is connected and watching (it notes its alerts then)
            await asyncio.sleep(0.01)  # barrier-ok: polls the supervisor's state, not a time
        original = server.proc.pid
        server.proc.send_signal(signal.SIGINT)  # the group's Ctrl-C reaches the server first ...
        while not supervision.deaths:  # the supervisor has counted the death (it then backs off 0.5 s)
            await asyncio.sleep(0.01)  # barrier-ok: polls the supervisor's state, not a time
        interrupted.set()  # ... and the launcher's own handler runs during the restart's backoff
        status = await asyncio.wait_for(run, timeout=30)
    finally:
        server.stop()
    assert status == "interrupted"
    assert server.proc.pid == original and server.proc.poll() is not None  # never started again
