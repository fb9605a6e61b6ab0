"""The monitor's snapshot as Prometheus metrics (`python -m ops.monitor --prometheus PORT`).

Names follow the Prometheus conventions: a `prorsa_` prefix, base units in the name
(`_seconds`, `_tokens`, `_ratio`), `_total` for counters, and an enum as one series per
value with 1 on the current one (`prorsa_engine_role{engine="e0",role="decode"} 1`, as
kube-state-metrics does for pod phases). Rates per second are per *model* second (the
run's own time; equal to wall seconds at `run.time_scale = 1`).

The HTTP thread never touches the live state: the monitor's loop stores a fresh snapshot
every interval (`SnapshotCollector.update`) and each scrape reads the latest one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from ops.monitor_engines import ROLES
from ops.monitor_phases import PHASES


def target_unit(target: str) -> str | None:
    """A forecast target's unit, from its name (forecasting.series names them so)."""
    for suffix, unit in (("_tokens", "tokens"), ("_seqs", "sequences"), ("_engine_s", "engine_seconds")):
        if target.endswith(suffix):
            return unit
    return None


def _g(name: str, doc: str, labels: list[str] | None = None, unit: str = "") -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels, unit=unit)


def metric_families(s: dict) -> list:
    """Every metric family for one snapshot (pure: tests call it directly)."""
    out = []
    up = _g("prorsa_monitor_connected", "1 while the monitor is connected to the bus")
    up.add_metric([], 1.0 if s["bus"].get("connected") else 0.0)
    model = _g("prorsa_model_time_seconds", "Latest model time seen on the bus (seconds since the run's origin)")
    model.add_metric([], s["model_s"] or 0.0)
    out += [up, model]
    if s.get("time_scale"):
        scale = _g("prorsa_time_scale_ratio", "Model seconds per wall second (config, or estimated from heartbeats)")
        scale.add_metric([], s["time_scale"])
        out.append(scale)

    role = _g("prorsa_engine_role", "1 for the engine's current role, 0 for the others", ["engine", "role"])
    info = InfoMetricFamily("prorsa_engine", "The engine's backend", labels=["engine"])
    per_engine = {
        "prorsa_engine_epoch": ("epoch", "Allocator epoch the engine is at"),
        "prorsa_engine_policy_version": ("policy_version", "Policy version loaded"),
        "prorsa_engine_switching": ("switching", "1 while a SetRole is being carried out"),
        "prorsa_queue_depth": ("queue_depth", "Sequences admitted, waiting for prefill"),
        "prorsa_queue_tokens": ("queue_tokens", "Prefill tokens still to compute for the waiting sequences"),
        "prorsa_running_sequences": ("running", "Sequences decoding"),
        "prorsa_held_kv_handles": ("held_kv_handles", "Prefilled KV waiting for a decode engine to fetch it"),
        "prorsa_kv_used_tokens": ("kv_used_tokens", "Tokens of KV resident"),
        "prorsa_kv_capacity_tokens": ("kv_capacity_tokens", "KV capacity in tokens"),
        "prorsa_kv_usage_ratio": ("kv_use", "KV used / capacity"),
        "prorsa_engine_busy_ratio": ("busy", "Share of time spent in iterations since the last heartbeat"),
        "prorsa_heartbeat_age_seconds": ("heartbeat_age_s", "Wall seconds since the engine's last heartbeat"),
        "prorsa_engine_lease_seconds": ("lease_s", "Wall seconds of silence after which the engine counts as gone"),
        "prorsa_engine_silent": ("silent", "1 when the last heartbeat is older than the lease"),
        "prorsa_engine_registrations": ("registrations", "Incarnations seen (a restart or a lease lapse adds one)"),
    }
    gauges = {name: _g(name, doc, ["engine"]) for name, (_, doc) in per_engine.items()}
    tps = _g("prorsa_engine_tokens_per_second", "Tokens per model second, over the last seconds", ["engine", "phase"])
    for e in s["engines"]:
        eid = e["engine_id"]
        for r in ROLES:
            role.add_metric([eid, r], 1.0 if e["role"] == r else 0.0)
        info.add_metric([eid], {"backend": e["backend"]})
        for name, (key, _) in per_engine.items():
            value = e[key]
            if value is not None:
                gauges[name].add_metric([eid], float(value))
        tps.add_metric([eid, "prefill"], e["prefill_tokens_per_s"] or 0.0)
        tps.add_metric([eid, "decode"], e["decode_tokens_per_s"] or 0.0)
    out += [role, info, *gauges.values(), tps]

    engines = _g("prorsa_engines", "Engines per role (the fleet's P:D split)", ["role"])
    for r in ROLES:
        engines.add_metric([r], s["split"][r])
    switching = _g("prorsa_engines_switching", "Engines carrying out a role switch")
    switching.add_metric([], s["split"]["switching"])
    out += [engines, switching]

    t = s["trajectories"]
    phases = _g("prorsa_trajectories", "Live trajectories by lifecycle phase", ["phase"])
    for p in PHASES:
        phases.add_metric([p], t[p])
    queued = _g("prorsa_trajectories_queued", "Queued trajectories by the stage they wait for", ["stage"])
    queued.add_metric(["prefill"], t["queued_for_prefill"])
    queued.add_metric(["decode"], t["queued_for_decode"])
    started = CounterMetricFamily("prorsa_trajectories_started", "Trajectories started (seen on the lifecycle stream)")
    started.add_metric([], t["started"])
    finished = CounterMetricFamily("prorsa_trajectories_finished", "Trajectories finished (seen on the lifecycle stream)")
    finished.add_metric([], t["finished"])
    events = CounterMetricFamily("prorsa_lifecycle_events", "Lifecycle events seen, by kind", labels=["kind"])
    for kind, n in t["events_by_kind"].items():
        events.add_metric([kind], n)
    rate = _g("prorsa_lifecycle_event_rate", "Lifecycle events per model second, over the last seconds")
    rate.add_metric([], t["events_per_s"] or 0.0)
    step = _g("prorsa_rl_step", "RL step under way (-1 before the first)")
    step.add_metric([], t["step"])
    out += [phases, queued, started, finished, events, rate, step]

    d = s["demand"]
    forecast, demand = {}, {}
    for unit, what in (
        ("tokens", "tokens in the bin"),
        ("sequences", "mean sequences over the bin"),
        ("engine_seconds", "engine-seconds of prefill compute in the bin"),
    ):
        forecast[unit] = _g(f"prorsa_forecast_{unit}", f"Latest forecast: {what} ending horizon seconds after as_of", ["target", "horizon"])
        demand[unit] = _g(f"prorsa_demand_{unit}", f"Measured demand: {what}, the last whole bin", ["target"])
    for target, v in d["targets"].items():
        unit = target_unit(target)
        if unit is None:
            continue
        for h, x in zip(d["horizons_s"], v["forecast"]):
            if x is not None:
                forecast[unit].add_metric([target, f"{h:g}"], x)
        if v["last_measured"] is not None:
            demand[unit].add_metric([target], v["last_measured"])
    bin_s = _g("prorsa_forecast_bin_seconds", "Width of one demand bin, model seconds")
    bin_s.add_metric([], d["bin_s"])
    tick = _g("prorsa_forecast_tick", "Latest forecast tick")
    tick.add_metric([], d["tick"] if d["tick"] is not None else 0)
    as_of = _g("prorsa_forecast_as_of_seconds", "Model time the latest forecast is made from")
    as_of.add_metric([], d["as_of_s"] or 0.0)
    fallback = _g("prorsa_forecast_fallback", "1 when the latest forecast fell back to naive")
    fallback.add_metric([], 1.0 if d["fallback"] else 0.0)
    skipped = CounterMetricFamily("prorsa_forecast_skipped_ticks", "Ticks the forecaster skipped, behind the bus")
    skipped.add_metric([], d["skipped_ticks"])
    out += [*forecast.values(), *demand.values(), bin_s, tick, as_of, fallback, skipped]

    sw = s["switches"]
    switches = CounterMetricFamily("prorsa_role_switches", "Role switches carried out (role_switched events)")
    switches.add_metric([], sw["total"])
    cost = CounterMetricFamily("prorsa_role_switch_cost_seconds", "Model seconds engines spent switching (drain + reconfiguration)")
    cost.add_metric([], sw["cost_s_total"] or 0.0)
    commands = CounterMetricFamily("prorsa_role_commands", "SetRole commands seen, by outcome", labels=["outcome"])
    for outcome in ("sent", "acked", "refused", "superseded"):
        commands.add_metric([outcome], sw["commands"][outcome])
    pending = _g("prorsa_role_commands_pending", "SetRole commands not acked yet")
    pending.add_metric([], len(sw["commands"]["pending"]))
    out += [switches, cost, commands, pending]

    invalid = CounterMetricFamily("prorsa_invalid_messages", "Malformed messages seen on watched subjects", labels=["subject"])
    for subject, n in s["invalid"]["by_subject"].items():
        invalid.add_metric([subject], n)
    rejected = _g("prorsa_actor_invalid_messages", "Malformed messages actors report having rejected", ["actor"])
    for actor, n in s["invalid"]["reported_by_actors"].items():
        rejected.add_metric([actor], n)
    dead = _g("prorsa_dead_letters", "Work items in the dead letters (the DEAD stream, else seen while watching)")
    dead.add_metric([], s["dead_letters"]["total"])
    gave_up = CounterMetricFamily("prorsa_jetstream_gave_up", "Work items JetStream gave up on while watched", labels=["reason"])
    gave_up.add_metric(["terminated"], s["dead_letters"]["terminated"])
    gave_up.add_metric(["max_deliveries"], s["dead_letters"]["max_deliveries"])
    out += [invalid, rejected, dead, gave_up]

    msgs = _g("prorsa_stream_messages", "Messages in a JetStream stream", ["stream"])
    size = _g("prorsa_stream_bytes", "Bytes in a JetStream stream", ["stream"])
    full = _g("prorsa_stream_fullness_ratio", "Stream use against its limits (messages or bytes, whichever is fuller)", ["stream"])
    for name, st in s["streams"].items():
        if name == "account":
            if st.get("fullness") is not None:
                full.add_metric(["account"], st["fullness"])
            continue
        msgs.add_metric([name], st["messages"])
        size.add_metric([name], st["bytes"])
        if st.get("fullness") is not None:
            full.add_metric([name], st["fullness"])
    out += [msgs, size, full]

    alerts = _g("prorsa_alerts", "Active alerts by kind", ["kind"])
    kinds: dict[str, int] = {
        k: 0
        for k in (
            "engine_silent",
            "engine_missing",
            "switch_not_acked",
            "dead_letters",
            "stream_near_full",
            "invalid_messages",
            "bus_disconnected",
            "forecast_fallback",
        )
    }
    for a in s["alerts"]:
        kinds[a["kind"]] = kinds.get(a["kind"], 0) + 1
    for kind, n in kinds.items():
        alerts.add_metric([kind], n)
    out.append(alerts)
    return out


class SnapshotCollector(Collector):
    """Serves the latest snapshot it was given."""

    def __init__(self) -> None:
        self._snapshot: dict | None = None
        self._lock = threading.Lock()

    def update(self, snapshot: dict) -> None:
        with self._lock:
            self._snapshot = snapshot

    def collect(self) -> Iterator:
        with self._lock:
            snapshot = self._snapshot
        if snapshot is None:
            return iter(())
        return iter(metric_families(snapshot))


def serve(port: int, addr: str = "0.0.0.0") -> tuple[SnapshotCollector, object]:
    """Start the /metrics endpoint on its own registry; returns (collector, server)."""
    registry = CollectorRegistry(auto_describe=False)
    collector = SnapshotCollector()
    registry.register(collector)
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return collector, server
