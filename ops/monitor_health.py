"""The monitor's health: the other actors' heartbeats and counters, malformed messages, dead
letters and JetStream advisories, stream and storage fullness; and the alerts drawn from all
of it with the engines, the pending switches and the forecast.
"""

from __future__ import annotations

from collections import Counter, deque

from bus_schemas import streams, subjects
from bus_schemas.forecast import DemandForecast
from bus_schemas.status import ActorReport, ActorStatus
from ops.monitor_common import rounded

# Subject patterns the monitor watches (also `MonitorState.ingest`'s routing).
LIFECYCLE_ALL = subjects.lifecycle_all()
CTL_ENGINE_ALL = subjects.ctl_engine("x").rsplit(".", 1)[0] + ".*"  # ctl_engine refuses a wildcard id
REPORT_ALL = subjects.report_all()


def subject_family(subject: str) -> str:
    """A subject without its instance token, for counting: `prorsa.status.engine.e3` ->
    `prorsa.status.engine`, `prorsa.lc.decode_done` -> `prorsa.lc`."""
    if subjects.matches(subjects.status_all(), subject):
        return ".".join(subject.split(".")[:3])
    for pattern in (LIFECYCLE_ALL, CTL_ENGINE_ALL, REPORT_ALL):
        if subjects.matches(pattern, subject):
            return pattern.removesuffix(".*")
    return subject


def _fullness(used: int, limit: int) -> float | None:
    return used / limit if limit and limit > 0 else None


def _alert(kind: str, subject: str, message: str) -> dict:
    return {"kind": kind, "subject": subject, "message": message}


class Health:
    def __init__(self, *, stream_full_ratio: float) -> None:
        self.stream_full_ratio = stream_full_ratio
        self.actors: dict[str, dict] = {}
        self.reports: dict[str, ActorReport] = {}
        self.invalid: Counter[str] = Counter()  # subject family -> malformed messages seen here
        self.invalid_last: deque[dict] = deque(maxlen=5)
        self.dead_letters = 0  # seen on the dead-letter subject while watching
        self.dead_letter_last: dict | None = None
        self.advisories: Counter[str] = Counter()  # JetStream advisories: terminated, max_deliveries
        self.advisory_last: dict | None = None
        self.streams: dict[str, dict] = {}
        self.account: dict = {}

    # --- feeding ---------------------------------------------------------------------------
    def on_actor_status(self, s: ActorStatus, wall_s: float) -> None:
        self.actors[s.actor_id] = {
            "kind": s.kind,
            "at_s": s.at_s,
            "wall_s": wall_s,
            "live_trajectories": s.live_trajectories,
            "counters": dict(s.counters),
        }

    def on_report(self, r: ActorReport) -> None:
        self.reports[r.actor_id] = r

    def on_invalid(self, subject: str, error: str, wall_s: float) -> None:
        self.invalid[subject_family(subject)] += 1
        self.invalid_last.append({"subject": subject, "error": error[:200], "wall_s": wall_s})

    def on_stream_info(self, name: str, *, messages: int, bytes_: int, max_msgs: int, max_bytes: int, discard: str, wall_s: float) -> None:
        ratios = [r for r in (_fullness(messages, max_msgs), _fullness(bytes_, max_bytes)) if r is not None]
        self.streams[name] = {
            "messages": messages,
            "bytes": bytes_,
            "max_msgs": max_msgs,
            "max_bytes": max_bytes,
            "discard": discard,
            "fullness": rounded(max(ratios), 4) if ratios else None,
            "wall_s": wall_s,
        }

    def on_account_info(self, *, storage_bytes: int, max_storage_bytes: int) -> None:
        full = _fullness(storage_bytes, max_storage_bytes)
        self.account = {
            "storage_bytes": storage_bytes,
            "max_storage_bytes": max_storage_bytes,
            "fullness": rounded(full, 4) if full is not None else None,
        }

    def on_dead_letter(self, *, stream: str, reason: str, subject: str, wall_s: float) -> None:
        self.dead_letters += 1
        self.dead_letter_last = {"stream": stream, "reason": reason[:200], "subject": subject, "wall_s": wall_s}

    def on_advisory(self, *, kind: str, stream: str, consumer: str, deliveries: int, wall_s: float) -> None:
        self.advisories[kind] += 1
        self.advisory_last = {"kind": kind, "stream": stream, "consumer": consumer, "deliveries": deliveries, "wall_s": wall_s}

    # --- reading out -----------------------------------------------------------------------
    def lifecycle_messages(self) -> int:
        return self.streams.get("LIFECYCLE", {}).get("messages") or 0

    def actors_view(self, wall_s: float) -> dict:
        return {
            a: {
                "kind": v["kind"],
                "heartbeat_age_s": rounded(wall_s - v["wall_s"], 2),
                "live_trajectories": v["live_trajectories"],
                "counters": v["counters"],
            }
            for a, v in sorted(self.actors.items())
        }

    def invalid_view(self) -> dict:
        reported: dict[str, int] = {}  # an actor's own count: its report's, else its heartbeat's
        counters = [(a, v["counters"]) for a, v in self.actors.items()] + [(a, r.counters) for a, r in self.reports.items()]
        for actor_id, c in counters:
            if c.get("invalid_messages"):
                reported[actor_id] = c["invalid_messages"]
        return {
            "total": sum(self.invalid.values()),
            "by_subject": dict(sorted(self.invalid.items())),
            "last": list(self.invalid_last),
            "reported_by_actors": reported,
        }

    def dead_view(self) -> dict:
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

    def streams_view(self) -> dict:
        return {**self.streams, **({"account": self.account} if self.account else {})}

    def alerts(
        self,
        *,
        bus: dict,
        engines: list[dict],
        missing: list[str],
        pending: list[dict],
        invalid: dict,
        dead: dict,
        forecast: DemandForecast | None,
    ) -> list[dict]:
        """What needs a look, in a fixed order: the bus, engines (silent, missing), switches
        not acked, dead letters, full streams, malformed messages, a forecast fallback."""
        alerts = []
        if not bus.get("connected", True) and bus.get("url"):
            alerts.append(_alert("bus_disconnected", bus["url"], f"not connected to {bus['url']}: {bus.get('error') or 'reconnecting'}"))
        for e in engines:
            if e["silent"]:
                alerts.append(
                    _alert(
                        "engine_silent",
                        e["engine_id"],
                        f"engine {e['engine_id']} silent for {e['heartbeat_age_s']:.1f} s (lease {e['lease_s']:.1f} s)",
                    )
                )
        for engine_id in missing:
            alerts.append(_alert("engine_missing", engine_id, f"engine {engine_id} has sent no heartbeat"))
        for c in pending:
            if c["overdue"]:
                alerts.append(
                    _alert(
                        "switch_not_acked",
                        c["engine_id"],
                        f"switch of {c['engine_id']} to {c['role']} (epoch {c['epoch']}) not acked after {c['age_s']:.1f} s",
                    )
                )
        if dead["total"]:
            last = dead["last"] or {}
            detail = f"; last from {last.get('stream', '?')}: {last.get('reason') or 'no reason given'}" if last else ""
            alerts.append(_alert("dead_letters", last.get("stream", ""), f"dead letters: {dead['total']}{detail}"))
        for name, st in self.streams.items():
            if st["fullness"] is not None and st["fullness"] >= self.stream_full_ratio:
                alerts.append(
                    _alert(
                        "stream_near_full",
                        name,
                        f"stream {name} {st['fullness']:.0%} full ({st['messages']} messages, {st['bytes']} bytes)",
                    )
                )
        if self.account.get("fullness") is not None and self.account["fullness"] >= self.stream_full_ratio:
            alerts.append(_alert("stream_near_full", "account", f"JetStream storage {self.account['fullness']:.0%} full"))
        if invalid["total"]:
            alerts.append(_alert("invalid_messages", "", f"{invalid['total']} malformed message(s) on watched subjects"))
        if forecast is not None and forecast.fallback:
            alerts.append(_alert("forecast_fallback", forecast.forecaster_id, f"forecast fell back to naive: {forecast.fallback_reason}"))
        return alerts
