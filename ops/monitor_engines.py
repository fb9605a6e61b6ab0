"""The monitor's engines: heartbeats, each engine's role over model time, the P:D split.

Fed by `MonitorState` (`ops.monitor_state`): every `EngineStatus`, and the lifecycle events
an engine stamps with its role (its role history between heartbeats, and `role_switched`).
Rates are per *model* second (the actors' `at_s`); heartbeat age and leases per *wall* second.
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from dataclasses import dataclass, field

from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.status import EngineStatus
from ops.monitor_common import drop_before, rounded

ROLES = ("prefill", "decode", "colocated")
# Events an engine stamps with its own role at the time (its role history between heartbeats).
_ENGINE_KINDS = {
    EventKind.PREFILL_STARTED,
    EventKind.PREFILL_DONE,
    EventKind.DECODE_QUEUED,
    EventKind.KV_TRANSFER_DONE,
    EventKind.DECODE_STARTED,
    EventKind.DECODE_DONE,
    EventKind.DECODE_MIGRATED,
}
_MAX_ROLE_CHANGES = 1000  # per engine; past it the older half is dropped


@dataclass(slots=True)
class _Engine:
    status: EngineStatus
    wall_s: float  # when its last heartbeat arrived
    periods: deque = field(default_factory=lambda: deque(maxlen=16))  # wall seconds between heartbeats
    prefill_totals: deque = field(default_factory=deque)  # (at_s, prefilled_tokens_total)
    scale_samples: deque = field(default_factory=lambda: deque(maxlen=16))  # model s per wall s between heartbeats
    registrations: int = 1  # incarnations seen (EngineStatus.incarnation changes at a restart or after a lease lapse)


def _median(values) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


class Engines:
    """Every engine heard from, and each engine's role changes as [(at_s, role)], sorted."""

    def __init__(
        self,
        *,
        lease_wall_s: float | None,
        heartbeat_wall_s: float | None,
        time_scale: float | None,
        rate_window_s: float,
        window_s: float,
        history_points: int,
        initial_roles: dict[str, str] | None = None,
    ) -> None:
        # the role each engine starts in (the run's config): its role before anything it reported
        self.initial_roles = initial_roles or {}
        self.lease_wall_s = lease_wall_s  # None: 10 heartbeat periods, at least 3 s (run.lease_wall_s's default)
        self.heartbeat_wall_s = heartbeat_wall_s  # None: estimated from the heartbeats' spacing
        self.time_scale = time_scale  # None: estimated from the heartbeats (model s per wall s)
        self.rate_window_s = rate_window_s
        self.window_s = window_s
        self.history_points = history_points
        self.by_id: dict[str, _Engine] = {}
        self.role_changes: dict[str, list[tuple[float, str]]] = {}  # engine -> [(at_s, role)] sorted
        self.decode_tokens: dict[str, deque] = {}  # engine -> (at_s, generated tokens of a decode_done)

    # --- feeding ---------------------------------------------------------------------------
    def on_status(self, s: EngineStatus, wall_s: float) -> None:
        e = self.by_id.get(s.engine_id)
        if e is None:
            e = self.by_id[s.engine_id] = _Engine(status=s, wall_s=wall_s)
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
        self.role_at(s.engine_id, s.at_s, s.role.value)

    def on_event(self, ev: LifecycleEvent, now_s: float) -> None:
        """A role switch, an engine's role stamp, and the tokens a decode produced."""
        kind = ev.kind
        if kind is EventKind.ROLE_SWITCHED or (ev.engine_id and ev.role and kind in _ENGINE_KINDS and ev.actor_id == ev.engine_id):
            self.role_at(ev.engine_id, ev.at_s, ev.role)
        if kind is EventKind.DECODE_DONE and ev.engine_id:
            q = self.decode_tokens.setdefault(ev.engine_id, deque())
            q.append((ev.at_s, ev.generated_tokens))
            drop_before(q, now_s - self.rate_window_s, key=lambda x: x[0])

    def role_at(self, engine_id: str, at_s: float, role: str) -> None:
        """The engine had `role` from `at_s` (changes may arrive out of order)."""
        changes = self.role_changes.setdefault(engine_id, [])
        i = bisect.bisect_right(changes, (at_s, "\uffff"))
        if i > 0 and changes[i - 1][1] == role:
            return
        if i < len(changes) and changes[i][1] == role:  # the next known change is to this role: it began earlier
            changes[i] = (at_s, role)
            return
        changes.insert(i, (at_s, role))
        if len(changes) > _MAX_ROLE_CHANGES:
            del changes[: _MAX_ROLE_CHANGES // 2]

    def role_when(self, engine_id: str, at_s: float, *, inclusive: bool = True) -> str:
        """The engine's role at `at_s` (`inclusive=False`: just before it): the last it reported
        by then, else the role the run's config starts it in; "" when unknown."""
        changes = self.role_changes.get(engine_id, [])
        i = bisect.bisect_right(changes, (at_s, "\uffff")) if inclusive else bisect.bisect_left(changes, (at_s, ""))
        return changes[i - 1][1] if i > 0 else self.initial_roles.get(engine_id, "")

    # --- reading out -----------------------------------------------------------------------
    def scale(self) -> float | None:
        """Model seconds per wall second: the config's, else the heartbeats' median."""
        if self.time_scale:
            return self.time_scale
        return _median(x for e in self.by_id.values() for x in e.scale_samples)

    def lease_for(self, e: _Engine) -> float:
        if self.lease_wall_s:
            return self.lease_wall_s
        period = self.heartbeat_wall_s
        if period is None and e.periods:
            period = _median(e.periods)
        return max(10 * (period or 0.3), 3.0)

    def rows(self, wall_s: float, now_s: float) -> list[dict]:
        return [self._row(engine_id, e, wall_s, now_s) for engine_id, e in sorted(self.by_id.items())]

    def _row(self, engine_id: str, e: _Engine, wall_s: float, now_s: float) -> dict:
        s = e.status
        t = e.prefill_totals
        prefill_rate = (t[-1][1] - t[0][1]) / (t[-1][0] - t[0][0]) if len(t) >= 2 and t[-1][0] > t[0][0] else 0.0
        q = self.decode_tokens.get(engine_id, ())
        decode_rate = sum(n for at, n in q if at >= now_s - self.rate_window_s) / self.rate_window_s
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
            "kv_use": rounded(s.kv_used_tokens / s.kv_capacity_tokens, 4) if s.kv_capacity_tokens else None,
            "cached_prefix_tokens": s.cached_prefix_tokens,
            "busy": rounded(s.busy_fraction, 3),
            "prefill_tokens_per_s": rounded(prefill_rate, 1),
            "decode_tokens_per_s": rounded(decode_rate, 1),
            "tokens_per_s": rounded(prefill_rate + decode_rate, 1),
            "role_since_s": rounded(s.role_since_s),
            "at_s": rounded(s.at_s),
            "heartbeat_age_s": rounded(age, 2),
            "lease_s": rounded(lease, 2),
            "silent": age > lease,
            "incarnation": s.incarnation,
            "registrations": e.registrations,
        }

    def split(self, now_s: float) -> dict:
        """Engines per role now (heartbeats, or the log alone) and over the last `window_s`."""
        n = self.history_points
        start = max(0.0, now_s - self.window_s)
        step = (now_s - start) / (n - 1) if n > 1 and now_s > start else 0.0
        history = {r: [] for r in ROLES}
        times = []
        for i in range(n if step else 1):
            at = start + i * step if step else now_s
            times.append(rounded(at, 2))
            roles = self._roles_when(at)
            for r in ROLES:
                history[r].append(roles.get(r, 0))
        current = self._roles_when(now_s)
        p, d, c = (current.get(r, 0) for r in ROLES)
        return {
            "prefill": p,
            "decode": d,
            "colocated": c,
            "switching": sum(e.status.switching for e in self.by_id.values()),
            "ratio": f"{p}:{d}" + (f" +{c} colocated" if c else ""),
            "window_s": rounded(now_s - start, 1),
            "history_at_s": times,
            "history": history,
        }

    def _roles_when(self, at_s: float) -> Counter[str]:
        return Counter(self.role_when(e, at_s) for e in self.role_changes)
