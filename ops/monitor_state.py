"""The monitor's state: what the bus has said about a run, as one JSON-able snapshot.

Pure: no I/O and no clock of its own. The bus adapter (`ops.monitor_bus`) hands every
message it receives to `ingest(subject, data, wall_s)` (or a decoded Struct to the matching
`on_*` method), plus what it learns from JetStream (`on_stream_info`, `on_dead_letter`);
`snapshot(wall_s)` gives the dashboard, `--json` and `--prometheus` the same dict. Tests
drive it directly.

Two clocks, both given by the caller: *wall* seconds (when a message arrived here:
heartbeat age, leases, unacked switches) and *model* seconds (the `at_s` the actors stamp:
rates, the P:D history, demand bins), so a lifecycle log replayed from the start of the
stream gives the same rates as one watched live.

`MonitorState` routes each message to the parts that keep it:

    ingest(subject, bytes) -> on_* (decoded Struct)
        EngineStatus    -> Engines (ops.monitor_engines), Switches (settled by a heartbeat)
        LifecycleEvent  -> Trajectories (ops.monitor_phases), Engines (role stamps),
                           Switches (role_switched), Demand (ops.monitor_demand)
        DemandForecast  -> Demand
        SetRole, ack    -> Switches (ops.monitor_switches)
        ActorStatus, ActorReport, StepReport, stream info, dead letters -> Health (ops.monitor_health), steps
    snapshot(wall_s) <- each part's view, and Health's alerts over them all
"""

from __future__ import annotations

import msgspec

from bus_schemas import subjects
from bus_schemas.codec import decode
from bus_schemas.control import AllocationDecision, Command, CommandAck, SetRole
from bus_schemas.forecast import DemandForecast
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.status import ActorReport, ActorStatus, EngineStatus
from bus_schemas.train import StepReport
from forecasting.series import TokenCost
from ops.monitor_common import rounded
from ops.monitor_demand import Demand
from ops.monitor_engines import Engines
from ops.monitor_health import CTL_ENGINE_ALL, LIFECYCLE_ALL, REPORT_ALL, Health
from ops.monitor_phases import Trajectories
from ops.monitor_switches import Switches

_STATUS_ENGINE = subjects.status_of_kind("engine")


class MonitorState:
    """Everything the monitor knows, fed message by message; `snapshot()` reads it out."""

    def __init__(
        self,
        *,
        lease_wall_s: float | None = None,
        heartbeat_wall_s: float | None = None,
        time_scale: float | None = None,
        expected_engines: list[str] | tuple[str, ...] = (),
        initial_roles: dict[str, str] | None = None,
        ack_grace_wall_s: float = 10.0,
        window_s: float = 300.0,
        rate_window_s: float = 10.0,
        history_points: int = 60,
        spark_bins: int = 120,
        stream_full_ratio: float = 0.9,
        max_switches: int = 200,
        prefill_cost: TokenCost | None = None,
    ) -> None:
        self.expected_engines = list(expected_engines)
        self.engines = Engines(
            lease_wall_s=lease_wall_s,
            heartbeat_wall_s=heartbeat_wall_s,
            time_scale=time_scale,
            rate_window_s=rate_window_s,
            window_s=window_s,
            history_points=history_points,
            initial_roles=initial_roles,
        )
        self.trajectories = Trajectories(rate_window_s=rate_window_s)
        self.switches = Switches(ack_grace_wall_s=ack_grace_wall_s, max_switches=max_switches)
        self.demand = Demand(spark_bins=spark_bins, prefill_cost=prefill_cost)
        self.health = Health(stream_full_ratio=stream_full_ratio)
        self.bus: dict = {"url": "", "source": "", "connected": False, "error": "", "lifecycle": "", "run_name": ""}
        self.model_now_s = 0.0
        self.messages = 0
        self.steps: list[dict] = []

    # the settings callers read or change after construction
    @property
    def heartbeat_wall_s(self) -> float | None:
        return self.engines.heartbeat_wall_s

    @property
    def rate_window_s(self) -> float:
        return self.engines.rate_window_s

    @property
    def prefill_cost(self) -> TokenCost | None:
        return self.demand.prefill_cost

    @prefill_cost.setter
    def prefill_cost(self, cost: TokenCost | None) -> None:
        self.demand.prefill_cost = cost

    # --- feeding ---------------------------------------------------------------------------
    def on_bus(self, **fields) -> None:
        """The adapter's connection facts: url, source, connected, error, lifecycle, run_name."""
        self.bus.update(fields)

    def ingest(self, subject: str, data: bytes, wall_s: float) -> None:
        """Decode one message by its subject and take it in; a malformed one is counted."""
        try:
            if subjects.matches(_STATUS_ENGINE, subject):
                self.on_engine_status(decode(EngineStatus, data), wall_s)
            elif subjects.matches(subjects.status_all(), subject):
                self.on_actor_status(decode(ActorStatus, data), wall_s)
            elif subjects.matches(LIFECYCLE_ALL, subject):
                self.on_lifecycle(decode(LifecycleEvent, data), wall_s)
            elif subject == subjects.forecast():
                self.on_forecast(decode(DemandForecast, data), wall_s)
            elif subject == subjects.allocation():
                self.switches.on_decision(decode(AllocationDecision, data))
            elif subjects.matches(CTL_ENGINE_ALL, subject):
                command = decode(Command, data)
                if isinstance(command, SetRole):
                    self.on_set_role(subject.rsplit(".", 1)[-1], command, wall_s)
            elif subject == subjects.train_step():
                self.on_step(decode(StepReport, data), wall_s)
            elif subjects.matches(REPORT_ALL, subject):
                self.on_report(decode(ActorReport, data), wall_s)
            else:
                return  # not ours (a reply inbox: see on_ack)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            self.on_invalid(subject, str(err), wall_s)

    def ingest_ack(self, subject: str, data: bytes, wall_s: float) -> None:
        """A reply seen on a commander's inbox; a non-ack reply there is not counted."""
        try:
            ack = decode(CommandAck, data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        self.on_ack(ack, wall_s)

    def on_invalid(self, subject: str, error: str, wall_s: float) -> None:
        self.health.on_invalid(subject, error, wall_s)

    def _seen(self, at_s: float) -> None:
        self.messages += 1
        if at_s > self.model_now_s:
            self.model_now_s = at_s

    def on_engine_status(self, s: EngineStatus, wall_s: float) -> None:
        self._seen(s.at_s)
        self.engines.on_status(s, wall_s)
        self.switches.on_heartbeat(s)

    def on_actor_status(self, s: ActorStatus, wall_s: float) -> None:
        self._seen(s.at_s)
        self.health.on_actor_status(s, wall_s)

    def on_report(self, r: ActorReport, wall_s: float) -> None:
        self._seen(r.at_s)
        self.health.on_report(r)

    def on_step(self, r: StepReport, wall_s: float) -> None:
        self._seen(r.rollout_done_at_s)
        self.steps = [s for s in self.steps if s["step"] != r.step]
        self.steps.append(
            {
                "step": r.step,
                "rollout_s": rounded(r.rollout_s),
                "train_s": rounded(r.train_s),
                "trajectories": r.trajectories,
                "mean_reward": rounded(r.mean_reward),
            }
        )
        self.steps.sort(key=lambda s: s["step"])

    def on_set_role(self, engine_id: str, c: SetRole, wall_s: float) -> None:
        self.switches.on_set_role(engine_id, c, wall_s)

    def on_ack(self, ack: CommandAck, wall_s: float) -> None:
        self.switches.on_ack(ack)

    def on_forecast(self, f: DemandForecast, wall_s: float) -> None:
        self._seen(f.as_of_s)
        self.demand.on_forecast(f, wall_s)

    def on_lifecycle(self, ev: LifecycleEvent, wall_s: float) -> None:
        self._seen(ev.at_s)
        self.trajectories.on_event(ev, wall_s, self.model_now_s)
        if ev.kind is EventKind.ROLE_SWITCHED:
            self.switches.on_switched(ev, self.engines.role_when(ev.engine_id, ev.at_s, inclusive=False), wall_s)
        self.engines.on_event(ev, self.model_now_s)
        if ev.trajectory_id:
            self.demand.on_event(ev)

    def on_stream_info(
        self, name: str, *, messages: int, bytes_: int, max_msgs: int = -1, max_bytes: int = -1, discard: str = "", wall_s: float = 0.0
    ) -> None:
        self.health.on_stream_info(
            name, messages=messages, bytes_=bytes_, max_msgs=max_msgs, max_bytes=max_bytes, discard=discard, wall_s=wall_s
        )

    def on_account_info(self, *, storage_bytes: int, max_storage_bytes: int, wall_s: float = 0.0) -> None:
        self.health.on_account_info(storage_bytes=storage_bytes, max_storage_bytes=max_storage_bytes)

    def on_dead_letter(self, *, stream: str, reason: str = "", subject: str = "", wall_s: float = 0.0) -> None:
        """A work item moved to the dead letters (subjects.dead_letter(stream)), seen live."""
        self.health.on_dead_letter(stream=stream, reason=reason, subject=subject, wall_s=wall_s)

    def on_advisory(self, *, kind: str, stream: str, consumer: str = "", deliveries: int = 0, wall_s: float = 0.0) -> None:
        """JetStream gave up on a work item: `terminated` (an actor refused it as malformed) or
        `max_deliveries` (a poison message, which the launcher then moves to the dead letters)."""
        self.health.on_advisory(kind=kind, stream=stream, consumer=consumer, deliveries=deliveries, wall_s=wall_s)

    # --- reading out -----------------------------------------------------------------------
    def scale(self) -> float | None:
        """Model seconds per wall second: the config's, else the heartbeats' median."""
        return self.engines.scale()

    def has_traffic(self) -> bool:
        """Has anything of a Prorsa run been seen (a message, or a non-empty lifecycle stream)?"""
        return self.messages > 0 or sum(self.health.invalid.values()) > 0 or bool(self.health.lifecycle_messages())

    def snapshot(self, wall_s: float) -> dict:
        now_s = self.model_now_s
        engines = self.engines.rows(wall_s, now_s)
        scale = self.scale()
        switches = self.switches.view(wall_s, scale)
        invalid = self.health.invalid_view()
        dead = self.health.dead_view()
        traffic = self.has_traffic()
        missing = [e for e in self.expected_engines if e not in self.engines.by_id and traffic]
        alerts = self.health.alerts(
            bus=self.bus,
            engines=engines,
            missing=missing,
            pending=switches["commands"]["pending"],
            invalid=invalid,
            dead=dead,
            forecast=self.demand.forecast,
        )
        return {
            "wall_s": rounded(wall_s),
            "model_s": rounded(now_s),
            "time_scale": rounded(scale, 3) if scale else None,
            "bus": dict(self.bus),
            "traffic": traffic,
            "messages": self.messages,
            "engines": engines,
            "split": self.engines.split(now_s),
            "trajectories": self.trajectories.view(wall_s, now_s),
            "demand": self.demand.view(now_s),
            "switches": switches,
            "steps": self.steps[-10:],
            "actors": self.health.actors_view(wall_s),
            "invalid": invalid,
            "dead_letters": dead,
            "streams": self.health.streams_view(),
            "alerts": alerts,
        }
