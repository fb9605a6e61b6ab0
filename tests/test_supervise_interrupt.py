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
    started = []

    async def respawn(spec):  # no actor dies in this test
        raise AssertionError(f"{spec} respawned")

    supervision = Supervision("restart", 3, 0.5)
    run = asyncio.create_task(supervise({}, tmp_path, bus, 0, interrupted, supervision, respawn, {}, server))
    try:
        await asyncio.sleep(0.5)  # barrier-ok: let the supervisor reach its wait before the fault
        original = server.proc.pid
        server.proc.send_signal(signal.SIGINT)  # the group's Ctrl-C reaches the server first ...
        while not supervision.deaths:  # barrier-ok: until the supervisor has counted the death (it then backs off 0.5 s)
            await asyncio.sleep(0.01)
        interrupted.set()  # ... and the launcher's own handler runs during the restart's backoff
        status = await asyncio.wait_for(run, timeout=30)
        started.append(server.proc.pid)
    finally:
        server.stop()
    assert status == "interrupted"
    assert started == [original] and server.proc.poll() is not None  # never started again
