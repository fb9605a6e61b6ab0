"""Write a recorded trace from a run's lifecycle log: one line per finished trajectory.

    python -m runners.trace RUN_DIR --out FILE.jsonl     (RUN_DIR, or its events.parquet)
    python -m runners.trace --schema                     (the JSON Schema of one line)

Any run's log will do: emulated, torch or vLLM, launched or simulated. The format and how
`workload.trace` replays it: docs/workloads.md, "Recorded traces". What a line holds is read
from the environment's events of the trajectory's last rollout (a trajectory rerun after a
fault counts once, as it finished):

* `started` and `prefill_queued`: each turn's new tokens and the context before it; a turn's
  output tokens are the next turn's context less this turn's context and new tokens (the
  last turn's: `finished`'s generated tokens less the earlier turns' outputs);
* `tool_done`: the seconds of the tool call after each turn;
* `finished`: the turn count, the family, the step and the reward.

A sync run's lines carry `step` (the RL step) and `group` (the trajectory id less its
`-g<sample>` suffix: the GRPO task); an async run's (its log has `batch_ready` events) carry
`group` only, in the trainer's group order, since its assignment steps are policy versions,
not batches. Lines are written in the trainer's order: by step, then by trajectory id with
its numbers compared as numbers (s0-k2-g1 before s0-k10-g0).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import polars as pl

from actors.environment.trace import TRACE_SCHEMA, TraceError, TraceLine, TraceTurn, write_trace
from bus_schemas.eventlog import EventLogError, load_events
from bus_schemas.lifecycle import EventKind

__all__ = ["TRACE_SCHEMA", "TraceError", "group_of", "main", "trace_lines", "trace_of_run"]

_KINDS = [EventKind.STARTED, EventKind.PREFILL_QUEUED, EventKind.TOOL_DONE, EventKind.FINISHED]
_SAMPLE_SUFFIX = re.compile(r"^(.+)-g\d+$")


def group_of(trajectory_id: str) -> str:
    """The GRPO group (task) of a trainer's trajectory id: `s<step>-k<task>-g<sample>` and
    `a<group>-g<sample>` less `-g<sample>`; any other id is a group of its own."""
    m = _SAMPLE_SUFFIX.match(trajectory_id)
    return m.group(1) if m else trajectory_id


def _natural(text: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text))


def trace_lines(events: pl.DataFrame) -> list[TraceLine]:
    """One TraceLine per finished trajectory of a lifecycle log (rows in time order, as
    `load_events` gives them); TraceError names a trajectory whose events do not add up."""
    is_async = bool((events["kind"] == EventKind.BATCH_READY.value).any())
    env = events.filter(pl.col("kind").is_in([k.value for k in _KINDS]) & (pl.col("trajectory_id") != ""))
    env = env.select(
        "trajectory_id", "kind", "turn", "step", "task_family", "new_tokens", "context_tokens", "generated_tokens", "duration_s", "reward"
    )
    keyed: list[tuple[tuple, TraceLine]] = []
    for (trajectory_id,), rows in env.group_by("trajectory_id", maintain_order=True):
        rows = rows.to_dicts()
        line = _line(trajectory_id, rows, with_step=not is_async)
        if line is not None:
            keyed.append(((0 if is_async else max(r["step"] for r in rows), _natural(trajectory_id)), line))
    return [line for _, line in sorted(keyed, key=lambda pair: pair[0])]


def _line(trajectory_id: str, rows: list[dict], with_step: bool) -> TraceLine | None:
    kinds = [r["kind"] for r in rows]
    if EventKind.FINISHED.value not in kinds:
        return None  # never finished (a run stopped early): no line
    end = len(kinds) - 1 - kinds[::-1].index(EventKind.FINISHED.value)
    starts = [i for i in range(end) if kinds[i] == EventKind.STARTED.value]
    if not starts:
        raise TraceError(f"trajectory {trajectory_id}: finished without a started event")
    rollout = rows[starts[-1] : end + 1]  # its last rollout, up to where it finished
    finished = rows[end]
    queued = {r["turn"]: r for r in rollout if r["kind"] == EventKind.PREFILL_QUEUED.value}  # a repeat: the last wins
    tools = {r["turn"]: r["duration_s"] for r in rollout if r["kind"] == EventKind.TOOL_DONE.value}
    n = finished["turn"] + 1
    if sorted(queued) != list(range(n)):
        raise TraceError(
            f"trajectory {trajectory_id}: finished after {n} turn(s) but its prefill_queued events cover turns {sorted(queued)}"
        )
    missing_tools = [t for t in range(n - 1) if t not in tools]
    if missing_tools:
        raise TraceError(f"trajectory {trajectory_id}: no tool_done event after turn(s) {missing_tools}")
    outputs = [queued[t + 1]["context_tokens"] - queued[t]["context_tokens"] - queued[t]["new_tokens"] for t in range(n - 1)]
    outputs.append(finished["generated_tokens"] - sum(outputs))
    if min(outputs) < 1 or min(queued[t]["new_tokens"] for t in range(n)) < 1:
        raise TraceError(
            f"trajectory {trajectory_id}: its events give turns of < 1 token (output tokens {outputs}); the log is inconsistent"
        )
    turns = [TraceTurn(new_tokens=queued[t]["new_tokens"], output_tokens=outputs[t], tool_latency_s=tools[t]) for t in range(n - 1)]
    turns.append(TraceTurn(new_tokens=queued[n - 1]["new_tokens"], output_tokens=outputs[-1]))  # no tool call follows it
    reward = finished["reward"]
    if reward is None:
        raise TraceError(f"trajectory {trajectory_id}: its finished event has no reward")
    extra = {"step": finished["step"]} if with_step and finished["step"] >= 0 else {}
    return TraceLine(family=finished["task_family"], turns=turns, reward=reward, id=trajectory_id, group=group_of(trajectory_id), **extra)


def events_path(run: Path) -> Path:
    return run / "events.parquet" if run.is_dir() else run


def trace_of_run(run: str | Path) -> list[TraceLine]:
    """The trace of a run folder (or of its events.parquet)."""
    return trace_lines(load_events(events_path(Path(run))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.trace", description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, nargs="?", help="a run folder (or its events.parquet)")
    parser.add_argument("--out", type=Path, help="the trace file to write (JSONL)")
    parser.add_argument("--schema", action="store_true", help="print the JSON Schema of one trace line and exit")
    args = parser.parse_args(argv)
    if args.schema:
        print(json.dumps(TRACE_SCHEMA, indent=2))
        return 0
    if args.run is None or args.out is None:
        parser.error("give a RUN_DIR and --out FILE (or --schema)")
    try:
        lines = trace_of_run(args.run)
        if not lines:
            raise TraceError(f"{events_path(args.run)}: no finished trajectory to write")
        write_trace(lines, args.out)
    except (EventLogError, TraceError, OSError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    turns = sum(len(line.turns) for line in lines)
    print(f"wrote {len(lines)} trajectories ({turns} turns) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
