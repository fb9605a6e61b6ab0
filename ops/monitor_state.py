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
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, deque
from dataclasses import dataclass, field

import msgspec

from bus_schemas import streams, subjects
from bus_schemas.codec import decode
from bus_schemas.control import Command, CommandAck, SetRole
from bus_schemas.forecast import DemandForecast
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.status import ActorReport, ActorStatus, EngineStatus
from bus_schemas.train import StepReport
from forecasting.series import PrefillCost

ROLES = ("prefill", "decode", "colocated")
PHASES = ("queued", "prefill", "decode", "tool")
# Forecast targets measured here as forecasting.series defines them; a forecast's other targets show without a measured line.
DEMAND_TARGETS = ("prefill_new_tokens", "prefill_miss_tokens", "prefill_engine_s", "decode_tokens", "decode_active_seqs")
LEVEL_TARGETS = ("decode_active_seqs",)
# prefill_engine_s = per_token_s * miss + per_token_pair_s * miss * (prefix + miss / 2) (forecasting.series.PrefillCost):
# the two sums are kept per bin, so the run's cost coefficients can come later (set `prefill_cost`)
_ATTN = "_prefill_token_pairs"  # per bin: sum of miss * (prefix + miss / 2); the miss sum is prefill_miss_tokens

# A trajectory's phase after each lifecycle kind (kinds not listed leave it where it is).
_PHASE_AFTER = {
    EventKind.STARTED: ("queued", "prefill"),
    EventKind.PREFILL_QUEUED: ("queued", "prefill"),
    EventKind.REPREFILL: ("queued", "prefill"),
    EventKind.TOOL_DONE: ("queued", "prefill"),
    EventKind.PREFILL_STARTED: ("prefill", ""),
    EventKind.PREFILL_DONE: ("queued", "decode"),
    EventKind.DECODE_QUEUED: ("queued", "decode"),
    EventKind.KV_TRANSFER_DONE: ("queued", "decode"),
    EventKind.DECODE_STARTED: ("decode", ""),
    EventKind.DECODE_MIGRATED: ("decode", ""),
    EventKind.DECODE_DONE: ("tool", ""),  # back with its environment: a tool call or the end
    EventKind.TOOL_STARTED: ("tool", ""),
}
_ORDER = {kind: i for i, kind in enumerate(EventKind)}  # tie-break for events stamped at the same time
# Events an engine stamps with its own role at the time (its role history between heartbeats).
_ENGINE_KINDS = {
    EventKind.PREFILL_STARTED, EventKind.PREFILL_DONE, EventKind.DECODE_QUEUED, EventKind.KV_TRANSFER_DONE,
    EventKind.DECODE_STARTED, EventKind.DECODE_DONE, EventKind.DECODE_MIGRATED,
}  # fmt: skip

_STATUS_ENGINE = subjects.status_of_kind("engine")
_LIFECYCLE = subjects.lifecycle_all()
_CTL = subjects.ctl_engine("x").rsplit(".", 1)[0] + ".*"  # ctl_engine refuses a wildcard id
_REPORT = subjects.report_all()


def subject_family(subject: str) -> str:
    """A subject without its instance token, for counting: `prorsa.status.engine.e3` ->
    `prorsa.status.engine`, `prorsa.lc.decode_done` -> `prorsa.lc`."""
    if subjects.matches(subjects.status_all(), subject):
        return ".".join(subject.split(".")[:3])
    for pattern in (_LIFECYCLE, _CTL, _REPORT):
        if subjects.matches(pattern, subject):
            return pattern.removesuffix(".*")
    return subject


@dataclass(slots=True)
class _Engine:
    status: EngineStatus
    wall_s: float  # when its last heartbeat arrived
    periods: deque = field(default_factory=lambda: deque(maxlen=16))  # wall seconds between heartbeats
    prefill_totals: deque = field(default_factory=deque)  # (at_s, prefilled_tokens_total)
    scale_samples: deque = field(default_factory=lambda: deque(maxlen=16))  # model s per wall s between heartbeats
    registrations: int = 1  # incarnations seen (EngineStatus.incarnation changes at a restart or after a lease lapse)


@dataclass(slots=True)
class _Command:
    engine_id: str
    role: str
    epoch: int
    wall_s: float
    drain_deadline_s: float
    state: str = "pending"  # pending | acked | refused | superseded (settled by its ack, a role_switched event or a heartbeat)


@dataclass(slots=True)
class _Traj:
    key: tuple  # (at_s, order) of the event that set the phase
    phase: str
    waiting_for: str  # queued: "prefill" or "decode"


def _r(x: float | None, nd: int = 3) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), nd)


class MonitorState:
    """Everything the monitor knows, fed message by message; `snapshot()` reads it out."""

    def __init__(
        self,
        *,
        lease_wall_s: float | None = None,
        heartbeat_wall_s: float | None = None,
        time_scale: float | None = None,
        expected_engines: list[str] | tuple[str, ...] = (),
        ack_grace_wall_s: float = 10.0,
        window_s: float = 300.0,
        rate_window_s: float = 10.0,
        history_points: int = 60,
        spark_bins: int = 120,
        stream_full_ratio: float = 0.9,
        max_switches: int = 200,
        prefill_cost: PrefillCost | None = None,
    ) -> None:
        self.lease_wall_s = lease_wall_s  # None: 10 heartbeat periods, at least 3 s (run.lease_wall_s's default)
        self.heartbeat_wall_s = heartbeat_wall_s  # None: estimated from the heartbeats' spacing
        self.time_scale = time_scale  # None: estimated from the heartbeats (model s per wall s)
        self.expected_engines = list(expected_engines)
        self.ack_grace_wall_s = ack_grace_wall_s
        self.window_s = window_s
        self.rate_window_s = rate_window_s
        self.history_points = history_points
        self.spark_bins = spark_bins
        self.stream_full_ratio = stream_full_ratio
        self.bus: dict = {"url": "", "source": "", "connected": False, "error": "", "lifecycle": "", "run_name": ""}
        self.model_now_s = 0.0
        self.messages = 0
        self.engines: dict[str, _Engine] = {}
        self.role_changes: dict[str, list[tuple[float, str]]] = {}  # engine -> [(at_s, role)] sorted
        self.decode_tokens: dict[str, deque] = {}  # engine -> (at_s, generated tokens of a decode_done)
        self.actors: dict[str, dict] = {}
        self.reports: dict[str, ActorReport] = {}
        self.trajectories: dict[str, _Traj] = {}
        self.finished: set[str] = set()
        self.started = 0
        self.events_total = 0
        self.events_by_kind: Counter[str] = Counter()
        self.event_times: deque[float] = deque()  # at_s of recent events (the rate)
        self.event_walls: deque[float] = deque()  # arrival wall time of recent events
        self.step = -1
        self.steps: list[dict] = []
        self.switches: deque[dict] = deque(maxlen=max_switches)
        self.switches_total = 0
        self.switch_cost_s_total = 0.0
        self.commands: dict[tuple[str, int], _Command] = {}
        self.commands_by_state: Counter[str] = Counter()
        self.forecast: DemandForecast | None = None
        self.forecast_wall_s: float | None = None
        self.forecasts_total = 0
        self.bin_s = 1.0
        self.prefill_cost: PrefillCost | None = prefill_cost  # the run's, for prefill_engine_s (None: not measured)
        self.measured: dict[str, dict[int, float]] = {t: {} for t in (*DEMAND_TARGETS, _ATTN)}
        self.predicted: dict[str, dict[int, float]] = {}  # target -> bin -> the forecast's first horizon
        self._level = {t: 0.0 for t in LEVEL_TARGETS}
        self._level_at = {t: 0.0 for t in LEVEL_TARGETS}
        self.invalid: Counter[str] = Counter()
        self.invalid_last: deque[dict] = deque(maxlen=5)
        self.dead_letters = 0  # seen on the dead-letter subject while watching
        self.dead_letter_last: dict | None = None
        self.advisories: Counter[str] = Counter()  # JetStream advisories: terminated, max_deliveries
        self.advisory_last: dict | None = None
        self.streams: dict[str, dict] = {}
        self.account: dict = {}

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
            elif subjects.matches(_LIFECYCLE, subject):
                self.on_lifecycle(decode(LifecycleEvent, data), wall_s)
            elif subject == subjects.forecast():
                self.on_forecast(decode(DemandForecast, data), wall_s)
            elif subjects.matches(_CTL, subject):
                command = decode(Command, data)
                if isinstance(command, SetRole):
                    self.on_set_role(subject.rsplit(".", 1)[-1], command, wall_s)
            elif subject == subjects.train_step():
                self.on_step(decode(StepReport, data), wall_s)
            elif subjects.matches(_REPORT, subject):
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
        family = subject_family(subject)
        self.invalid[family] += 1
        self.invalid_last.append({"subject": subject, "error": error[:200], "wall_s": wall_s})

    def _seen(self, at_s: float) -> None:
        self.messages += 1
        if at_s > self.model_now_s:
            self.model_now_s = at_s

    def on_engine_status(self, s: EngineStatus, wall_s: float) -> None:
        self._seen(s.at_s)
        e = self.engines.get(s.engine_id)
        if e is None:
            e = self.engines[s.engine_id] = _Engine(status=s, wall_s=wall_s)
        else:
            if s.incarnation != e.status.incarnation:
                e.registrations += 1  # restarted, or back after a lease lapse
            dt_wall = wall_s - e.wall_s
            if dt_wall > 0:
                e.periods.append(dt_wall)
                if s.at_s > e.status.at_s:
                    e.scale_samples.append((s.at_s - e.status.at_s) / dt_wall)
            e.status, e.wall_s = s, wall_s
        totals = e.prefill_totals
        if totals and (s.prefilled_tokens_total < totals[-1][1] or s.at_s < totals[-1][0]):
            totals.clear()  # a restarted engine counts from 0 again
        totals.append((s.at_s, s.prefilled_tokens_total))
        while len(totals) > 2 and totals[1][0] <= s.at_s - self.rate_window_s:
            totals.popleft()
        self._role_at(s.engine_id, s.at_s, s.role.value)
        for cmd in self.commands.values():  # a heartbeat at the command's epoch, settled: carried out
            if cmd.engine_id == s.engine_id and cmd.state == "pending" and s.epoch >= cmd.epoch and not s.switching:
                self._settle(cmd, "acked" if s.role.value == cmd.role or s.epoch > cmd.epoch else "superseded")

    def on_actor_status(self, s: ActorStatus, wall_s: float) -> None:
        self._seen(s.at_s)
        self.actors[s.actor_id] = {"kind": s.kind, "at_s": s.at_s, "wall_s": wall_s, "live_trajectories": s.live_trajectories, "counters": dict(s.counters)}

    def on_report(self, r: ActorReport, wall_s: float) -> None:
        self._seen(r.at_s)
        self.reports[r.actor_id] = r

    def on_step(self, r: StepReport, wall_s: float) -> None:
        self._seen(r.rollout_done_at_s)
        self.steps = [s for s in self.steps if s["step"] != r.step]
        self.steps.append({"step": r.step, "rollout_s": _r(r.rollout_s), "train_s": _r(r.train_s), "trajectories": r.trajectories, "mean_reward": _r(r.mean_reward)})
        self.steps.sort(key=lambda s: s["step"])

    def on_set_role(self, engine_id: str, c: SetRole, wall_s: float) -> None:
        key = (engine_id, c.epoch)
        if key in self.commands:  # the allocator asked again (same epoch): one switch
            return
        for old in self.commands.values():  # a newer epoch for the same engine supersedes an older pending one
            if old.engine_id == engine_id and old.state == "pending" and old.epoch < c.epoch:
                self._settle(old, "superseded")
        cmd = _Command(engine_id, c.role.value, c.epoch, wall_s, c.drain_deadline_s)
        self.commands[key] = cmd
        self.commands_by_state["sent"] += 1
        if len(self.commands) > 1000:  # keep the recent ones
            for k in list(self.commands)[:-500]:
                del self.commands[k]

    def on_ack(self, ack: CommandAck, wall_s: float) -> None:
        if ack.command != "set_role":
            return
        cmd = self.commands.get((ack.engine_id, ack.epoch))
        if cmd is None:  # a refusal names the engine's epoch, not the command's: the oldest pending one
            cmd = next((c for c in self.commands.values() if c.engine_id == ack.engine_id and c.state == "pending"), None)
        if cmd is None:
            return
        self._settle(cmd, "acked" if ack.ok else "refused")

    def _settle(self, cmd: _Command, state: str) -> None:
        if cmd.state != "pending":
            return
        cmd.state = state
        self.commands_by_state[state] += 1
        for sw in reversed(self.switches):  # the switch it caused, if logged already
            if sw["engine_id"] == cmd.engine_id and sw["epoch"] is None and sw["role"] == cmd.role:
                sw["epoch"] = cmd.epoch
                break

    def on_forecast(self, f: DemandForecast, wall_s: float) -> None:
        self._seen(f.as_of_s)
        if not math.isclose(f.bin_s, self.bin_s):
            self.bin_s = f.bin_s
            self.measured = {t: {} for t in self.measured}
            self.predicted = {}
        self.forecast, self.forecast_wall_s = f, wall_s
        self.forecasts_total += 1
        if f.horizons_s:
            h0 = f.horizons_s[0]
            b = round((f.as_of_s + h0) / f.bin_s) - 1  # the bin that ends h0 after as_of_s
            for t in f.targets:
                if t.mean:
                    series = self.predicted.setdefault(t.target, {})
                    series[b] = float(t.mean[0])
                    self._trim(series, b)

    def on_lifecycle(self, ev: LifecycleEvent, wall_s: float) -> None:
        self._seen(ev.at_s)
        self.events_total += 1
        self.events_by_kind[ev.kind.value] += 1
        self.event_times.append(ev.at_s)
        while self.event_times and self.event_times[0] < self.model_now_s - self.rate_window_s:
            self.event_times.popleft()
        self.event_walls.append(wall_s)
        while self.event_walls and self.event_walls[0] < wall_s - self.rate_window_s:
            self.event_walls.popleft()
        kind = ev.kind
        if kind is EventKind.ROLE_SWITCHED:
            self._on_switched(ev, wall_s)
        elif kind in (EventKind.STEP_STARTED,):
            self.step = max(self.step, ev.step)
        if ev.engine_id and ev.role and kind in _ENGINE_KINDS and ev.actor_id == ev.engine_id:
            self._role_at(ev.engine_id, ev.at_s, ev.role)
        if kind is EventKind.DECODE_DONE and ev.engine_id:
            q = self.decode_tokens.setdefault(ev.engine_id, deque())
            q.append((ev.at_s, ev.generated_tokens))
            while q and q[0][0] < self.model_now_s - self.rate_window_s:
                q.popleft()
        if ev.trajectory_id:
            self._demand(ev)
            self._phase(ev)

    def _on_switched(self, ev: LifecycleEvent, wall_s: float) -> None:
        from_role = self._role_before(ev.engine_id, ev.at_s)
        cmd = next(
            (c for c in reversed(self.commands.values()) if c.engine_id == ev.engine_id and c.role == ev.role and c.state in ("pending", "acked")),
            None,
        )
        if cmd is not None:
            self._settle(cmd, "acked")
        self.switches.append(
            {
                "at_s": _r(ev.at_s),
                "engine_id": ev.engine_id,
                "from_role": from_role,
                "role": ev.role,
                "cost_s": _r(ev.duration_s),
                "epoch": cmd.epoch if cmd is not None else None,
                "wall_s": wall_s,
            }
        )
        self.switches_total += 1
        self.switch_cost_s_total += ev.duration_s
        self._role_at(ev.engine_id, ev.at_s, ev.role)

    def _phase(self, ev: LifecycleEvent) -> None:
        tid = ev.trajectory_id
        if tid in self.finished:
            return
        if ev.kind is EventKind.FINISHED:
            self.finished.add(tid)
            self.trajectories.pop(tid, None)
            return
        if ev.kind is EventKind.STARTED and tid not in self.trajectories:
            self.started += 1
        after = _PHASE_AFTER.get(ev.kind)
        if after is None:
            return
        key = (ev.at_s, _ORDER[ev.kind])
        t = self.trajectories.get(tid)
        if t is None:
            self.trajectories[tid] = _Traj(key, *after)
        elif key >= t.key:
            t.key, (t.phase, t.waiting_for) = key, after

    def _demand(self, ev: LifecycleEvent) -> None:
        """Measured demand per bin, as forecasting.series defines the targets."""
        b = math.floor(ev.at_s / self.bin_s)
        flows: tuple = ()
        if ev.kind is EventKind.PREFILL_QUEUED:
            flows = (("prefill_new_tokens", ev.new_tokens),)
        elif ev.kind is EventKind.PREFILL_DONE:
            miss = ev.context_tokens - ev.cached_prefix_tokens + ev.new_tokens
            flows = (("prefill_miss_tokens", miss), (_ATTN, miss * (ev.cached_prefix_tokens + miss / 2.0)))
        elif ev.kind is EventKind.DECODE_DONE:
            flows = (("decode_tokens", ev.generated_tokens),)
        for target, value in flows:
            series = self.measured[target]
            series[b] = series.get(b, 0.0) + value
            self._trim(series, b)
        if ev.kind in (EventKind.DECODE_STARTED, EventKind.DECODE_DONE):
            self._step_level("decode_active_seqs", ev.at_s, 1.0 if ev.kind is EventKind.DECODE_STARTED else -1.0)

    def _step_level(self, target: str, at_s: float, delta: float) -> None:
        """A time-weighted level: the old level is added to the bins it spanned, then it steps."""
        self._spread_level(target, at_s, self.measured[target])
        self._level[target] += delta

    def _spread_level(self, target: str, until_s: float, into: dict[int, float]) -> None:
        start = self._level_at[target]
        if until_s <= start:
            return  # a late event: it only steps the level
        level = self._level[target]
        if start < until_s - self.spark_bins * 2 * self.bin_s:  # a long gap: only the recent bins matter
            start = until_s - self.spark_bins * 2 * self.bin_s
        b = math.floor(start / self.bin_s)
        while start < until_s:
            end = min((b + 1) * self.bin_s, until_s)
            if level:
                into[b] = into.get(b, 0.0) + level * (end - start) / self.bin_s
            start, b = end, b + 1
        if into is self.measured[target]:
            self._level_at[target] = until_s
            self._trim(into, b)

    def _trim(self, series: dict[int, float], newest: int) -> None:
        if len(series) > 4 * self.spark_bins:
            for k in [k for k in series if k < newest - 2 * self.spark_bins]:
                del series[k]

    def _role_at(self, engine_id: str, at_s: float, role: str) -> None:
        changes = self.role_changes.setdefault(engine_id, [])
        i = bisect.bisect_right(changes, (at_s, "\uffff"))
        if i > 0 and changes[i - 1][1] == role:
            return
        if i < len(changes) and changes[i][1] == role:  # the next known change is to this role: it began earlier
            changes[i] = (at_s, role)
            return
        changes.insert(i, (at_s, role))
        if len(changes) > 1000:
            del changes[:500]

    def _role_before(self, engine_id: str, at_s: float) -> str:
        changes = self.role_changes.get(engine_id, [])
        i = bisect.bisect_left(changes, (at_s, ""))
        return changes[i - 1][1] if i > 0 else ""

    def _role_when(self, engine_id: str, at_s: float) -> str:
        changes = self.role_changes.get(engine_id, [])
        i = bisect.bisect_right(changes, (at_s, "\uffff"))
        return changes[i - 1][1] if i > 0 else ""

    def on_stream_info(self, name: str, *, messages: int, bytes_: int, max_msgs: int = -1, max_bytes: int = -1, discard: str = "", wall_s: float = 0.0) -> None:
        ratios = [n / m for n, m in ((messages, max_msgs), (bytes_, max_bytes)) if m and m > 0]
        self.streams[name] = {
            "messages": messages,
            "bytes": bytes_,
            "max_msgs": max_msgs,
            "max_bytes": max_bytes,
            "discard": discard,
            "fullness": _r(max(ratios), 4) if ratios else None,
            "wall_s": wall_s,
        }

    def on_account_info(self, *, storage_bytes: int, max_storage_bytes: int, wall_s: float = 0.0) -> None:
        self.account = {
            "storage_bytes": storage_bytes,
            "max_storage_bytes": max_storage_bytes,
            "fullness": _r(storage_bytes / max_storage_bytes, 4) if max_storage_bytes and max_storage_bytes > 0 else None,
        }

    def on_dead_letter(self, *, stream: str, reason: str = "", subject: str = "", wall_s: float = 0.0) -> None:
        """A work item moved to the dead letters (subjects.dead_letter(stream)), seen live."""
        self.dead_letters += 1
        self.dead_letter_last = {"stream": stream, "reason": reason[:200], "subject": subject, "wall_s": wall_s}

    def on_advisory(self, *, kind: str, stream: str, consumer: str = "", deliveries: int = 0, wall_s: float = 0.0) -> None:
        """JetStream gave up on a work item: `terminated` (an actor refused it as malformed) or
        `max_deliveries` (a poison message, which the launcher then moves to the dead letters)."""
        self.advisories[kind] += 1
        self.advisory_last = {"kind": kind, "stream": stream, "consumer": consumer, "deliveries": deliveries, "wall_s": wall_s}

    # --- reading out -----------------------------------------------------------------------
    def scale(self) -> float | None:
        """Model seconds per wall second: the config's, else the heartbeats' median."""
        if self.time_scale:
            return self.time_scale
        samples = sorted(x for e in self.engines.values() for x in e.scale_samples)
        return samples[len(samples) // 2] if samples else None

    def lease_for(self, e: _Engine) -> float:
        if self.lease_wall_s:
            return self.lease_wall_s
        period = self.heartbeat_wall_s
        if period is None and e.periods:
            period = sorted(e.periods)[len(e.periods) // 2]
        return max(10 * (period or 0.3), 3.0)

    def _engine_row(self, engine_id: str, e: _Engine, wall_s: float) -> dict:
        s = e.status
        t = e.prefill_totals
        prefill_rate = (t[-1][1] - t[0][1]) / (t[-1][0] - t[0][0]) if len(t) >= 2 and t[-1][0] > t[0][0] else 0.0
        q = self.decode_tokens.get(engine_id, ())
        decode_rate = sum(n for at, n in q if at >= self.model_now_s - self.rate_window_s) / self.rate_window_s
        age = max(0.0, wall_s - e.wall_s)
        lease = self.lease_for(e)
        return {
            "engine_id": engine_id,
            "role": s.role.value,
            "backend": s.backend,
            "epoch": s.epoch,
            "policy_version": s.policy_version,
            "switching": s.switching,
            "queue_depth": s.waiting_prefill,
            "queue_tokens": s.waiting_prefill_tokens,
            "running": s.running_decode,
            "held_kv_handles": s.held_kv_handles,
            "kv_used_tokens": s.kv_used_tokens,
            "kv_capacity_tokens": s.kv_capacity_tokens,
            "kv_use": _r(s.kv_used_tokens / s.kv_capacity_tokens, 4) if s.kv_capacity_tokens else None,
            "cached_prefix_tokens": s.cached_prefix_tokens,
            "busy": _r(s.busy_fraction, 3),
            "prefill_tokens_per_s": _r(prefill_rate, 1),
            "decode_tokens_per_s": _r(decode_rate, 1),
            "tokens_per_s": _r(prefill_rate + decode_rate, 1),
            "role_since_s": _r(s.role_since_s),
            "at_s": _r(s.at_s),
            "heartbeat_age_s": _r(age, 2),
            "lease_s": _r(lease, 2),
            "silent": age > lease,
            "incarnation": s.incarnation,
            "registrations": e.registrations,
        }

    def _split(self) -> dict:
        now = self.model_now_s
        n = self.history_points
        start = max(0.0, now - self.window_s)
        step = (now - start) / (n - 1) if n > 1 and now > start else 0.0
        history = {r: [] for r in ROLES}
        times = []
        for i in range(n if step else 1):
            at = start + i * step if step else now
            times.append(_r(at, 2))
            roles = Counter(self._role_when(e, at) for e in self.role_changes)
            for r in ROLES:
                history[r].append(roles.get(r, 0))
        current = Counter(self._role_when(e, now) for e in self.role_changes)  # heartbeats, or the log alone
        switching = sum(e.status.switching for e in self.engines.values())
        p, d, c = (current.get(r, 0) for r in ROLES)
        return {
            "prefill": p,
            "decode": d,
            "colocated": c,
            "switching": switching,
            "ratio": f"{p}:{d}" + (f" +{c} colocated" if c else ""),
            "window_s": _r(now - start, 1),
            "history_at_s": times,
            "history": history,
        }

    def _trajectory_view(self, wall_s: float) -> dict:
        phases = Counter(t.phase for t in self.trajectories.values())
        waiting = Counter(t.waiting_for for t in self.trajectories.values() if t.phase == "queued")
        span = min(self.rate_window_s, self.model_now_s) or self.rate_window_s
        wall_span = min(self.rate_window_s, wall_s - self.event_walls[0]) if self.event_walls else 0.0
        recent = sum(1 for at in self.event_times if at >= self.model_now_s - self.rate_window_s)
        return {
            "live": len(self.trajectories),
            **{p: phases.get(p, 0) for p in PHASES},
            "queued_for_prefill": waiting.get("prefill", 0),
            "queued_for_decode": waiting.get("decode", 0),
            "started": self.started,
            "finished": len(self.finished),
            "step": self.step,
            "events_total": self.events_total,
            "events_per_s": _r(recent / span, 2),  # per model second
            "events_per_wall_s": _r(len(self.event_walls) / max(wall_span, 1.0), 2),
            "events_by_kind": dict(sorted(self.events_by_kind.items())),
        }

    def _demand_view(self) -> dict:
        now_bin = math.floor(self.model_now_s / self.bin_s)
        last = now_bin - 1  # the last whole bin
        first = last - self.spark_bins + 1
        newest_predicted = max((max(p) for p in self.predicted.values() if p), default=None)
        if newest_predicted is not None and newest_predicted < first + self.spark_bins // 4:  # a forecaster far behind: show where it is
            first = max(newest_predicted - self.spark_bins // 2, last - 2 * self.spark_bins + 1)
        bins = list(range(first, last + 1))
        levels = {}
        for target in LEVEL_TARGETS:  # the open span up to now, without moving the state
            levels[target] = dict(self.measured[target])
            saved = self._level_at[target]
            self._spread_level(target, now_bin * self.bin_s, levels[target])
            self._level_at[target] = saved
        if self.prefill_cost is not None:
            gemm, attn, cost = self.measured["prefill_miss_tokens"], self.measured[_ATTN], self.prefill_cost
            levels["prefill_engine_s"] = {b: cost.per_token_s * gemm.get(b, 0.0) + cost.per_token_pair_s * attn.get(b, 0.0) for b in bins}
        f = self.forecast
        targets = {}
        latest = {t.target: t for t in f.targets} if f is not None else {}
        for target in [*DEMAND_TARGETS, *(t for t in latest if t not in DEMAND_TARGETS)]:
            series = levels.get(target, self.measured.get(target)) if target != "prefill_engine_s" else levels.get(target)
            measured = [_r(series.get(b, 0.0), 2) for b in bins] if series is not None else [None] * len(bins)
            predicted = [_r(self.predicted[target][b], 2) if b in self.predicted.get(target, {}) else None for b in bins]
            t = latest.get(target)
            lo = hi = None
            if t is not None and t.quantile_levels:
                lo = [_r(x, 2) for x in t.quantiles[t.quantile_levels.index(min(t.quantile_levels))]]
                hi = [_r(x, 2) for x in t.quantiles[t.quantile_levels.index(max(t.quantile_levels))]]
            targets[target] = {
                "measured": measured,
                "predicted": predicted,  # what the forecast said for each bin, its first horizon ahead
                "forecast": [_r(x, 2) for x in t.mean] if t is not None else [],
                "forecast_low": lo,
                "forecast_high": hi,
                "last_measured": measured[-1] if measured else None,
            }
        return {
            "bin_s": self.bin_s,
            "first_bin_s": _r(bins[0] * self.bin_s) if bins else None,
            "tick": f.tick if f else None,
            "model": f.model if f else "",
            "as_of_s": _r(f.as_of_s) if f else None,
            "lag_s": _r(self.model_now_s - f.as_of_s, 2) if f else None,  # how far the forecaster is behind the bus
            "horizons_s": list(f.horizons_s) if f else [],
            "fallback": bool(f.fallback) if f else False,
            "fallback_reason": f.fallback_reason if f else "",
            "forecasts_total": self.forecasts_total,
            "skipped_ticks": f.skipped_ticks if f else 0,  # ticks the forecaster skipped, behind the bus
            "live_trajectories": f.live_trajectories if f else None,
            "targets": targets,
        }

    def _invalid_view(self) -> dict:
        reported: dict[str, int] = {}
        for actor_id, a in self.actors.items():
            if a["counters"].get("invalid_messages"):
                reported[actor_id] = a["counters"]["invalid_messages"]
        for actor_id, r in self.reports.items():
            if r.counters.get("invalid_messages"):
                reported[actor_id] = r.counters["invalid_messages"]
        return {
            "total": sum(self.invalid.values()),
            "by_subject": dict(sorted(self.invalid.items())),
            "last": list(self.invalid_last),
            "reported_by_actors": reported,
        }

    def _commands_view(self, wall_s: float) -> dict:
        scale = self.scale() or 1.0
        pending = []
        for c in self.commands.values():
            if c.state != "pending":
                continue
            age = wall_s - c.wall_s
            deadline = self.ack_grace_wall_s + c.drain_deadline_s / scale
            pending.append({"engine_id": c.engine_id, "role": c.role, "epoch": c.epoch, "age_s": _r(age, 2), "deadline_s": _r(deadline, 2), "overdue": age > deadline})
        return {"sent": self.commands_by_state["sent"], "acked": self.commands_by_state["acked"], "refused": self.commands_by_state["refused"], "superseded": self.commands_by_state["superseded"], "pending": pending}

    def _dead_view(self) -> dict:
        """Dead letters: what the DEAD stream holds (the whole run, from stream info), at least
        what was seen moving there while watching."""
        held = self.streams.get(streams.DEAD.name, {}).get("messages")
        return {
            "total": max(held or 0, self.dead_letters),
            "in_stream": held,
            "seen": self.dead_letters,
            "last": self.dead_letter_last,
            "terminated": self.advisories["terminated"],  # work refused as malformed (counted as invalid by its actor)
            "max_deliveries": self.advisories["max_deliveries"],
            "last_advisory": self.advisory_last,
        }

    def has_traffic(self) -> bool:
        """Has anything of a Prorsa run been seen (a message, or a non-empty lifecycle stream)?"""
        return self.messages > 0 or sum(self.invalid.values()) > 0 or bool(self.streams.get("LIFECYCLE", {}).get("messages"))

    def snapshot(self, wall_s: float) -> dict:
        engines = [self._engine_row(eid, e, wall_s) for eid, e in sorted(self.engines.items())]
        commands = self._commands_view(wall_s)
        invalid = self._invalid_view()
        alerts = []
        if not self.bus.get("connected", True) and self.bus.get("url"):
            alerts.append({"kind": "bus_disconnected", "subject": self.bus["url"], "message": f"not connected to {self.bus['url']}: {self.bus.get('error') or 'reconnecting'}"})
        for e in engines:
            if e["silent"]:
                alerts.append({"kind": "engine_silent", "subject": e["engine_id"], "message": f"engine {e['engine_id']} silent for {e['heartbeat_age_s']:.1f} s (lease {e['lease_s']:.1f} s)"})
        for engine_id in self.expected_engines:
            if engine_id not in self.engines and self.has_traffic():
                alerts.append({"kind": "engine_missing", "subject": engine_id, "message": f"engine {engine_id} has sent no heartbeat"})
        for c in commands["pending"]:
            if c["overdue"]:
                alerts.append({"kind": "switch_not_acked", "subject": c["engine_id"], "message": f"switch of {c['engine_id']} to {c['role']} (epoch {c['epoch']}) not acked after {c['age_s']:.1f} s"})
        dead = self._dead_view()
        if dead["total"]:
            last = dead["last"] or {}
            alerts.append({"kind": "dead_letters", "subject": last.get("stream", ""), "message": f"dead letters: {dead['total']}" + (f"; last from {last.get('stream', '?')}: {last.get('reason') or 'no reason given'}" if last else "")})
        for name, st in self.streams.items():
            if st["fullness"] is not None and st["fullness"] >= self.stream_full_ratio:
                alerts.append({"kind": "stream_near_full", "subject": name, "message": f"stream {name} {st['fullness']:.0%} full ({st['messages']} messages, {st['bytes']} bytes)"})
        if self.account.get("fullness") is not None and self.account["fullness"] >= self.stream_full_ratio:
            alerts.append({"kind": "stream_near_full", "subject": "account", "message": f"JetStream storage {self.account['fullness']:.0%} full"})
        if invalid["total"]:
            alerts.append({"kind": "invalid_messages", "subject": "", "message": f"{invalid['total']} malformed message(s) on watched subjects"})
        if self.forecast is not None and self.forecast.fallback:
            alerts.append({"kind": "forecast_fallback", "subject": self.forecast.forecaster_id, "message": f"forecast fell back to naive: {self.forecast.fallback_reason}"})
        scale = self.scale()
        return {
            "wall_s": _r(wall_s),
            "model_s": _r(self.model_now_s),
            "time_scale": _r(scale, 3) if scale else None,
            "bus": dict(self.bus),
            "traffic": self.has_traffic(),
            "messages": self.messages,
            "engines": engines,
            "split": self._split(),
            "trajectories": self._trajectory_view(wall_s),
            "demand": self._demand_view(),
            "switches": {
                "total": self.switches_total,
                "cost_s_total": _r(self.switch_cost_s_total),
                "recent": [{k: v for k, v in s.items() if k != "wall_s"} for s in list(self.switches)[-20:]],
                "commands": commands,
            },
            "steps": self.steps[-10:],
            "actors": {
                a: {"kind": v["kind"], "heartbeat_age_s": _r(wall_s - v["wall_s"], 2), "live_trajectories": v["live_trajectories"], "counters": v["counters"]}
                for a, v in sorted(self.actors.items())
            },
            "invalid": invalid,
            "dead_letters": dead,
            "streams": {**self.streams, **({"account": self.account} if self.account else {})},
            "alerts": alerts,
        }
