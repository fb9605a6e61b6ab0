"""Leases: an engine silent for longer than `run.lease_wall_s` is out of routing and
allocation until it reports again. The allocator's ack-timeout path, driven by a real engine
process frozen with SIGSTOP and resumed with SIGCONT."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from actors.allocator.actor import AllocatorActor
from actors.config import Config, with_policy
from actors.engine.actor import EngineActor
from actors.environment.router import Router
from bus_schemas import streams, subjects
from bus_schemas.codec import decode
from bus_schemas.control import Role
from bus_schemas.status import ActorReport, EngineStatus
from tests.actor_helpers import build
from tests.conftest import REPO
from tests.test_switch_protocol import stop, until

SCALE = 100.0  # model seconds per wall second
LEASE_WALL_S = 3.0  # past any stall of a loaded 2-core machine, so only the frozen engine lapses


def status(engine_id: str, role: Role = Role.PREFILL) -> EngineStatus:
    return EngineStatus(
        engine_id=engine_id,
        at_s=0.0,
        role=role,
        epoch=0,
        policy_version=0,
        backend="emulated",
        waiting_prefill=0,
        running_decode=0,
        kv_used_tokens=0,
        kv_capacity_tokens=1,
        held_kv_handles=0,
        busy_fraction=0.0,
    )


def test_the_router_skips_an_engine_past_its_lease_until_it_reports_again():
    router = Router(["e0", "e1"], lease_s=10.0)
    router.observe(status("e0"), seen_at_s=0.0)
    router.observe(status("e1"), seen_at_s=0.0)
    assert router.route("e1", "e1", 1000, 500, now_s=5.0) == "e1"  # its prefix is there, lease fresh
    assert router.route("e1", "e1", 1000, 500, now_s=11.0) is None  # both silent past the lease: shared queue
    router.observe(status("e0"), seen_at_s=11.0)
    assert router.route("e1", "e1", 1000, 500, now_s=12.0) == "e0"  # e1 is out, e0 reported
    assert router.counters()["routed_around_expired"] == 3
    router.observe(status("e1"), seen_at_s=12.5)
    assert router.route("e1", "e1", 1000, 500, now_s=13.0) == "e1"  # back once it reports


def lease_config(config: Config) -> Config:
    config = with_policy(config, "static")  # e0 prefill, e1 decode
    run = msgspec.structs.replace(config.run, time_scale=SCALE, lease_wall_s=LEASE_WALL_S)
    allocator = msgspec.structs.replace(config.allocator, ack_timeout_wall_s=1.0, drain_deadline_s=1.0)
    return msgspec.structs.replace(config, run=run, allocator=allocator)


def start_engine_process(config_path: Path, engine_id: str, role: Role, url: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "actors.engine", "--config", str(config_path), "--id", engine_id, "--role", role.value, "--nats-url", url],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.bus
async def test_a_frozen_engine_times_out_loses_its_lease_and_comes_back_under_a_new_incarnation(bus, nats_server, tiny_config, tmp_path):
    config = lease_config(tiny_config)
    config_path = tmp_path / "config.json"
    config_path.write_bytes(msgspec.json.encode(config))
    e0 = build(EngineActor, "e0", config, bus, Role.PREFILL)
    e0_task = asyncio.create_task(e0.run())
    e1 = start_engine_process(config_path, "e1", Role.PREFILL, nats_server.url)  # drifted: static wants it decoding
    allocator = build(AllocatorActor, "allocator", config, bus)
    try:
        await allocator.setup()
        await until(lambda: {"e0", "e1"} <= set(allocator.statuses), timeout_wall_s=60)
        first = allocator.statuses["e1"].incarnation
        os.kill(e1.pid, signal.SIGSTOP)  # frozen: subscribed, but answers nothing
        [change] = await allocator.decide_once()
        assert (change.engine_id, change.role) == ("e1", Role.DECODE)
        await until(lambda: allocator.counters["unacked_commands"] == 1)  # the ack-timeout path
        assert [(s.engine_id, s.responsive) for s in allocator.fleet().engines] == [("e0", True), ("e1", False)]
        await until(lambda: allocator.lease_expired("e1"))  # silent past its lease
        assert allocator.counters["lease_expiries"] == 1
        assert await allocator.decide_once() == []  # left out of the decisions

        os.kill(e1.pid, signal.SIGCONT)
        await until(lambda: allocator.counters["reregistrations"] == 1)  # a new incarnation
        assert allocator.statuses["e1"].incarnation != first
        await until(lambda: allocator.statuses["e1"].role is Role.DECODE and not allocator.statuses["e1"].switching)
        assert all(s.responsive for s in allocator.fleet().engines)
        assert await allocator.decide_once() == []  # the command it got while frozen was carried out
        assert allocator.counters["switches"] == 0  # its late ack went nowhere: nothing counted twice
    finally:
        if e1.poll() is None:
            os.kill(e1.pid, signal.SIGCONT)
            e1.terminate()
        output, _ = await asyncio.to_thread(e1.communicate, timeout=30)
        await stop((e0, e0_task))
    assert e1.returncode == 0, output
    report = decode(ActorReport, (await bus.jetstream().get_last_msg(streams.REPORTS.name, subjects.report("e1"))).data)
    assert report.counters["lease_lapses"] == 1
    assert "past the lease: re-registering" in output
