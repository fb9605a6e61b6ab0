"""On the in-process bus an actor builds its heartbeat only while someone subscribes to it:
a simulated colocated fleet has no listener, and the status it skips is seen by nobody."""

from __future__ import annotations

import asyncio
from pathlib import Path

from actors.base import Actor
from actors.base.inproc import InProcServer
from actors.base.virtual import LoopClock, VirtualTimeLoop
from actors.config import load_config
from bus_schemas import subjects
from bus_schemas.status import ActorStatus
from tests.conftest import write_tiny_config


class Counting(Actor):
    kind = "environment"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.built = 0

    def heartbeat(self) -> ActorStatus:
        self.built += 1
        return ActorStatus(actor_id=self.actor_id, kind=self.kind, at_s=self.clock.now_s())


def test_heartbeats_are_built_only_while_someone_listens(tmp_path: Path):
    config = load_config(write_tiny_config(tmp_path / "c.toml"))

    async def main() -> tuple[int, int, int]:
        server = InProcServer()
        actor = Counting("env0", config, server.connect("env0"), LoopClock(config.run.time_scale))
        for _ in range(3):
            await actor.publish_heartbeat()
        unheard = actor.built
        seen: list[bytes] = []

        async def on_status(msg) -> None:
            seen.append(msg.data)

        watcher = server.connect("watcher")
        sub = await watcher.subscribe(subjects.status_of_kind("environment"), cb=on_status)
        for _ in range(3):
            await actor.publish_heartbeat()
        for _ in range(1000):  # the subscription's task delivers them
            if len(seen) >= 3:
                break
            await asyncio.sleep(0)  # barrier-ok: yields to the subscription's task, no time passes
        else:
            raise AssertionError(f"{len(seen)} of 3 heartbeats delivered after 1000 loop turns")
        await sub.unsubscribe()
        return unheard, actor.built, len(seen)

    loop = VirtualTimeLoop()
    try:
        unheard, built, delivered = loop.run_until_complete(main())
    finally:
        loop.close()
    assert unheard == 0
    assert built == delivered == 3
