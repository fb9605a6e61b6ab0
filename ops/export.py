"""Reading a run's history off the bus: the lifecycle log to Parquet, and the run summary.

`events.parquet` has one row per lifecycle event, one column per LifecycleEvent field (kind
as text) plus `schema_version`. `python -m ops.export --nats-url URL --out DIR` exports a
live run at any time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections import Counter
from pathlib import Path
from typing import TypeVar

import msgspec
import polars as pl
from nats.js import api
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from bus_schemas import streams, subjects
from bus_schemas.codec import decode
from bus_schemas.control import AllocationDecision
from bus_schemas.eventlog import EVENT_COLUMNS, EventLogError, check_events, events_frame, load_events  # noqa: F401 (re-exported)
from bus_schemas.forecast import DemandForecast
from bus_schemas.lifecycle import LifecycleEvent
from bus_schemas.status import ActorReport
from bus_schemas.train import FinishedTrajectory, StepReport

T = TypeVar("T")
LOG = logging.getLogger("prorsa.export")

_FETCH_BATCH = 2000


async def read_stream(
    js: JetStreamContext, stream: streams.StreamDef, subject: str, message_type: type[T], undecodable: Counter[str] | None = None
) -> list[T]:
    """Every message of `subject` in `stream`, in stream order, decoded. One that does not decode
    as `message_type` is left out of the list, logged (one line each) and counted in
    `undecodable` by the subject it was published on; it stays in the stream. Reading changes
    nothing in the stream."""
    stored_messages = getattr(js, "stored_messages", None)  # the in-process bus hands them over at once
    if stored_messages is not None:
        raw = stored_messages(stream.name, subject)
    else:
        read = _read_by_sequence if stream.work_queue else _read_by_consumer
        raw = await streams.answered(lambda: read(js, stream, subject))  # a cluster may still be electing leaders
    out: list[T] = []
    for i, (published_on, data) in enumerate(raw):
        try:
            out.append(decode(message_type, data))
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            if undecodable is not None:
                undecodable[published_on] += 1
            LOG.error(
                "export: message %d of %d on %s in stream %s is not a %s, left out of the export: %s",
                i + 1,
                len(raw),
                published_on,
                stream.name,
                message_type.__name__,
                err,
            )
    return out


async def _read_by_consumer(js: JetStreamContext, stream: streams.StreamDef, subject: str) -> list[tuple[str, bytes]]:
    """An ephemeral no-ack consumer: the fast way through a large limits stream (the log)."""
    sub = await js.pull_subscribe(
        subject,
        stream=stream.name,
        config=api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, deliver_policy=api.DeliverPolicy.ALL, inactive_threshold=30.0),
    )
    expected = (await sub.consumer_info()).num_pending or 0
    out: list[tuple[str, bytes]] = []  # (subject, payload)
    try:
        while len(out) < expected:
            try:
                msgs = await sub.fetch(min(_FETCH_BATCH, expected - len(out)), timeout=5)
            except TimeoutError:
                break
            out += [(m.subject, m.data) for m in msgs]
    finally:
        await sub.unsubscribe()
    return out


async def _read_by_sequence(js: JetStreamContext, stream: streams.StreamDef, subject: str) -> list[tuple[str, bytes]]:
    """Work-queue streams allow no second consumer on a subject: read message by message."""
    out: list[tuple[str, bytes]] = []  # (subject, payload)
    seq = 1
    while True:
        try:
            raw = await js.get_msg(stream.name, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return out
        out.append((raw.subject or subject, raw.data or b""))
        seq = raw.seq + 1


class DecisionRecorder:
    """The allocator's decisions and the forecaster's forecasts as a run goes (core NATS: what
    this connection hears, from its subscription on), for allocations.parquet and
    forecasts.parquet. The simulation and the launcher both record with it."""

    def __init__(self) -> None:
        self.decisions: list[AllocationDecision] = []
        self.forecasts: list[DemandForecast] = []

    async def start(self, nc) -> None:
        async def on_forecast(msg) -> None:
            self.forecasts.append(decode(DemandForecast, msg.data))

        async def on_decision(msg) -> None:
            self.decisions.append(decode(AllocationDecision, msg.data))

        await nc.subscribe(subjects.forecast(), cb=on_forecast)
        await nc.subscribe(subjects.allocation(), cb=on_decision)

    def write(self, out: Path) -> None:
        """forecasts.parquet and allocations.parquet in `out`, each where there was any."""
        if self.forecasts:
            forecasts_frame(self.forecasts).write_parquet(out / "forecasts.parquet")
        if self.decisions:
            decisions_frame(self.decisions).write_parquet(out / "allocations.parquet")


def decisions_frame(decisions: list) -> pl.DataFrame:
    """One row per allocator tick: its demand figures, the roles it saw and changed (as
    'e0=prefill,e1=decode'), the fleet's P:D:C counts, and its reason."""

    def listed(roles: dict[str, str]) -> str:
        return ",".join(f"{e}={r}" for e, r in sorted(roles.items()))

    rows = []
    for d in decisions:
        row = {f: getattr(d, f) for f in d.__struct_fields__ if f not in ("roles", "changes")}
        counts = {role: sum(r == role for r in d.roles.values()) for role in ("prefill", "decode", "colocated")}
        rows.append(row | {f"{role}_engines": n for role, n in counts.items()} | {"roles": listed(d.roles), "changes": listed(d.changes)})
    return pl.DataFrame(rows)


def forecasts_frame(forecasts: list) -> pl.DataFrame:
    """DemandForecasts as rows: as_of_s, horizon_s, target, bin_s, and the mean, lowest and highest
    quantile per bin (flows: tokens in the bin; levels: the bin's mean), and the window mean
    (the mean forecast over every bin up to the horizon, what the allocator reads; NaN where
    the forecast has none)."""
    rows = []
    for f in forecasts:
        published = f.windows()
        for t in f.targets:
            lo, hi = t.quantile_levels.index(min(t.quantile_levels)), t.quantile_levels.index(max(t.quantile_levels))
            windows = published.get(t.target, [float("nan")] * len(f.horizons_s))
            for i, h in enumerate(f.horizons_s):
                rows.append((f.as_of_s, h, t.target, f.bin_s, t.mean[i], t.quantiles[lo][i], t.quantiles[hi][i], windows[i]))
    return pl.DataFrame(rows, schema=["as_of_s", "horizon_s", "target", "bin_s", "mean", "low", "high", "window_mean"], orient="row")


def step_token_totals(events: pl.DataFrame) -> dict[int, dict[str, int]]:
    """Per step: prefill tokens computed (uncached), new tokens, and decode tokens generated."""
    prefill = (
        events.filter(pl.col("kind") == "prefill_done")
        .group_by("step")
        .agg(
            (pl.col("context_tokens") - pl.col("cached_prefix_tokens") + pl.col("new_tokens")).sum().alias("prefill_tokens"),
            pl.col("cached_prefix_tokens").sum().alias("cached_prefix_tokens"),
        )
    )
    decode_ = events.filter(pl.col("kind") == "decode_done").group_by("step").agg(pl.col("generated_tokens").sum().alias("decode_tokens"))
    totals: dict[int, dict[str, int]] = {}
    for row in prefill.join(decode_, on="step", how="full", coalesce=True).fill_null(0).iter_rows(named=True):
        totals[int(row["step"])] = {k: int(v) for k, v in row.items() if k != "step"}
    return totals


class RunRecord(msgspec.Struct, kw_only=True):
    events: list[LifecycleEvent]
    finished: list[FinishedTrajectory]
    steps: list[StepReport]
    reports: list[ActorReport]
    undecodable: dict[str, int] = {}  # subject -> messages read off it that did not decode (left out above)


async def read_run(js: JetStreamContext) -> RunRecord:
    undecodable: Counter[str] = Counter()
    return RunRecord(
        events=await read_stream(js, streams.LIFECYCLE, subjects.lifecycle_all(), LifecycleEvent, undecodable),
        finished=await read_stream(js, streams.TRAIN, subjects.train_finished(), FinishedTrajectory, undecodable),
        steps=await read_stream(js, streams.TRAIN, subjects.train_step(), StepReport, undecodable),
        reports=await read_stream(js, streams.REPORTS, subjects.report_all(), ActorReport, undecodable),
        undecodable=dict(undecodable),
    )


def actor_counters(reports: list[ActorReport]) -> dict[str, dict[str, int]]:
    """Each actor's counters over the run: every incarnation's last report (final, or the last
    checkpoint of one that died), added up; a `max_*` or `peak_*` counter takes the largest."""
    last = {(r.actor_id, r.incarnation): r for r in reports}  # stream order: the latest wins
    merged: dict[str, dict[str, int]] = {}
    for (actor_id, _), report in last.items():
        into = merged.setdefault(actor_id, {})
        for name, value in report.counters.items():
            into[name] = max(into.get(name, value), value) if name.startswith(("max_", "peak_")) else into.get(name, 0) + value
    return merged


def incarnations(reports: list[ActorReport]) -> dict[str, dict[str, int]]:
    """Per actor: how many incarnations reported, and how many of those ended without a final
    report (killed: their counters come from their last checkpoint)."""
    last = {(r.actor_id, r.incarnation): r for r in reports}
    out: dict[str, dict[str, int]] = {}
    for (actor_id, _), report in last.items():
        row = out.setdefault(actor_id, {"incarnations": 0, "without_final_report": 0})
        row["incarnations"] += 1
        row["without_final_report"] += not report.final
    return out


def summarize(record: RunRecord, events: pl.DataFrame, *, policy: str, mode: str, backend: str, expected: int) -> dict:
    """The run's summary. `expected`: the trajectories the config's batches need (steps x B x G);
    under stale_policy "drop" every dropped trajectory's group is replaced by a new one, so the
    dropped ones are counted on top (`trajectories_expected`). `trajectories_lost`: expected but
    never finished (never negative; `trajectories_extra` counts finished ones beyond expected).
    Async steps rows are batches: token counts are those computed while engines ran the
    row's policy version."""
    finished_ids = {f.trajectory_id for f in record.finished}
    totals = step_token_totals(events)
    counters = actor_counters(record.reports)
    steps = []
    for report in sorted(record.steps, key=lambda r: r.step):
        tokens = totals.get(report.step, {})
        steps.append(
            {
                "step": report.step,
                "policy_version": report.policy_version,
                "started_at_s": round(report.started_at_s, 3),
                "rollout_done_at_s": round(report.rollout_done_at_s, 3),
                "rollout_s": round(report.rollout_s, 3),
                "train_s": report.train_s,
                "trajectories": report.trajectories,
                "mean_reward": report.mean_reward,
                "staleness": list(report.staleness),
                "dropped": report.dropped,
                "masked_turns": report.masked_turns,
                "prefill_tokens": tokens.get("prefill_tokens", 0),
                "cached_prefix_tokens": tokens.get("cached_prefix_tokens", 0),
                "decode_tokens": tokens.get("decode_tokens", 0),
            }
        )
    dropped = sum(r.dropped for r in record.steps)
    expected += dropped  # each dropped trajectory's group was replaced by a new one
    return {
        "policy": policy,
        "mode": mode,
        "backend": backend,
        "trajectories_expected": expected,
        "trajectories_finished": len(finished_ids),
        "trajectories_trained": sum(r.trajectories for r in record.steps),
        "trajectories_dropped": dropped,
        "trajectories_lost": max(0, expected - len(finished_ids)),
        "trajectories_extra": max(0, len(finished_ids) - expected),
        "invalid_messages": sum(c.get("invalid_messages", 0) for c in counters.values()),
        "undecodable_messages": sum(record.undecodable.values()),  # in the streams, left out of this export
        "undecodable_by_subject": dict(sorted(record.undecodable.items())),
        "events": events.height,
        "steps": steps,
        "actors": counters,
        # actors that ran more than one process, or ended one without a final report
        "actor_incarnations": {a: n for a, n in incarnations(record.reports).items() if n["incarnations"] > 1 or n["without_final_report"]},
    }


def undecodable_line(record: RunRecord) -> str:
    by_subject = ", ".join(f"{subject} {n}" for subject, n in sorted(record.undecodable.items()))
    return f"{sum(record.undecodable.values())} undecodable message(s) left out of the export ({by_subject})"


TRAJECTORY_COLUMNS = (
    "trajectory_id",
    "task_id",
    "task_family",
    "step",
    "env_id",
    "turns",
    "reward",
    "truncated",
    "error",
    "policy_versions",
    "token_ids",
    "generated_mask",
    "logprobs",
)


def trajectories_frame(finished: list[FinishedTrajectory]) -> pl.DataFrame:
    """Real backends: every finished trajectory as the trainer got it (its token ids, loss
    mask, rollout logprobs, reward, and the environment's error where it failed); empty for
    modelled trajectories, which carry no tokens."""
    rows = [{c: getattr(f, c) for c in TRAJECTORY_COLUMNS} for f in finished if f.token_ids]
    return pl.DataFrame(rows) if rows else pl.DataFrame()


def write_run(record: RunRecord, out: Path, config, status: str, wall_s: float, console=None) -> dict:
    """Write DIR/events.parquet and DIR/summary.json for a finished (or stopped) run, and on
    real backends DIR/trajectories.parquet."""
    from actors.config import policy_label
    from ops.checks import expects_pd_turns, incomplete_trajectories

    events = events_frame(record.events)
    events.write_parquet(out / "events.parquet")
    trajectories = trajectories_frame(record.finished)
    if trajectories.height:
        trajectories.write_parquet(out / "trajectories.parquet")
    summary = summarize(
        record,
        events,
        policy=policy_label(config),
        mode=config.run.mode,
        backend=config.engines.backend,
        expected=config.trajectories_expected(),
    )
    finished_ids = {f.trajectory_id for f in record.finished}
    incomplete = incomplete_trajectories(events, finished_ids, disaggregated=expects_pd_turns(config))
    for trajectory_id, missing in list(incomplete.items())[:5]:
        message = f"error: trajectory {trajectory_id} is missing events: {', '.join(missing[:6])}"
        console.print(f"[red]{message}") if console is not None else print(message)
    summary["incomplete_trajectories"] = len(incomplete)
    if summary["undecodable_messages"]:
        message = f"error: {undecodable_line(record)}"
        console.print(f"[red]{message}", highlight=False) if console is not None else print(message)
    summary = {"status": status, "wall_s": round(wall_s, 2), "time_scale": config.run.time_scale, **summary}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


async def _main(url: str, out: Path) -> None:
    from actors.base.connection import close, connect  # late: keeps this module import-light

    nc = await connect(url, "export", LOG)
    try:
        record = await read_run(nc.jetstream())
    finally:
        await close(nc)
    out.mkdir(parents=True, exist_ok=True)
    events_frame(record.events).write_parquet(out / "events.parquet")
    print(f"wrote {len(record.events)} events to {out / 'events.parquet'}")
    if record.undecodable:
        print(f"error: {undecodable_line(record)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m ops.export")
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    asyncio.run(_main(args.nats_url, args.out))
