"""`python -m ops.monitor`: the state from real schema messages, the dashboard, JSON lines,
Prometheus metrics, and bad input in one line.

Three tiers: `MonitorState` fed Structs and raw bytes (no bus); the monitor against the
session's real nats-server (`bus`), in process and as a command (`--once --json`,
`--prometheus` scraped over HTTP, the dashboard captured through tmux); and a real small run
through `ops.launch` (`e2e`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import msgspec
import polars as pl
import pytest

from actors.config import load_config
from bus_schemas import streams, subjects
from bus_schemas.codec import encode
from bus_schemas.control import CommandAck, Role, SetRole
from bus_schemas.forecast import DemandForecast, TargetForecast
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.status import ActorStatus, EngineStatus
from forecasting.series import TokenCost
from ops.bus_guard import REASON_HEADER
from ops.monitor_bus import BUS_FILE, BusMonitor, MonitorInputError, target_from_run, target_from_url
from ops.monitor_prom import metric_families
from ops.monitor_state import MonitorState
from ops.monitor_view import render_text, sparkline
from ops.natsserver import EmbeddedNats, free_port
from tests.conftest import REPO, write_tiny_config

PANELS = ("Engines", "P:D split", "Trajectories", "Forecast (magenta) vs measured demand", "Role switches", "Health and alerts")


# --- building real schema messages ----------------------------------------------------------
def status(engine_id: str, role: str, *, at_s: float = 10.0, epoch: int = 0, **kw) -> EngineStatus:
    fields = dict(
        engine_id=engine_id,
        at_s=at_s,
        role=Role(role),
        epoch=epoch,
        policy_version=0,
        backend="emulated",
        waiting_prefill=2,
        running_decode=3,
        kv_used_tokens=2500,
        kv_capacity_tokens=10_000,
        held_kv_handles=0,
        busy_fraction=0.5,
        waiting_prefill_tokens=900,
    )
    fields.update(kw)
    return EngineStatus(**fields)


_ids = iter(range(10**9))


def event(kind: EventKind, at_s: float, traj: str = "t0", **kw) -> LifecycleEvent:
    kw.setdefault("actor_id", kw.get("engine_id") or "env0")
    return LifecycleEvent(event_id=f"ev{next(_ids)}", kind=kind, at_s=at_s, trajectory_id=traj, task_family="swe", **kw)


def forecast(as_of_s: float, tick: int = 1, bin_s: float = 1.0) -> DemandForecast:
    targets = [
        TargetForecast(target=t, mean=[m, m * 2], quantile_levels=[0.1, 0.5, 0.9], quantiles=[[0.0, 0.0], [m, m * 2], [m * 3, m * 4]])
        for t, m in (
            ("prefill_new_tokens", 100.0),
            ("prefill_miss_tokens", 80.0),
            ("prefill_engine_s", 0.5),
            ("decode_active_seqs", 4.0),
            ("decode_tokens", 300.0),
            ("kv_tokens", 9.0),
        )
    ]
    return DemandForecast(
        forecaster_id="forecaster",
        model="lifecycle",
        tick=tick,
        as_of_s=as_of_s,
        computed_at_s=as_of_s + 2.0,
        bin_s=bin_s,
        horizons_s=[1.0, 5.0],
        targets=targets,
        live_trajectories=3,
        events_total=10,
    )


def one_turn(state: MonitorState, traj: str, start_s: float, engine: str = "e0", wall_s: float = 0.0) -> None:
    """A colocated turn on `engine`, from the start of the trajectory to its tool call."""
    kinds = [
        EventKind.STARTED,
        EventKind.PREFILL_QUEUED,
        EventKind.PREFILL_STARTED,
        EventKind.PREFILL_DONE,
        EventKind.DECODE_STARTED,
        EventKind.DECODE_DONE,
        EventKind.TOOL_STARTED,
    ]
    for i, kind in enumerate(kinds):
        on_engine = kind in (EventKind.PREFILL_STARTED, EventKind.PREFILL_DONE, EventKind.DECODE_STARTED, EventKind.DECODE_DONE)
        extra = {"engine_id": engine, "role": "colocated"} if on_engine else {}
        state.on_lifecycle(
            event(
                kind, start_s + 0.1 * i, traj, turn=0, new_tokens=100, generated_tokens=50 if kind is EventKind.DECODE_DONE else 0, **extra
            ),
            wall_s,
        )


# --- the state, fed directly -----------------------------------------------------------------
def test_engines_show_role_backend_epoch_queue_kv_tokens_per_s_and_heartbeat_age():
    state = MonitorState(lease_wall_s=5.0)
    state.on_engine_status(status("e0", "prefill", at_s=10.0, epoch=2, prefilled_tokens_total=1000), wall_s=100.0)
    state.on_engine_status(status("e0", "prefill", at_s=12.0, epoch=2, prefilled_tokens_total=5000), wall_s=101.0)
    state.on_engine_status(status("e1", "decode", at_s=12.0), wall_s=101.0)
    state.on_lifecycle(event(EventKind.DECODE_DONE, 11.5, engine_id="e1", role="decode", generated_tokens=400), wall_s=101.0)
    snap = state.snapshot(wall_s=102.5)
    e0, e1 = snap["engines"]
    assert (e0["engine_id"], e0["role"], e0["backend"], e0["epoch"]) == ("e0", "prefill", "emulated", 2)
    assert (e0["queue_depth"], e0["queue_tokens"], e0["running"], e0["kv_use"]) == (2, 900, 3, 0.25)
    assert e0["prefill_tokens_per_s"] == pytest.approx(2000.0)  # 4000 tokens over 2 model seconds
    assert e1["decode_tokens_per_s"] == pytest.approx(400 / state.rate_window_s)
    assert e0["heartbeat_age_s"] == pytest.approx(1.5) and not e0["silent"]
    assert snap["split"]["ratio"] == "1:1" and snap["time_scale"] == pytest.approx(2.0)  # 2 model s per wall s
    assert json.loads(json.dumps(snap)) == snap  # JSON as it stands


def test_trajectories_by_phase_follow_the_lifecycle_and_ignore_late_events():
    state = MonitorState()
    expect = [
        (EventKind.STARTED, "queued"),
        (EventKind.PREFILL_QUEUED, "queued"),
        (EventKind.PREFILL_STARTED, "prefill"),
        (EventKind.PREFILL_DONE, "queued"),
        (EventKind.DECODE_QUEUED, "queued"),
        (EventKind.KV_TRANSFER_DONE, "queued"),
        (EventKind.DECODE_STARTED, "decode"),
        (EventKind.DECODE_DONE, "tool"),
        (EventKind.TOOL_STARTED, "tool"),
        (EventKind.TOOL_DONE, "queued"),
    ]
    for i, (kind, phase) in enumerate(expect):
        state.on_lifecycle(event(kind, 1.0 + i, "a", turn=0), wall_s=0.0)
        t = state.snapshot(0.0)["trajectories"]
        assert t[phase] == 1 and t["live"] == 1, (kind, t)
    state.on_lifecycle(event(EventKind.PREFILL_STARTED, 2.5, "a"), wall_s=0.0)  # arrives late: the trajectory stays where it is
    assert state.snapshot(0.0)["trajectories"]["queued_for_prefill"] == 1
    one_turn(state, "b", 20.0)
    state.on_lifecycle(event(EventKind.FINISHED, 30.0, "a"), wall_s=0.0)
    t = state.snapshot(0.0)["trajectories"]
    assert (t["live"], t["tool"], t["finished"], t["started"]) == (1, 1, 1, 2)
    assert t["events_total"] == len(expect) + 1 + 7 + 1 and t["events_per_s"] > 0


def test_a_role_switch_shows_with_its_cost_epoch_and_ack():
    state = MonitorState()
    state.on_engine_status(status("e0", "colocated", at_s=5.0), wall_s=10.0)
    state.ingest(subjects.ctl_engine("e0"), encode(SetRole(role=Role.PREFILL, epoch=1, drain_deadline_s=3.0)), wall_s=10.5)
    assert state.snapshot(10.6)["switches"]["commands"]["pending"][0]["role"] == "prefill"
    state.on_lifecycle(
        event(EventKind.ROLE_SWITCHED, 6.0, "", engine_id="e0", role="prefill", duration_s=1.25, detail="0:1 -> 1:0 (forecast)"),
        wall_s=11.0,
    )
    state.ingest_ack(
        "_INBOX.x.1",
        encode(CommandAck(engine_id="e0", command="set_role", ok=True, role=Role.PREFILL, epoch=1, policy_version=0, drain_s=1.0)),
        11.0,
    )
    state.on_engine_status(status("e0", "prefill", at_s=6.5, epoch=1), wall_s=11.2)
    snap = state.snapshot(11.5)
    sw = snap["switches"]
    assert sw["total"] == 1 and sw["cost_s_total"] == 1.25
    assert sw["recent"] == [
        {
            "at_s": 6.0,
            "engine_id": "e0",
            "from_role": "colocated",
            "role": "prefill",
            "cost_s": 1.25,
            "epoch": 1,
            "why": "0:1 -> 1:0 (forecast)",
        }
    ]
    assert sw["commands"]["acked"] == 1 and sw["commands"]["pending"] == []
    assert not [a for a in snap["alerts"] if a["kind"] == "switch_not_acked"]


def test_the_allocators_latest_decision_shows_why_the_fleet_holds():
    from bus_schemas.control import AllocationDecision

    state = MonitorState()
    assert state.snapshot(0.0)["switches"]["allocator"] is None

    def tick(at_s: float, reason: str) -> bytes:
        return encode(
            AllocationDecision(
                at_s=at_s,
                policy="prorsa",
                epoch=2,
                roles={"e0": "prefill", "e1": "decode", "e2": "decode"},
                reason=reason,
                demand_source="forecast@9s",
                capacity_decode_scale=0.8125,
            )
        )

    state.ingest(subjects.allocation(), tick(10.0, "hold 1:2"), wall_s=1.0)
    state.ingest(subjects.allocation(), tick(8.0, "an older tick, late"), wall_s=1.1)
    state.ingest(subjects.allocation(), b"junk", wall_s=1.2)
    d = state.snapshot(1.5)["switches"]["allocator"]
    capacity = {"prefill": 1.0, "decode": 0.812, "mixed": 1.0, "kv": 1.0}
    assert d == {
        "at_s": 10.0,
        "policy": "prorsa",
        "split": "1:2",
        "changes": 0,
        "reason": "hold 1:2",
        "demand": "forecast@9s",
        "capacity": capacity,
    }
    assert state.snapshot(1.5)["invalid"]  # the malformed one is counted, not taken
    assert "allocator @ 10 s (prorsa, 1:2): hold 1:2" in render_text(state.snapshot(1.5))
    assert "decode 0.812x" in render_text(state.snapshot(1.5))


def test_a_switch_not_acked_past_its_deadline_and_an_engine_silent_past_its_lease_are_alerts():
    state = MonitorState(lease_wall_s=3.0, time_scale=10.0, ack_grace_wall_s=2.0)
    state.on_engine_status(status("e0", "colocated"), wall_s=100.0)
    state.on_engine_status(status("e1", "colocated"), wall_s=100.0)
    state.on_set_role("e1", SetRole(role=Role.DECODE, epoch=4, drain_deadline_s=10.0), wall_s=100.0)  # deadline 2 + 10/10 = 3 s
    state.on_engine_status(status("e0", "colocated"), wall_s=102.5)
    kinds = {(a["kind"], a["subject"]) for a in state.snapshot(102.9)["alerts"]}
    assert kinds == set()
    alerts = state.snapshot(103.5)["alerts"]
    assert {(a["kind"], a["subject"]) for a in alerts} == {("engine_silent", "e1"), ("switch_not_acked", "e1")}
    assert any("epoch 4" in a["message"] for a in alerts)
    state.on_engine_status(status("e1", "decode", epoch=4), wall_s=104.0)  # carried out after all: settled, alive
    assert [a["kind"] for a in state.snapshot(104.1)["alerts"]] == []


def test_the_lease_defaults_to_ten_heartbeats_and_at_least_three_seconds():
    state = MonitorState(heartbeat_wall_s=0.5)
    state.on_engine_status(status("e0", "decode"), wall_s=0.0)
    assert state.snapshot(4.9)["engines"][0]["lease_s"] == 5.0 and not state.snapshot(4.9)["engines"][0]["silent"]
    assert state.snapshot(5.1)["engines"][0]["silent"]
    fast = MonitorState()  # no config: the period is measured
    for i in range(5):
        fast.on_engine_status(status("e0", "decode", at_s=float(i)), wall_s=0.02 * i)
    assert fast.snapshot(0.1)["engines"][0]["lease_s"] == 3.0


def test_malformed_messages_are_counted_per_subject_never_raised():
    state = MonitorState()
    good = encode(status("e0", "decode"))
    garbage = {
        subjects.status("engine", "e0"): [b"\x93\xff garbage", good[: len(good) // 2], encode(status("e0", "decode"))[:-3]],
        subjects.lifecycle("decode_done"): [
            b"\x00",
            msgspec.msgpack.encode({"event_id": "x", "kind": "no-such-kind", "at_s": 1.0, "actor_id": "a"}),
        ],
        subjects.forecast(): [msgspec.msgpack.encode({"forecaster_id": 3})],
        subjects.ctl_engine("e0"): [b"not a command"],
        subjects.status("environment", "env0"): [msgspec.msgpack.encode({"actor_id": "env0", "kind": "environment", "at_s": "soon"})],
    }
    for subject, payloads in garbage.items():
        for data in payloads:
            state.ingest(subject, data, wall_s=1.0)
    state.ingest(subjects.status("engine", "e0"), good, wall_s=1.0)
    snap = state.snapshot(1.0)
    assert snap["invalid"]["by_subject"] == {
        "prorsa.status.engine": 3,
        "prorsa.lc": 2,
        "prorsa.forecast": 1,
        "prorsa.ctl.engine": 1,
        "prorsa.status.environment": 1,
    }
    assert snap["invalid"]["total"] == 8 and [e["engine_id"] for e in snap["engines"]] == ["e0"]
    assert any(a["kind"] == "invalid_messages" for a in snap["alerts"])


def test_the_pd_split_over_time_follows_role_changes():
    state = MonitorState(window_s=100.0, history_points=11)
    for e in ("e0", "e1", "e2"):
        state.on_engine_status(status(e, "colocated", at_s=0.0), wall_s=0.0)
    state.on_lifecycle(event(EventKind.ROLE_SWITCHED, 50.0, "", engine_id="e0", role="prefill", duration_s=0.5), wall_s=1.0)
    state.on_lifecycle(event(EventKind.ROLE_SWITCHED, 70.0, "", engine_id="e1", role="decode", duration_s=0.5), wall_s=1.0)
    state.on_engine_status(status("e2", "colocated", at_s=100.0), wall_s=2.0)
    sp = state.snapshot(2.0)["split"]
    assert sp["history_at_s"] == [float(t) for t in range(0, 101, 10)]
    assert sp["history"]["prefill"] == [0] * 5 + [1] * 6
    assert sp["history"]["decode"] == [0] * 7 + [1] * 4
    assert sp["history"]["colocated"] == [3] * 5 + [2] * 2 + [1] * 4
    assert (sp["prefill"], sp["decode"], sp["colocated"], sp["ratio"]) == (1, 1, 1, "1:1 +1 colocated")


def test_measured_demand_and_the_forecast_line_up_by_bin():
    state = MonitorState(spark_bins=10, prefill_cost=TokenCost(per_token_s=1e-3, per_token_pair_s=1e-6))
    state.on_forecast(forecast(as_of_s=4.0), wall_s=0.0)  # predicts bin 4 ([4, 5)) one horizon ahead
    state.on_lifecycle(event(EventKind.PREFILL_QUEUED, 4.2, "a", new_tokens=70), wall_s=0.0)
    state.on_lifecycle(event(EventKind.PREFILL_QUEUED, 4.7, "b", new_tokens=30), wall_s=0.0)
    state.on_lifecycle(event(EventKind.PREFILL_DONE, 4.8, "a", context_tokens=500, cached_prefix_tokens=400, new_tokens=70), wall_s=0.0)
    state.on_lifecycle(event(EventKind.DECODE_STARTED, 5.5, "a"), wall_s=0.0)  # one sequence for half of bin 5, all of 6..9
    state.on_lifecycle(event(EventKind.DECODE_DONE, 10.0, "a", generated_tokens=64), wall_s=0.0)
    state.on_lifecycle(event(EventKind.TOOL_STARTED, 11.2, "a"), wall_s=0.0)  # now: 11.2, the last whole bin is 10
    d = state.snapshot(0.0)["demand"]
    assert d["first_bin_s"] == 1.0 and d["tick"] == 1 and d["horizons_s"] == [1.0, 5.0]
    t = d["targets"]
    assert t["prefill_new_tokens"]["measured"][3] == 100.0 and t["prefill_new_tokens"]["predicted"][3] == 100.0
    assert t["prefill_miss_tokens"]["measured"][3] == 170.0  # context - cached + new
    assert t["prefill_engine_s"]["measured"][3] == pytest.approx(
        0.17 + 170 * (400 + 85) * 1e-6, abs=0.01
    )  # as forecasting.series weighs it
    assert t["kv_tokens"]["measured"] == [None] * 10 and t["kv_tokens"]["forecast"] == [9.0, 18.0]  # forecast only: not measured here
    state.prefill_cost = None
    assert state.snapshot(0.0)["demand"]["targets"]["prefill_engine_s"]["measured"] == [None] * 10  # without the run's cost
    assert t["decode_active_seqs"]["measured"][4:] == [0.5, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert t["decode_tokens"]["measured"][-1] == 64.0
    assert t["decode_tokens"]["forecast"] == [300.0, 600.0] and t["decode_tokens"]["forecast_high"] == [900.0, 1200.0]


def test_dead_letters_a_full_lifecycle_stream_and_a_fallback_forecast_are_alerts():
    state = MonitorState()
    state.on_stream_info("LIFECYCLE", messages=950, bytes_=10_000, max_msgs=1000, max_bytes=-1, discard="new")
    state.on_stream_info("WORK_PREFILL", messages=12, bytes_=4000)
    assert state.snapshot(0.0)["streams"]["LIFECYCLE"]["fullness"] == 0.95
    state.on_advisory(kind="terminated", stream="WORK_PREFILL", consumer="prefill")
    state.on_dead_letter(stream="WORK_DECODE", reason="not acked after 10 deliveries", subject=subjects.work_decode())
    state.on_forecast(msgspec.structs.replace(forecast(3.0), fallback=True, fallback_reason="FitError: too few events"), wall_s=1.0)
    snap = state.snapshot(1.0)
    alerts = {a["kind"]: a["message"] for a in snap["alerts"]}
    assert set(alerts) == {"stream_near_full", "dead_letters", "forecast_fallback"}
    assert "LIFECYCLE 95% full" in alerts["stream_near_full"] and "not acked after 10 deliveries" in alerts["dead_letters"]
    assert snap["dead_letters"]["total"] == 1 and snap["dead_letters"]["terminated"] == 1
    state.on_stream_info("DEAD", messages=3, bytes_=900)  # the whole run's, by stream info
    assert state.snapshot(1.0)["dead_letters"]["total"] == 3


def test_no_traffic_until_a_prorsa_message_or_a_non_empty_lifecycle_stream():
    state = MonitorState()
    state.on_stream_info("LIFECYCLE", messages=0, bytes_=0)
    assert not state.snapshot(0.0)["traffic"]
    state.on_stream_info("LIFECYCLE", messages=3, bytes_=300)
    assert state.snapshot(0.0)["traffic"]


# --- rendering, metrics, the Grafana board ---------------------------------------------------
def _busy_state() -> MonitorState:
    state = MonitorState(lease_wall_s=3.0, prefill_cost=TokenCost(per_token_s=1e-3))
    for e, role in (("e0", "prefill"), ("e1", "decode"), ("e2", "colocated")):
        state.on_engine_status(status(e, role, at_s=20.0, epoch=1), wall_s=10.0)
    one_turn(state, "a", 12.0, "e2")
    state.on_set_role("e0", SetRole(role=Role.PREFILL, epoch=1), wall_s=9.0)
    state.on_lifecycle(event(EventKind.ROLE_SWITCHED, 15.0, "", engine_id="e0", role="prefill", duration_s=0.75), wall_s=9.5)
    state.on_forecast(forecast(as_of_s=18.0), wall_s=10.0)
    state.ingest(subjects.status("engine", "e9"), b"junk", wall_s=10.0)
    state.on_actor_status(
        ActorStatus(actor_id="env0", kind="environment", at_s=20.0, live_trajectories=1, counters={"invalid_messages": 1}), wall_s=10.0
    )
    state.on_stream_info("LIFECYCLE", messages=8, bytes_=800, max_msgs=1000)
    return state


def test_the_dashboard_renders_every_panel_as_text():
    text = render_text(_busy_state().snapshot(11.0), width=150)
    for title in PANELS:
        assert title in text, title
    for needle in (
        "e0",
        "e1",
        "e2",
        "prefill",
        "decode",
        "colocated",
        "P:D 1:1 +1 colocated",
        "prefill_miss_tokens",
        "malformed messages seen: 1",
        "0.75",
    ):
        assert needle in text, needle
    assert (
        sparkline([0, 1, 2, 4], top=4) == "▁▃▅█"
        and sparkline([None, 0.0], top=1) == " ▁"
        and len(sparkline(list(range(100)), width=10)) == 10
    )


def _exposition(snapshot: dict) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from ops.monitor_prom import SnapshotCollector

    registry = CollectorRegistry(auto_describe=False)
    collector = SnapshotCollector()
    collector.update(snapshot)
    registry.register(collector)
    return generate_latest(registry).decode()


def test_prometheus_metrics_follow_the_naming_conventions():
    text = _exposition(_busy_state().snapshot(11.0))
    assert 'prorsa_engine_role{engine="e0",role="prefill"} 1.0' in text
    assert 'prorsa_engine_role{engine="e0",role="decode"} 0.0' in text
    assert 'prorsa_queue_depth{engine="e1"} 2.0' in text
    assert 'prorsa_engines{role="colocated"} 1.0' in text
    assert 'prorsa_forecast_tokens{horizon="5",target="prefill_miss_tokens"} 160.0' in text
    assert 'prorsa_forecast_sequences{horizon="1",target="decode_active_seqs"} 4.0' in text
    assert 'prorsa_forecast_engine_seconds{horizon="1",target="prefill_engine_s"} 0.5' in text
    assert 'prorsa_invalid_messages_total{subject="prorsa.status.engine"} 1.0' in text
    assert "prorsa_role_switches_total 1.0" in text and "prorsa_role_switch_cost_seconds_total 0.75" in text
    assert 'prorsa_engine_info{backend="emulated",engine="e1"} 1.0' in text
    names = {m.name for m in metric_families(_busy_state().snapshot(11.0))}
    assert all(re.fullmatch(r"prorsa_[a-z_]+", n) for n in names)


def test_the_grafana_board_plots_only_metrics_the_monitor_serves():
    board = json.loads((REPO / "ops" / "grafana" / "prorsa.json").read_text())
    served = set(re.findall(r"^(prorsa_\w+?)(?:\{| )", _exposition(_busy_state().snapshot(11.0)), re.M))
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 20
    used = {m for e in exprs for m in re.findall(r"\bprorsa_\w+", e)}
    assert used and used <= served, f"not served: {sorted(used - served)}"
    assert {p["title"] for p in board["panels"]} >= {"Engines per role (P:D split)", "Live trajectories by phase", "Alerts"}


# --- where the bus is ------------------------------------------------------------------------
def test_bus_json_gives_the_url_and_optional_credentials(tmp_path: Path):
    run = tmp_path / "run"
    with pytest.raises(MonitorInputError, match="no such run folder"):
        target_from_run(run)
    run.mkdir()
    with pytest.raises(MonitorInputError, match="bus.json: not there yet"):
        target_from_run(run)
    (run / BUS_FILE).write_text("{not json")
    with pytest.raises(MonitorInputError, match="not readable as JSON"):
        target_from_run(run)
    (run / BUS_FILE).write_text(json.dumps({"url": "nats://127.0.0.1:4222"}))
    assert target_from_run(run).url == "nats://127.0.0.1:4222" and target_from_run(run).user is None
    (run / BUS_FILE).write_text(json.dumps({"url": "nats://h:1", "user": "monitor", "password": "pw"}))
    assert (target_from_run(run).user, target_from_run(run).password) == ("monitor", "pw")
    (run / BUS_FILE).write_text(json.dumps({"url": "nats://h:1", "creds": "creds/monitor.creds"}))
    assert target_from_run(run).creds == str(run / "creds" / "monitor.creds")
    write_tiny_config(tmp_path / "tiny.toml")
    from actors.config import load_config

    (run / "config.json").write_bytes(msgspec.json.encode(load_config(tmp_path / "tiny.toml")))
    hints = target_from_run(run).hints
    assert hints["time_scale"] == 50.0 and hints["heartbeat_wall_s"] == 0.2 and hints["expected_engines"] == ["e0", "e1"]
    url = target_from_url("nats://x:1", {"NATS_USER": "u", "NATS_PASSWORD": "p"})
    assert (url.user, url.password, url.creds) == ("u", "p", None)
    assert target_from_url("nats://x:1", {"NATS_CREDS": "/c.creds"}).creds == "/c.creds"

    from ops.launch import BUS_FILE as LAUNCH_BUS_FILE

    assert BUS_FILE == LAUNCH_BUS_FILE


# --- on the real nats-server -----------------------------------------------------------------
async def _heartbeats(nc, roles: dict[str, str], stop: asyncio.Event, period_s: float = 0.1, epoch: int = 0) -> None:
    at_s = 100.0
    while not stop.is_set():
        at_s += period_s
        for engine_id, role in roles.items():
            await nc.publish(subjects.status("engine", engine_id), encode(status(engine_id, role, at_s=at_s, epoch=epoch)))
        await nc.flush()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)


async def _until(predicate, timeout_s: float = 10.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        await asyncio.sleep(0.05)  # barrier-ok: polling the monitor's state for what the bus delivered
    raise AssertionError(f"timed out waiting for {what}")


async def _publish_events(js, events: list[LifecycleEvent]) -> None:
    for ev in events:
        await js.publish(subjects.lifecycle(ev.kind.value), encode(ev), headers={"Nats-Msg-Id": ev.event_id})


@pytest.mark.bus
async def test_the_monitor_on_a_real_bus_reflects_every_kind_of_message(bus, nats_server):
    js = bus.jetstream()
    earlier = [event(EventKind.STARTED, 1.0, "old"), event(EventKind.PREFILL_QUEUED, 1.1, "old", new_tokens=300)]
    await _publish_events(js, earlier)  # in the stream before the monitor starts: replayed
    state = MonitorState()
    monitor = BusMonitor(state, target_from_url(nats_server.url, {}))
    await monitor.start()
    try:
        await asyncio.wait_for(monitor.lifecycle_ready.wait(), 10)

        async def fake_engine(msg):  # answers SetRole as an engine would
            command = msgspec.msgpack.decode(msg.data)
            ack = CommandAck(
                engine_id="e1",
                command="set_role",
                ok=True,
                role=Role(command["role"]),
                epoch=command["epoch"],
                policy_version=0,
                drain_s=0.4,
            )
            await bus.publish(msg.reply, encode(ack))

        await bus.subscribe(subjects.ctl_engine("e1"), cb=fake_engine)
        await bus.publish(subjects.status("engine", "e0"), encode(status("e0", "prefill", at_s=2.0)))
        await bus.publish(subjects.status("engine", "e1"), encode(status("e1", "colocated", at_s=2.0)))
        await bus.publish(
            subjects.status("environment", "env0"),
            encode(ActorStatus(actor_id="env0", kind="environment", at_s=2.0, live_trajectories=1, counters={"invalid_messages": 2})),
        )
        await bus.publish(subjects.forecast(), encode(forecast(as_of_s=1.0)))
        await bus.publish(subjects.status("engine", "e0"), b"\xc1 not msgpack")
        await js.publish(subjects.lifecycle("decode_done"), b"\x00\x01 not an event")
        await js.publish(subjects.dead_letter("WORK_DECODE"), b"\x93poison", headers={REASON_HEADER: "not acked after 10 deliveries"})
        await js.publish(subjects.work_prefill(), b"\x00 malformed work")  # an engine would terminate it
        work = await streams.pull_subscription(js, streams.prefill_consumer(), ack_wait_s=30)
        (item,) = await work.fetch(1, timeout=5)
        await item.term()
        reply = await bus.request(subjects.ctl_engine("e1"), encode(SetRole(role=Role.DECODE, epoch=3)), timeout=5)
        assert msgspec.msgpack.decode(reply.data)["ok"]
        await _publish_events(
            js,
            [
                event(EventKind.ROLE_SWITCHED, 2.5, "", engine_id="e1", role="decode", duration_s=0.4, detail="2:0 -> 1:1 (forecast)"),
                event(EventKind.PREFILL_STARTED, 2.6, "old", engine_id="e0", role="prefill"),
            ],
        )
        await bus.flush()
        await monitor.poll_streams_once()
        snap = await _until(
            lambda: (
                (s := state.snapshot(time.time()))["switches"]["total"] == 1
                and s["invalid"]["total"] == 2
                and s["dead_letters"]["terminated"] == 1
                and s
            ),
            what="the switch, the malformed messages and the terminated work",
        )
    finally:
        await monitor.close()
    assert {e["engine_id"]: e["role"] for e in snap["engines"]} == {"e0": "prefill", "e1": "colocated"}
    assert snap["trajectories"]["prefill"] == 1 and snap["trajectories"]["started"] == 1
    assert snap["switches"]["recent"][0] | {"at_s": 0} == {
        "at_s": 0,
        "engine_id": "e1",
        "from_role": "colocated",
        "role": "decode",
        "cost_s": 0.4,
        "epoch": 3,
        "why": "2:0 -> 1:1 (forecast)",
    }
    assert snap["switches"]["commands"]["acked"] == 1  # from the ack on the allocator's inbox, or the role_switched event
    assert snap["invalid"]["by_subject"] == {"prorsa.lc": 1, "prorsa.status.engine": 1}
    assert snap["invalid"]["reported_by_actors"] == {"env0": 2}
    assert snap["demand"]["tick"] == 1 and snap["bus"]["lifecycle"].startswith("LIFECYCLE stream")
    assert snap["streams"]["LIFECYCLE"]["messages"] == 5  # 4 events and the garbage
    assert snap["traffic"] and snap["bus"]["connected"]
    assert snap["dead_letters"]["total"] == 1 and snap["dead_letters"]["last"]["reason"] == "not acked after 10 deliveries"
    assert snap["dead_letters"]["last"]["stream"] == "WORK_DECODE" and snap["streams"]["DEAD"]["messages"] == 1
    assert "dead_letters" in {a["kind"] for a in snap["alerts"]}


async def _monitor_cmd(*args: str, env: dict | None = None, timeout_s: float = 60.0) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ops.monitor",
        *args,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.bus
async def test_once_json_prints_one_snapshot_of_a_live_bus(bus, nats_server):
    stop = asyncio.Event()
    beats = asyncio.create_task(_heartbeats(bus, {"e0": "prefill", "e1": "decode"}, stop))
    try:
        await _publish_events(
            bus.jetstream(),
            [
                event(EventKind.STARTED, 100.0, "x"),
                event(EventKind.ROLE_SWITCHED, 100.2, "", engine_id="e0", role="prefill", duration_s=0.3),
            ],
        )
        rc, out, err = await _monitor_cmd("--nats-url", nats_server.url, "--once", "--json", "--wait", "1")
    finally:
        stop.set()
        await beats
    assert rc == 0, err
    lines = out.splitlines()
    assert len(lines) == 1
    snap = json.loads(lines[0])
    assert {e["engine_id"]: e["role"] for e in snap["engines"]} == {"e0": "prefill", "e1": "decode"}
    assert snap["switches"]["recent"][0]["role"] == "prefill" and snap["trajectories"]["live"] == 1


@pytest.mark.bus
async def test_prometheus_metrics_are_served_over_http(bus, nats_server):
    port = free_port()
    stop = asyncio.Event()
    beats = asyncio.create_task(_heartbeats(bus, {"e0": "prefill", "e1": "decode"}, stop))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ops.monitor",
        "--nats-url",
        nats_server.url,
        "--prometheus",
        str(port),
        "--prometheus-addr",
        "127.0.0.1",
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:

        def scrape() -> str:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                return ""
            return text if 'prorsa_engine_role{engine="e1",role="decode"} 1.0' in text else ""

        text = await _until(lambda: scrape(), timeout_s=20, what="the metrics endpoint to serve the engines")
    finally:
        stop.set()
        await beats
        proc.terminate()
        await proc.wait()
    assert 'prorsa_engine_role{engine="e0",role="prefill"} 1.0' in text
    assert 'prorsa_engines{role="decode"} 1.0' in text and "prorsa_monitor_connected 1.0" in text
    assert "prorsa_heartbeat_age_seconds" in text and "prorsa_kv_usage_ratio" in text


@pytest.mark.bus
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
async def test_the_dashboard_shows_every_panel_in_a_real_terminal(bus, nats_server, tmp_path: Path):
    session = f"prorsa-monitor-{os.getpid()}"
    stop = asyncio.Event()
    beats = asyncio.create_task(_heartbeats(bus, {"e0": "prefill", "e1": "decode", "e2": "colocated"}, stop))
    js = bus.jetstream()
    await _publish_events(
        js,
        [
            event(EventKind.STARTED, 97.0, "t"),
            event(EventKind.PREFILL_STARTED, 98.0, "t", engine_id="e1", role="colocated"),
            event(EventKind.ROLE_SWITCHED, 99.0, "", engine_id="e1", role="decode", duration_s=0.5),
        ],
    )
    await bus.publish(subjects.forecast(), encode(forecast(as_of_s=100.0)))
    # COLUMNS/LINES dropped: rich takes them over the terminal's size, and a detached tmux started here may pass 80x24 on
    command = f"cd {REPO} && env -u COLUMNS -u LINES {sys.executable} -m ops.monitor --nats-url {nats_server.url} --interval 0.3"
    tmux = ["tmux", "-L", session, "-f", os.devnull]  # a server of its own: no one's settings, no one's sessions
    subprocess.run([*tmux, "new-session", "-d", "-s", session, "-x", "160", "-y", "60", command], check=True)
    subprocess.run([*tmux, "resize-window", "-t", session, "-x", "160", "-y", "60"], check=True)
    try:

        def capture() -> str:
            text = subprocess.run([*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
            return text if all(t in text for t in PANELS) and "e2" in text and "colocated → decode" in text else ""

        try:
            text = await _until(capture, timeout_s=20, what="every panel in the tmux pane")
        except AssertionError as err:
            pane = subprocess.run([*tmux, "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout
            raise AssertionError(f"{err}; the pane shows:\n{pane}") from None
    finally:
        stop.set()
        await beats
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    (tmp_path / "dashboard.txt").write_text(text)
    assert "P:D 1:1 +1 colocated" in text and "● connected" in text


# --- bad input: one line, never a traceback ---------------------------------------------------
def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.bus
async def test_bad_input_says_one_line_and_exits_with_once(tmp_path: Path):
    free = free_port()
    rc, out, err = await _monitor_cmd("--nats-url", f"nats://127.0.0.1:{free}", "--once")
    assert rc == 1 and "no NATS server answers there" in _one_line(err) and out == ""
    rc, out, err = await _monitor_cmd("--run", str(tmp_path / "missing"), "--once", "--json")
    assert rc == 1 and "no such run folder" in _one_line(err)
    with EmbeddedNats(tmp_path / "empty") as empty:  # a server nobody runs Prorsa on
        rc, out, err = await _monitor_cmd("--nats-url", empty.url, "--once", "--json", "--wait", "0.5")
    assert rc == 1 and "no Prorsa traffic" in _one_line(err) and out == ""


@pytest.mark.bus
async def test_without_once_bad_input_is_said_once_while_it_waits(tmp_path: Path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "ops.monitor",
        "--run",
        str(tmp_path / "later"),
        "--json",
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        first = await asyncio.wait_for(proc.stderr.readline(), 20)
        assert b"no such run folder" in first and b"waiting" in first
        await asyncio.sleep(2.5)  # barrier-ok: it must keep waiting, quietly
        assert proc.returncode is None
    finally:
        proc.terminate()
        rest = await proc.stderr.read()
        await proc.wait()
    assert rest.strip() == b"" and proc.returncode == 0  # stopped while waiting: a normal end


@pytest.mark.bus
async def test_a_run_folder_with_credentials_connects_and_wrong_ones_say_so(tmp_path: Path):
    server = EmbeddedNats(tmp_path / "auth", authorization='authorization { users = [ {user: "monitor", password: "s3cret"} ] }\n')
    url = server.start()  # on a port of its own (picked again if taken before it binds)
    run = tmp_path / "run"
    run.mkdir()
    try:
        nc = await _until_connected(url, user="monitor", password="s3cret")
        stop = asyncio.Event()
        beats = asyncio.create_task(_heartbeats(nc, {"e0": "decode"}, stop))
        try:
            (run / BUS_FILE).write_text(json.dumps({"url": url, "user": "monitor", "password": "s3cret"}))
            rc, out, err = await _monitor_cmd("--run", str(run), "--once", "--json", "--wait", "1")
            assert rc == 0, err
            assert [e["engine_id"] for e in json.loads(out)["engines"]] == ["e0"]
            (run / BUS_FILE).write_text(json.dumps({"url": url, "user": "monitor", "password": "wrong"}))
            rc, out, err = await _monitor_cmd("--run", str(run), "--once")
            assert rc == 1 and "refused these credentials" in _one_line(err)
            rc, out, err = await _monitor_cmd(
                "--nats-url", url, "--once", "--json", "--wait", "1", env={"NATS_USER": "monitor", "NATS_PASSWORD": "s3cret"}
            )
            assert rc == 0 and json.loads(out)["engines"][0]["role"] == "decode", err
        finally:
            stop.set()
            await beats
            await nc.close()
    finally:
        server.stop()


async def _until_connected(url: str, **kw):
    import nats

    deadline = time.monotonic() + 10
    while True:
        try:
            return await nats.connect(url, allow_reconnect=False, **kw)
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)  # barrier-ok: waiting for the server to listen


# --- a real small run ------------------------------------------------------------------------
@pytest.mark.e2e
def test_once_json_on_a_real_run_reports_every_engine_with_its_role_and_the_switches(tmp_path: Path):
    """prorsa on two engines (ops.launch, every actor its own process): the allocator splits
    the colocated fleet into a prefill and a decode engine; a `--once --json` snapshot taken
    during the run shows both engines in the roles the log says they had, and the switches."""
    config = write_tiny_config(
        tmp_path / "tiny.toml", policy="prorsa", steps=5, time_scale=20.0
    )  # steps: a window after the split for --once to see
    with config.open("a") as f:
        f.write('\n[allocator]\ntick_s = 1.0\nmin_dwell_s = 0.0\ncolocation = "never"\n')
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "ops.launch", str(config), "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    follow_out, follow_err = (tmp_path / "follow.jsonl").open("w"), (tmp_path / "follow.err").open("w")
    follower = subprocess.Popen(  # to files: a pipe nobody reads would block it
        [sys.executable, "-m", "ops.monitor", "--run", str(out), "--json", "--interval", "0.5"],
        cwd=REPO,
        stdout=follow_out,
        stderr=follow_err,
        text=True,
    )
    snaps = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and launcher.poll() is None:
            once = subprocess.run(
                [sys.executable, "-m", "ops.monitor", "--run", str(out), "--once", "--json", "--wait", "1"],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=60,
            )
            if once.returncode == 0:
                snap = json.loads(once.stdout)
                if snap["switches"]["total"] >= 2 and len(snap["engines"]) == 2 and launcher.poll() is None:
                    snaps.append(snap)
                    break
        log, _ = launcher.communicate(timeout=240)
        follower.wait(timeout=30)
        lines, err = (tmp_path / "follow.jsonl").read_text(), (tmp_path / "follow.err").read_text()
    finally:
        for p in (launcher, follower):
            if p.poll() is None:
                p.kill()
                p.wait()
    assert launcher.returncode == 0, log
    assert follower.returncode == 0 and "has ended" in err, err
    assert snaps, "no --once snapshot during the run showed the split"
    events = pl.read_parquet(out / "events.parquet")
    switched = events.filter(pl.col("kind") == "role_switched").sort("at_s")
    snap = snaps[0]
    for e in snap["engines"]:  # the role each engine had at the snapshot, by the log
        before = switched.filter((pl.col("engine_id") == e["engine_id"]) & (pl.col("at_s") <= e["at_s"]))
        expected = before["role"][-1] if before.height else "colocated"
        assert e["role"] == expected, (e, switched)
        assert not e["silent"] and e["backend"] == "emulated"
    assert {s["role"] for s in snap["switches"]["recent"]} == {"prefill", "decode"}
    assert {s["from_role"] for s in snap["switches"]["recent"]} == {"colocated"}
    assert snap["split"]["ratio"] == "1:1"
    assert any(snap["demand"]["targets"]["prefill_engine_s"]["measured"])  # weighed by the cost model of the run's config.json
    follow = [json.loads(line) for line in lines.splitlines()]
    assert any(s["switches"]["total"] >= 2 for s in follow)  # the live view saw them too
    final = [s for s in follow if s["trajectories"]["events_total"]][-1]
    assert final["trajectories"]["finished"] == json.loads((out / "summary.json").read_text())["trajectories_finished"]


def test_a_switch_seen_before_any_report_of_the_engine_starts_from_the_role_the_config_gives_it(tmp_path):
    from ops.monitor_bus import run_hints

    config = write_tiny_config(tmp_path / "tiny.toml", policy="prorsa")
    (tmp_path / "config.json").write_bytes(msgspec.json.encode(load_config(config)))
    hints = run_hints(tmp_path)
    assert set(hints["initial_roles"].values()) == {"colocated"}
    state = MonitorState(initial_roles=hints["initial_roles"])
    state.on_lifecycle(event(EventKind.ROLE_SWITCHED, 3.0, "", engine_id="e0", role="prefill", duration_s=0.5), wall_s=1.0)
    assert [s["from_role"] for s in state.snapshot(1.5)["switches"]["recent"]] == ["colocated"]
    assert MonitorState().engines.role_when("e0", 1.0) == ""  # no config, nothing reported: unknown
