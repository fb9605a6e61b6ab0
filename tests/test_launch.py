"""End to end: `python -m ops.launch` with every actor in its own process."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import polars as pl
import psutil
import pytest

from ops.checks import incomplete_trajectories
from tests.conftest import REPO, write_tiny_config
from tests.subproc import read_until

pytestmark = pytest.mark.e2e


def start_launcher(config: Path, out: Path, *extra: str) -> subprocess.Popen:
    """In its own process group, like a command typed at a terminal."""
    return subprocess.Popen(
        [sys.executable, "-m", "ops.launch", str(config), "--out", str(out), *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        start_new_session=True,
    )


STARTED = re.compile(r"started (.+?) pid (\d+)")
START_DEADLINE_WALL_S = 180.0  # every actor started (a loaded 2-core machine: tens of seconds)


def read_until_started(proc: subprocess.Popen) -> tuple[dict[str, int], list[str]]:
    """Launcher output up to the trainer's start: {'engine e0': pid, ..., 'nats-server': pid}.
    A launcher that ends or hangs first fails the test with its output (tests/subproc.py)."""
    lines = read_until(proc, lambda seen: seen[-1].startswith("started trainer trainer pid "), START_DEADLINE_WALL_S)
    return {m.group(1): int(m.group(2)) for line in lines if (m := STARTED.match(line))}, lines


def assert_all_gone(pids: dict[str, int]) -> None:
    alive = []
    for name, pid in pids.items():
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(name)
        except psutil.NoSuchProcess:
            pass
    assert not alive, f"left behind: {alive}"


def launch_to_completion(config: Path, out: Path, timeout_wall_s: float = 240) -> dict:
    """Launch, wait for the end, and check it ended cleanly (exit 0, no process left, run
    completed, nothing lost or incomplete); the run's summary."""
    proc = start_launcher(config, out)
    pids, lines = read_until_started(proc)
    rest, _ = proc.communicate(timeout=timeout_wall_s)
    assert proc.returncode == 0, "".join(lines) + rest
    assert_all_gone(pids)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["trajectories_lost"] == 0 and summary["incomplete_trajectories"] == 0
    return summary


@pytest.mark.parametrize("policy", ["colocated", "static-1:1"])
def test_small_run_finishes_every_trajectory_and_logs_every_transition(tmp_path: Path, policy: str):
    config = write_tiny_config(tmp_path / "tiny.toml", steps=2)
    out = tmp_path / "run"
    proc = start_launcher(config, out, "--policy", policy)
    pids, lines = read_until_started(proc)
    rest, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, "".join(lines) + rest
    assert_all_gone(pids)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["policy"] == policy
    assert summary["trajectories_expected"] == summary["trajectories_finished"] == 8
    assert summary["trajectories_lost"] == 0 and summary["invalid_messages"] == 0
    assert [s["step"] for s in summary["steps"]] == [0, 1]
    assert all(s["rollout_s"] > 0 and s["prefill_tokens"] > 0 and s["decode_tokens"] > 0 for s in summary["steps"])

    events = pl.read_parquet(out / "events.parquet")
    assert {"event_id", "kind", "trajectory_id", "turn", "at_s"} <= set(events.columns)
    assert events["event_id"].n_unique() == events.height
    finished = set(events.filter(pl.col("kind") == "finished")["trajectory_id"])
    assert len(finished) == summary["trajectories_finished"]
    disaggregated = policy.startswith("static")  # the tiny config keeps every turn of a split crossing engines
    assert incomplete_trajectories(events, finished, disaggregated) == {}
    assert summary["incomplete_trajectories"] == 0
    per_kind = dict(events["kind"].value_counts().iter_rows())
    if disaggregated:  # every turn crossed from e0 (prefill) to e1 (decode)
        assert per_kind["kv_transfer_done"] == per_kind["decode_done"]
        assert set(events.filter(pl.col("kind") == "prefill_done")["engine_id"]) == {"e0"}
        assert set(events.filter(pl.col("kind") == "decode_done")["engine_id"]) == {"e1"}
    else:
        assert "kv_transfer_done" not in per_kind
    decode_tokens = events.filter(pl.col("kind") == "decode_done")["generated_tokens"].sum()
    assert decode_tokens == sum(s["decode_tokens"] for s in summary["steps"])


def test_a_dead_actor_stops_the_run_with_its_name(tmp_path: Path):
    config = write_tiny_config(tmp_path / "tiny.toml", steps=3, time_scale=5.0)
    proc = start_launcher(config, tmp_path / "run", "--on-actor-death", "abort")
    pids, _ = read_until_started(proc)
    os.kill(pids["engine e1"], signal.SIGKILL)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    assert "engine e1 died with exit code -9" in output
    assert_all_gone(pids)


def test_ctrl_c_stops_everything_and_leaves_no_process(tmp_path: Path):
    config = write_tiny_config(tmp_path / "tiny.toml", steps=3, time_scale=5.0)
    out = tmp_path / "run"
    proc = start_launcher(config, out)
    pids, _ = read_until_started(proc)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: every process of the group gets it
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, output
    assert_all_gone(pids)
    assert json.loads((out / "summary.json").read_text())["status"] == "interrupted"


def test_malformed_messages_on_every_subject_are_counted_and_lose_nothing(tmp_path: Path, nats_server):
    """Garbage on every work, result, training and control subject during a real run."""
    import asyncio
    import logging
    import time

    from nats.errors import NoRespondersError

    from actors.base.connection import close, connect
    from bus_schemas import subjects
    from bus_schemas.codec import decode
    from bus_schemas.control import CommandAck

    config = write_tiny_config(tmp_path / "tiny.toml", steps=2, time_scale=20.0)
    out = tmp_path / "run"
    proc = start_launcher(config, out, "--policy", "static", "--nats-url", nats_server.url)
    pids, lines = read_until_started(proc)
    stored = [subjects.work_prefill(), subjects.work_decode(), subjects.result("env0"), subjects.train_tasks(), subjects.train_finished()]

    async def inject() -> CommandAck:
        nc = await connect(nats_server.url, "vandal", logging.getLogger("test"))
        try:
            js = nc.jetstream()
            for subject in stored:
                await js.publish(subject, b"\x93\xff garbage")
            give_up = time.monotonic() + 60.0
            while True:  # the engine may still be subscribing: ask until someone answers
                try:
                    reply = await nc.request(subjects.ctl_engine("e0"), b"\x00 not a command", timeout=2)
                    return decode(CommandAck, reply.data)
                except (NoRespondersError, TimeoutError) as err:  # no responders yet
                    assert time.monotonic() < give_up, f"engine e0 never answered on its control subject in 60 s: {err!r}"
                    await asyncio.sleep(0.05)  # barrier-ok: polling for the engine's subscription
        finally:
            await close(nc)

    ack = asyncio.run(inject())
    assert not ack.ok and "malformed" in ack.error
    rest, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, "".join(lines) + rest
    summary = json.loads((out / "summary.json").read_text())
    assert summary["invalid_messages"] == len(stored) + 1
    assert summary["trajectories_finished"] == summary["trajectories_expected"] and summary["trajectories_lost"] == 0
    assert summary["incomplete_trajectories"] == 0


def test_prorsa_switches_roles_on_a_real_bus_and_loses_nothing(tmp_path: Path):
    """prorsa with the forecaster and the allocator as their own processes: the fleet starts
    colocated, the allocator splits it (thresholds at zero: always PD), every trajectory
    finishes with every transition in the log."""
    config = write_tiny_config(tmp_path / "tiny.toml", policy="prorsa", steps=2)
    with config.open("a") as f:
        f.write('\n[allocator]\ntick_s = 1.0\nmin_dwell_s = 0.0\ncolocation = "never"\n')
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ops.launch", str(config), "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policy"] == "prorsa" and summary["trajectories_lost"] == 0 and summary["incomplete_trajectories"] == 0
    assert summary["actors"]["allocator"]["switches"] >= 2  # colocated -> one prefill, one decode engine
    events = pl.read_parquet(out / "events.parquet")
    switched = events.filter(pl.col("kind") == "role_switched")
    assert {"prefill", "decode"} <= set(switched["role"])
    assert all("->" in why for why in switched["detail"])  # each switch logs the allocator's decision ("1:1 -> ..." here)
    assert events.filter(pl.col("kind") == "kv_transfer_done").height > 0  # turns crossed engines after the split
    assert summary["actors"]["forecaster"]["ticks"] > 0
    # the launcher records the allocator's decisions with the capacities each was priced with
    decisions = pl.read_parquet(out / "allocations.parquet")
    assert decisions.height > 0 and decisions["changes"].str.contains("prefill").any()
    assert (decisions["capacity_decode_scale"] > 0).all() and (out / "forecasts.parquet").exists()
