"""Faults, end to end: `kill -9` an actor of a real `ops.launch` run; the launcher restarts it
and the run completes with every trajectory the trainer assigned finished exactly once."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import time
from pathlib import Path

import polars as pl
import pytest

from actors.base.connection import close, connect
from bus_schemas import subjects
from bus_schemas.codec import decode
from bus_schemas.lifecycle import LifecycleEvent
from bus_schemas.status import ActorStatus
from ops.checks import incomplete_trajectories
from ops.procs import Supervision
from tests.conftest import write_tiny_config
from tests.test_launch import assert_all_gone, read_until_started, start_launcher

STEPS, TASKS, SAMPLES = 3, 2, 2  # the tiny config's step shape (tests/conftest.py)
ASSIGNED = {f"s{s}-k{k}-g{g}" for s in range(STEPS) for k in range(TASKS) for g in range(SAMPLES)}


def test_supervision_restarts_with_backoff_then_gives_up():
    sup = Supervision("restart", max_restarts=2, backoff_wall_s=0.5)
    assert sup.on_death("engine e1", "engine", -9, 1.0)[0] == 0.5
    assert sup.on_death("engine e1", "engine", -9, 2.0)[0] == 1.0  # doubled
    assert sup.on_death("engine e0", "engine", 1, 2.5)[0] == 0.5  # counted per actor
    delay, why = sup.on_death("engine e1", "engine", -9, 3.0)
    assert delay is None and "max_restarts" in why
    assert sup.restarts == {"engine e1": 2, "engine e0": 1}
    assert [d["restarted"] for d in sup.deaths] == [True, True, True, False]
    assert Supervision("restart", 3, 0.5).on_death("trainer trainer", "trainer", -9, 1.0)[0] is None
    assert Supervision("abort", 3, 0.5).on_death("engine e0", "engine", -9, 1.0)[0] is None


async def wait_for_event(bus_file: Path, kind: str, actor_id: str, step: int, timeout_wall_s: float) -> LifecycleEvent:
    """The first lifecycle event of `kind` emitted by `actor_id` in RL step `step` or later,
    watched on the run's bus with the monitor's (read-only) credentials from DIR/bus.json."""
    bus = json.loads(bus_file.read_text())
    nc = await connect(bus["url"], "fault-injector", logging.getLogger("test"), user=bus.get("user"), password=bus.get("password"))
    seen: asyncio.Future[LifecycleEvent] = asyncio.get_running_loop().create_future()

    async def on_event(msg) -> None:
        event = decode(LifecycleEvent, msg.data)
        if actor_id in (event.actor_id, "*") and (step <= 0 or event.step >= step) and not seen.done():
            seen.set_result(event)

    try:
        await nc.jetstream().subscribe(subjects.lifecycle(kind), cb=on_event, ordered_consumer=True)  # the log from its start
        return await asyncio.wait_for(seen, timeout=timeout_wall_s)
    finally:
        await close(nc)


async def wait_for_allocator_deciding(bus_file: Path, timeout_wall_s: float) -> None:
    """Return once the allocator's heartbeat shows a decision made: it is past its startup
    wait and watches every engine's lease. (A loaded machine starts it after the engines.)"""
    bus = json.loads(bus_file.read_text())
    nc = await connect(bus["url"], "fault-injector", logging.getLogger("test"), user=bus.get("user"), password=bus.get("password"))
    deciding = asyncio.Event()

    async def on_status(msg) -> None:
        if decode(ActorStatus, msg.data).counters.get("decisions", 0) >= 1:
            deciding.set()

    try:
        await nc.subscribe(subjects.status("allocator", "allocator"), cb=on_status)
        await asyncio.wait_for(deciding.wait(), timeout=timeout_wall_s)
    finally:
        await close(nc)


def wait_for_file(path: Path, timeout_wall_s: float) -> None:
    deadline = time.monotonic() + timeout_wall_s
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} not written in {timeout_wall_s} s"
        time.sleep(0.05)  # barrier-ok: polling for the launcher's file


# the allocator of the fault tests: decides every second, no dwell, always a PD split
FAST_PD_ALLOCATOR = '\n[allocator]\ntick_s = 1.0\nmin_dwell_s = 0.0\ncolocation = "never"\n'


def launch_with_fault(
    config: Path, out: Path, moment, fault, *extra: str, timeout_wall_s: float = 240, undo=None
) -> tuple[dict[str, int], str, int]:
    """Launch a run, wait for `moment(bus_file)` (a coroutine), inject `fault(pids)`, and let
    the run finish: (pids, the launcher's output, its exit code). The launcher is killed if
    it is still running when this returns; `undo(pids)` runs first then (a SIGSTOP's SIGCONT)."""
    proc = start_launcher(config, out, *extra)
    pids: dict[str, int] = {}
    try:
        pids, lines = read_until_started(proc)
        wait_for_file(out / "bus.json", 30)
        asyncio.run(moment(out / "bus.json"))
        fault(pids)
        rest, _ = proc.communicate(timeout=timeout_wall_s)
    finally:
        if proc.poll() is None:
            if undo is not None:
                undo(pids)
            proc.kill()
    return pids, "".join(lines) + rest, proc.returncode


@pytest.mark.e2e
@pytest.mark.parametrize(
    "kind, victim, moment, step",
    [
        # the only prefill engine, right after it handed KV off (it holds the KV), in step 1: the
        # new one must load policy 1 before it can take the step's work
        ("engine", "e0", "decode_queued", 1),
        ("engine", "e0", "prefill_started", 0),  # the prefill engine mid-prefill
        ("engine", "e1", "decode_started", 0),  # the only decode engine, mid-decode
        ("environment", "env0", "tool_started", 0),  # the only environment, its trajectories mid-flight
    ],
)
def test_kill_9_an_actor_mid_run_loses_and_duplicates_nothing(tmp_path: Path, kind: str, victim: str, moment: str, step: int):
    config = write_tiny_config(tmp_path / "tiny.toml", steps=STEPS, time_scale=10.0, ack_wait=2.0)
    out = tmp_path / "run"
    pids, output, returncode = launch_with_fault(
        config,
        out,
        lambda bus: wait_for_event(bus, moment, victim, step, timeout_wall_s=60),
        lambda pids: os.kill(pids[f"{kind} {victim}"], signal.SIGKILL),
        "--policy",
        "static-1:1",
    )
    assert returncode == 0, output
    assert f"{kind} {victim} died with exit code -9" in output and f"restarted {kind} {victim} pid" in output
    assert_all_gone(pids)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["restarts"] == {f"{kind} {victim}": 1}
    assert [(d["actor"], d["exit_code"]) for d in summary["actor_deaths"]] == [(f"{kind} {victim}", -9)]
    assert summary["trajectories_expected"] == summary["trajectories_finished"] == len(ASSIGNED)
    assert summary["trajectories_lost"] == 0 and summary["incomplete_trajectories"] == 0, output  # it names what is missing

    events = pl.read_parquet(out / "events.parquet")
    finished = events.filter(pl.col("kind") == "finished")["trajectory_id"].to_list()
    assert sorted(finished) == sorted(ASSIGNED)  # each assigned id finished exactly once in the log
    started = set(events.filter(pl.col("kind") == "started")["trajectory_id"])  # reruns included
    assert started == ASSIGNED  # and nothing else was started
    assert incomplete_trajectories(events, ASSIGNED, disaggregated=True) == {}
    killed_at_s = events.filter((pl.col("kind") == moment) & (pl.col("actor_id") == victim))["at_s"].min()
    after = events.filter((pl.col("actor_id") == victim) & (pl.col("at_s") > killed_at_s + 1.0))
    assert after.filter(pl.col("kind").is_in(["prefill_done", "decode_done", "finished"])).height > 0  # the new one worked
    if kind == "environment":  # its trajectories were rerun from their start, and say so
        reruns = events.filter((pl.col("kind") == "started") & (pl.col("attempt") > 0))
        assert reruns.height > 0 and summary["actors"][victim]["trajectories_rerun"] == reruns.height
    assert summary["actors"]["trainer"].get("duplicate_finished", 0) == 0
    assert summary["dead_letters"] == 0
    if step > 0:
        assert summary["actors"][victim]["policy_caught_up"] == 1


@pytest.mark.e2e
def test_kill_9_the_nats_server_mid_run_restarts_it_on_its_store_and_loses_nothing(tmp_path: Path):
    config = write_tiny_config(tmp_path / "tiny.toml", steps=STEPS, time_scale=10.0, ack_wait=2.0)
    out = tmp_path / "run"
    _, output, returncode = launch_with_fault(
        config,
        out,
        lambda bus: wait_for_event(bus, "decode_queued", "e0", 0, timeout_wall_s=60),  # under load
        lambda pids: os.kill(pids["nats-server"], signal.SIGKILL),
        "--policy",
        "static-1:1",
    )
    assert returncode == 0, output
    assert "nats-server died with exit code -9" in output and "restarted nats-server pid" in output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["restarts"]["nats-server"] == 1
    assert summary["trajectories_finished"] == summary["trajectories_expected"] == len(ASSIGNED)
    assert summary["trajectories_lost"] == 0 and summary["incomplete_trajectories"] == 0
    events = pl.read_parquet(out / "events.parquet")
    assert events["event_id"].n_unique() == events.height  # no acked event stored twice ...
    assert sorted(events.filter(pl.col("kind") == "finished")["trajectory_id"].to_list()) == sorted(ASSIGNED)
    assert incomplete_trajectories(events, ASSIGNED, disaggregated=True) == {}  # ... nor missing
    # trained once each: a finished trajectory whose ack the killed server never stored comes
    # again (at-least-once) and the trainer discards it by id (counted as duplicate_finished)
    assert sum(step["trajectories"] for step in summary["steps"]) == len(ASSIGNED)


@pytest.mark.e2e
def test_kill_9_the_allocator_mid_run_its_successor_continues_above_the_fleet_epoch(tmp_path: Path):
    config = write_tiny_config(tmp_path / "tiny.toml", policy="prorsa", steps=2, time_scale=10.0, ack_wait=2.0)
    config.write_text(config.read_text() + FAST_PD_ALLOCATOR)
    out = tmp_path / "run"
    _, output, returncode = launch_with_fault(
        config,
        out,
        lambda bus: wait_for_event(bus, "role_switched", "*", 0, timeout_wall_s=60),  # a switch carried out
        lambda pids: os.kill(pids["allocator allocator"], signal.SIGKILL),
    )
    assert returncode == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["restarts"] == {"allocator allocator": 1}
    assert summary["trajectories_lost"] == 0 and summary["incomplete_trajectories"] == 0
    assert summary["trajectories_finished"] == summary["trajectories_expected"]
    ups = [
        int(m) for m in re.findall(r"allocator up: policy=\S+, fleet epoch (\d+)", (out / "logs" / "allocator-allocator.log").read_text())
    ]
    assert len(ups) == 2 and ups[0] == 0 and ups[1] >= 1  # the successor started from the fleet's epoch, not 0
    events = pl.read_parquet(out / "events.parquet")
    last_roles = events.filter(pl.col("kind") == "role_switched").group_by("engine_id").agg(pl.col("role").sort_by("at_s").last())
    assert sorted(last_roles["role"].to_list()) == ["decode", "prefill"]  # no engine left in a conflicting role
