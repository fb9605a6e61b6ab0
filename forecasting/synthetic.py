"""A synthetic lifecycle log (pure, seeded): trajectories that cycle through prefill, decode
and tool phases with simple random durations. For tests and the per-tick benchmark — not
a workload model (recorded runs of ops.launch are that)."""

from __future__ import annotations

import msgspec
import numpy as np
import polars as pl

from bus_schemas.eventlog import events_frame
from bus_schemas.lifecycle import EventKind, LifecycleEvent

FAMILIES = ("swe", "math")


def _trajectory(
    rng: np.random.Generator, index: int, start_s: float, max_turns: int, min_turns: int, until_s: float
) -> list[LifecycleEvent]:
    family = FAMILIES[index % len(FAMILIES)]
    tid = f"t{index}"
    base = dict(trajectory_id=tid, task_family=family, actor_id="synthetic", step=0, policy_version=0)
    events: list[LifecycleEvent] = []

    def add(kind: EventKind, at_s: float, turn: int, **fields) -> None:
        events.append(LifecycleEvent(event_id=f"{tid}-{len(events)}", kind=kind, at_s=at_s, turn=turn, **base, **fields))

    t, context, new = start_s, 0, int(rng.integers(200, 3000))
    add(EventKind.STARTED, t, 0, new_tokens=new)
    turns = int(rng.integers(min_turns, max_turns + 1))
    for turn in range(turns):
        if t >= until_s:
            break
        add(EventKind.PREFILL_QUEUED, t, turn, new_tokens=new, context_tokens=context)
        t += rng.exponential(0.3)
        add(EventKind.PREFILL_STARTED, t, turn, new_tokens=new, context_tokens=context)
        t += 0.05 + new / 20000
        cached = context
        add(EventKind.PREFILL_DONE, t, turn, new_tokens=new, context_tokens=context, cached_prefix_tokens=cached)
        add(EventKind.DECODE_STARTED, t, turn, new_tokens=new, context_tokens=context, cached_prefix_tokens=cached)
        generated = int(rng.integers(50, 800))
        t += generated * 0.02
        add(EventKind.DECODE_DONE, t, turn, new_tokens=new, context_tokens=context, generated_tokens=generated)
        context += new + generated
        if turn + 1 == turns:
            add(EventKind.FINISHED, t, turn, generated_tokens=generated, reward=1.0)
            break
        add(EventKind.TOOL_STARTED, t, turn)
        latency_s = float(rng.lognormal(0.0, 0.8))
        t += latency_s
        new = int(rng.integers(20, 600))
        add(EventKind.TOOL_DONE, t, turn, duration_s=latency_s, new_tokens=new)
    return events


def synthetic_events(
    trajectories: int, seed: int, spread_s: float = 20.0, max_turns: int = 12, min_turns: int = 1, until_s: float = float("inf")
) -> list[LifecycleEvent]:
    """`trajectories` trajectories starting uniformly over the first `spread_s` seconds, with
    min_turns..max_turns turns each; no turn starts after `until_s` (a log cut short)."""
    rng = np.random.default_rng(seed)
    events: list[LifecycleEvent] = []
    for i in range(trajectories):
        events += _trajectory(rng, i, float(rng.uniform(0, spread_s)), max_turns, min_turns, until_s)
    return events


def synthetic_log(
    trajectories: int, seed: int, spread_s: float = 20.0, max_turns: int = 12, min_turns: int = 1, until_s: float = float("inf")
) -> pl.DataFrame:
    """`synthetic_events` as a frame."""
    return events_frame(synthetic_events(trajectories, seed, spread_s, max_turns, min_turns, until_s))


def synthetic_async_events(
    batches: int, wave: int, seed: int, gap_s: float = 40.0, train_s: float = 10.0, max_turns: int = 4, idle_batches: int = 0
) -> list[LifecycleEvent]:
    """An async-RL log (docs/async.md, `hold`): the run's first fill (2·wave trajectories at
    0), then a batch_ready every gap_s (jittered by ±10%) and, train_s later, the published
    version and a wave of `wave` new trajectories; the last `idle_batches` batches admit none
    (the run's end). Fleet events as the trainer and engines write them."""
    rng = np.random.default_rng(seed)
    events: list[LifecycleEvent] = []
    fleet = 0

    def fleet_event(kind: EventKind, at_s: float, **fields) -> None:
        nonlocal fleet
        events.append(LifecycleEvent(event_id=f"f{fleet:05d}", kind=kind, at_s=at_s, actor_id="trainer", **fields))
        fleet += 1

    def start(count: int, at_s: float, version: int) -> None:
        first = sum(1 for e in events if e.kind is EventKind.STARTED)
        for i in range(first, first + count):
            events.extend(
                msgspec.structs.replace(e, step=version, policy_version=version)
                for e in _trajectory(rng, i, at_s, max_turns, 1, float("inf"))
            )

    start(2 * wave, 0.0, 0)
    ready_s = 0.0
    for n in range(batches):
        ready_s += gap_s * float(rng.uniform(0.9, 1.1))
        fleet_event(EventKind.BATCH_READY, ready_s, step=n, policy_version=n, detail=f"staleness [{wave}]; masked turns 0")
        published_s = ready_s + train_s
        fleet_event(EventKind.POLICY_PUBLISHED, published_s, step=n, policy_version=n + 1, duration_s=train_s)
        fleet_event(EventKind.POLICY_UPDATE_STARTED, published_s, step=n + 1, policy_version=n + 1, engine_id="e0")
        fleet_event(EventKind.POLICY_LOADED, published_s + 0.1, step=n + 1, policy_version=n + 1, engine_id="e0", duration_s=0.1)
        if n < batches - idle_batches:
            start(wave, published_s, n + 1)
    return sorted(events, key=lambda e: (e.at_s, e.event_id))


def synthetic_async_log(batches: int, wave: int, seed: int, **kw) -> pl.DataFrame:
    """`synthetic_async_events` as a frame."""
    return events_frame(synthetic_async_events(batches, wave, seed, **kw))
