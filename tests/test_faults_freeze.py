"""Faults, end to end: SIGSTOP an engine of a real `ops.launch` run past its lease, then
SIGCONT. The fleet counts it out, it re-registers, its late work counts nowhere twice, and
the run completes with every assigned trajectory finished exactly once."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import polars as pl
import pytest

from ops.checks import incomplete_trajectories
from tests.conftest import write_tiny_config
from tests.test_faults_restart import FAST_PD_ALLOCATOR, launch_with_fault, wait_for_allocator_deciding, wait_for_event
from tests.test_launch import assert_all_gone

pytestmark = pytest.mark.e2e
STEPS = 2
ASSIGNED = {f"s{s}-k{k}-g{g}" for s in range(STEPS) for k in range(2) for g in range(2)}
LEASE_WALL_S = 3.0  # past any stall of a loaded 2-core machine, so only the frozen engine lapses
ACK_WAIT_WALL_S = 2.0


def test_sigstop_an_engine_past_its_lease_then_sigcont_double_counts_nothing(tmp_path: Path):
    config = write_tiny_config(tmp_path / "tiny.toml", policy="prorsa", steps=STEPS, time_scale=10.0, ack_wait=ACK_WAIT_WALL_S)
    text = config.read_text().replace("ack_wait_wall_s", f"lease_wall_s = {LEASE_WALL_S}\nack_wait_wall_s", 1)
    config.write_text(text + FAST_PD_ALLOCATOR)
    out = tmp_path / "run"

    victim: list[str] = []  # the first engine seen decoding: which one depends on the allocator's first split

    def freeze(pids: dict[str, int]) -> None:
        os.kill(pids[f"engine {victim[0]}"], signal.SIGSTOP)
        time.sleep(LEASE_WALL_S + ACK_WAIT_WALL_S + 1.0)  # barrier-ok: the fault's length (past lease and ack wait), not a barrier
        os.kill(pids[f"engine {victim[0]}"], signal.SIGCONT)

    async def moment(bus: Path) -> None:  # an engine decoding, and the allocator watching its lease
        victim.append((await wait_for_event(bus, "decode_started", "*", 0, timeout_wall_s=60)).actor_id)
        await wait_for_allocator_deciding(bus, timeout_wall_s=120)

    pids, output, returncode = launch_with_fault(
        config,
        out,
        moment,
        freeze,
        undo=lambda pids: victim and os.kill(pids[f"engine {victim[0]}"], signal.SIGCONT),
    )
    assert returncode == 0, output
    assert_all_gone(pids)

    summary = json.loads((out / "summary.json").read_text())
    actors = summary["actors"]
    assert summary["status"] == "completed" and summary["restarts"] == {}  # frozen, not dead
    assert summary["trajectories_finished"] == summary["trajectories_expected"] == len(ASSIGNED)
    assert summary["trajectories_lost"] == 0 and summary["incomplete_trajectories"] == 0 and summary["dead_letters"] == 0
    assert actors[victim[0]]["lease_lapses"] == 1  # it noticed its own lapse ...
    assert actors["allocator"]["lease_expiries"] >= 1  # ... the allocator counted it out ...
    assert actors["allocator"]["reregistrations"] >= 1  # ... and took it back under its new incarnation
    assert actors["trainer"].get("duplicate_finished", 0) == 0

    events = pl.read_parquet(out / "events.parquet")
    assert sorted(events.filter(pl.col("kind") == "finished")["trajectory_id"].to_list()) == sorted(ASSIGNED)
    assert incomplete_trajectories(events, ASSIGNED, disaggregated=None) == {}
    results = events.filter(pl.col("kind") == "decode_done").group_by("trajectory_id", "turn").len()
    turns = events.filter(pl.col("kind") == "tool_done").height + len(ASSIGNED)  # turns the environments used
    assert results.height == turns  # a decode for every turn the environments took, none for a turn they did not
