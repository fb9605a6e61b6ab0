"""What ends each step: the trajectory that finished last, and where its time went (pure, polars).

A sync RL step lasts until its last trajectory finishes, so the step's rollout time is that
one trajectory's time from the step's start, whatever the rest of the fleet did. Split by
what the trajectory was doing, it says what an arrangement of the engines could have
changed (its queue waits and its decode speed) and what none could (its tool calls):

    step start ── start ──▶ started ── environment / prefill_wait / prefill / decode_wait /
                                        decode / tool, turn after turn ──▶ finished

Each stretch between two of the trajectory's lifecycle events goes to the state the first
of them put it in (`STATE_OF`); events that do not change its state (a KV write-back, a
prefix loaded from the store tier) are skipped. Events of one instant are taken in the
order they happen (by turn, then along a turn's life: `ORDER`), not in the log's order,
which breaks ties by event id. A decode migrated mid-turn, or cut by a weight update and
resumed, emits nothing more until its `decode_done`: that time stays decode.

Async RL has no step boundaries: the run is one stretch, from the first step's start to the
last trajectory that finished in time for the last batch and was not dropped as too stale.
The stretch ends when that batch forms (`batch_ready`), which can be later than the
trajectory's finish while the trainer is still busy with the batch before. A step with no
`rollout_done` (a run stopped mid-step) ends at its last finished trajectory so far.

| bucket | from the event | until |
| --- | --- | --- |
| start | the step's start | the trajectory's `started` |
| environment | started, decode_done, tool_done | the next queue or tool call |
| prefill_wait | prefill_queued, reprefill | prefill_started |
| prefill | prefill_started | prefill_done |
| decode_wait | prefill_done, kv_transfer_done, decode_queued | decode_started |
| decode | decode_started, decode_migrated, turn_interrupted | decode_done |
| tool | tool_started | tool_done |
| batch | finished | the step's `rollout_done` (async: the last `batch_ready`) |

Units: model seconds.
"""

from __future__ import annotations

import polars as pl

BUCKETS = ("start", "environment", "prefill_wait", "prefill", "decode_wait", "decode", "tool", "batch")
# the buckets' columns in a markdown table (the report's and the rollout bench's)
BUCKETS_HEADER = " | ".join(b.replace("_", " ") for b in BUCKETS) + " |"
BUCKETS_ALIGN = " | ".join("---:" for _ in BUCKETS) + " |"
STATE_OF = {
    "started": "environment",
    "decode_done": "environment",
    "tool_done": "environment",
    "prefill_queued": "prefill_wait",
    "reprefill": "prefill_wait",
    "prefill_started": "prefill",
    "prefill_done": "decode_wait",
    "kv_transfer_done": "decode_wait",
    "decode_queued": "decode_wait",
    "decode_started": "decode",
    "decode_migrated": "decode",  # moved mid-turn: it goes on decoding elsewhere, no new decode_started
    "turn_interrupted": "decode",  # cut by a weight update: recomputed and resumed, no event until decode_done
    "tool_started": "tool",
}
# the order of one turn's events at one instant (a turn's last events before the next turn's first)
ORDER = {
    kind: i
    for i, kind in enumerate(
        (
            "started",
            "prefill_queued",
            "reprefill",
            "prefill_started",
            "prefill_done",
            "kv_transfer_done",
            "decode_queued",
            "decode_started",
            "decode_migrated",
            "turn_interrupted",
            "decode_done",
            "tool_started",
            "tool_done",
            "finished",
        )
    )
}


def breakdown(trajectory_events: pl.DataFrame, origin_s: float, end_s: float | None = None) -> dict[str, float]:
    """Model seconds of one trajectory, from `origin_s` (its step's start) to its `finished`
    event, and on to `end_s` (the batch formed: "batch"), per bucket (`BUCKETS`); the buckets
    add up to that span."""
    out = dict.fromkeys(BUCKETS, 0.0)
    rows = (
        trajectory_events.filter(pl.col("kind").is_in(list(ORDER)))
        .with_columns(
            pl.col("turn").fill_null(pl.when(pl.col("kind") == "finished").then(1 << 30).otherwise(-1)).alias("_turn"),
            pl.col("kind").replace_strict(ORDER, return_dtype=pl.Int64).alias("_order"),
        )
        .sort(["at_s", "_turn", "_order"])
    )
    state, since = "start", origin_s
    for kind, at_s in zip(rows["kind"], rows["at_s"]):
        out[state] += max(0.0, at_s - since)
        since = max(since, at_s)
        if kind == "finished":
            out["batch"] = max(0.0, (end_s if end_s is not None else at_s) - at_s)
            break
        state = STATE_OF[kind]
    return out


def critical_paths(events: pl.DataFrame, mode: str = "sync") -> list[dict]:
    """Per sync step (or once for an async run): the trajectory that finished last, its task
    family and turns, and `breakdown` of its time from the step's start. Steps with no
    finished trajectory are left out."""
    starts = events.filter(pl.col("kind") == "step_started").group_by("step").agg(pl.col("at_s").min().alias("origin_s")).sort("step")
    started = (
        events.filter(pl.col("kind") == "started").group_by("trajectory_id").agg(pl.col("step").first(), pl.col("task_family").first())
    )
    finished = events.filter(pl.col("kind") == "finished").group_by("trajectory_id").agg(pl.col("at_s").min().alias("finished_at_s"))
    runs = started.join(finished, on="trajectory_id")
    if mode == "async":  # one stretch: the run, up to the forming of the last batch
        done = events.filter(pl.col("kind") == "batch_ready")["at_s"].max()
        if done is not None:
            runs = runs.filter(pl.col("finished_at_s") <= done)
        dropped = events.filter(pl.col("kind") == "trajectory_dropped")["trajectory_id"]
        runs = runs.filter(~pl.col("trajectory_id").is_in(dropped.implode()))
        origin = starts["origin_s"].min() if starts.height else events["at_s"].min()
        stretches = [(None, origin, done, runs)]
    else:
        dones = dict(events.filter(pl.col("kind") == "rollout_done").group_by("step").agg(pl.col("at_s").max()).iter_rows())
        stretches = [(step, origin, dones.get(step), runs.filter(pl.col("step") == step)) for step, origin in starts.iter_rows()]
    paths = []
    for step, origin_s, end_s, candidates in stretches:
        if candidates.height == 0 or origin_s is None:
            continue
        last = candidates.sort(["finished_at_s", "trajectory_id"]).row(-1, named=True)
        own = events.filter(pl.col("trajectory_id") == last["trajectory_id"])
        turns = own.filter(pl.col("kind") == "prefill_queued")["turn"].n_unique()
        paths.append(
            {
                "step": step,
                "trajectory_id": last["trajectory_id"],
                "task_family": last["task_family"],
                "turns": turns,
                "origin_s": float(origin_s),
                "finished_at_s": float(last["finished_at_s"]),
                **breakdown(own, float(origin_s), end_s),
            }
        )
    return paths


def summed(paths: list[dict]) -> dict[str, float]:
    """The buckets summed over the paths (a sync run's steps): what the rollout time is made of."""
    return {b: round(sum(p[b] for p in paths), 2) for b in BUCKETS}


def markdown_lines(paths: list[dict]) -> list[str]:
    """The report's section on what ended each step (async: the run), a table row per path;
    nothing where no trajectory finished."""
    if not paths:
        return []
    return [
        "## What ended each step",
        "",
        "Each step lasts until its last trajectory finishes: that trajectory's model seconds from the step's start, by what it was doing.",
        "",
        "| step | trajectory | family | turns | " + BUCKETS_HEADER,
        "| ---: | --- | --- | ---: | " + BUCKETS_ALIGN,
        *(
            f"| {'–' if p['step'] is None else p['step']} | {p['trajectory_id']} | {p['task_family']} | {p['turns']} | "
            + " | ".join(f"{p[b]:.1f}" for b in BUCKETS)
            + " |"
            for p in paths
        ),
        "",
    ]
