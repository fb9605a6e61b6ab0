"""The monitor's trajectories: where each live one is in its turn (queued, prefill, decode,
tool), how many started and finished, and the lifecycle event rate.

A trajectory's phase is set by the newest of its events by (at_s, kind order), so events that
arrive out of order leave it where the latest one put it.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from bus_schemas.lifecycle import EventKind, LifecycleEvent
from ops.monitor_common import drop_before, rounded

PHASES = ("queued", "prefill", "decode", "tool")

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


@dataclass(slots=True)
class _Traj:
    key: tuple  # (at_s, order) of the event that set the phase
    phase: str
    waiting_for: str  # queued: "prefill" or "decode"


class Trajectories:
    def __init__(self, *, rate_window_s: float) -> None:
        self.rate_window_s = rate_window_s
        self.live: dict[str, _Traj] = {}
        self.finished: set[str] = set()
        self.started = 0
        self.step = -1
        self.events_total = 0
        self.events_by_kind: Counter[str] = Counter()
        self.event_times: deque[float] = deque()  # at_s of recent events (the rate)
        self.event_walls: deque[float] = deque()  # arrival wall time of recent events

    def on_event(self, ev: LifecycleEvent, wall_s: float, now_s: float) -> None:
        self.events_total += 1
        self.events_by_kind[ev.kind.value] += 1
        self.event_times.append(ev.at_s)
        drop_before(self.event_times, now_s - self.rate_window_s)
        self.event_walls.append(wall_s)
        drop_before(self.event_walls, wall_s - self.rate_window_s)
        if ev.kind is EventKind.STEP_STARTED:
            self.step = max(self.step, ev.step)
        if ev.trajectory_id:
            self._phase(ev)

    def _phase(self, ev: LifecycleEvent) -> None:
        tid = ev.trajectory_id
        if tid in self.finished:
            return
        if ev.kind is EventKind.FINISHED:
            self.finished.add(tid)
            self.live.pop(tid, None)
            return
        if ev.kind is EventKind.STARTED and tid not in self.live:
            self.started += 1
        after = _PHASE_AFTER.get(ev.kind)
        if after is None:
            return
        key = (ev.at_s, _ORDER[ev.kind])
        t = self.live.get(tid)
        if t is None:
            self.live[tid] = _Traj(key, *after)
        elif key >= t.key:
            t.key, (t.phase, t.waiting_for) = key, after

    def view(self, wall_s: float, now_s: float) -> dict:
        phases = Counter(t.phase for t in self.live.values())
        waiting = Counter(t.waiting_for for t in self.live.values() if t.phase == "queued")
        span = min(self.rate_window_s, now_s) or self.rate_window_s
        wall_span = min(self.rate_window_s, wall_s - self.event_walls[0]) if self.event_walls else 0.0
        recent = sum(1 for at in self.event_times if at >= now_s - self.rate_window_s)
        return {
            "live": len(self.live),
            **{p: phases.get(p, 0) for p in PHASES},
            "queued_for_prefill": waiting.get("prefill", 0),
            "queued_for_decode": waiting.get("decode", 0),
            "started": self.started,
            "finished": len(self.finished),
            "step": self.step,
            "events_total": self.events_total,
            "events_per_s": rounded(recent / span, 2),  # per model second
            "events_per_wall_s": rounded(len(self.event_walls) / max(wall_span, 1.0), 2),
            "events_by_kind": dict(sorted(self.events_by_kind.items())),
        }
