"""Completeness of a lifecycle log: does every trajectory show every transition?

Used by the launcher (the count goes into summary.json) and by the tests.
"""

from __future__ import annotations

import polars as pl

from actors.config import Config, initial_roles
from bus_schemas.control import Role
from bus_schemas.lifecycle import TOOL_KINDS, TURN_KINDS_COLOCATED, TURN_KINDS_PD, EventKind


def incomplete_trajectories(events: pl.DataFrame, trajectory_ids: set[str], disaggregated: bool | None) -> dict[str, list[str]]:
    """trajectory id -> what is missing (empty dict: every trajectory is complete).

    A complete trajectory has one `started`, one `finished` (whose `turn` is its last turn),
    every turn kind for each turn 0..last (PD or colocated), and a tool call between turns.
    `disaggregated=None` (a fleet whose roles change): a turn whose last attempt crossed
    engines (it has a `decode_queued` or `kv_transfer_done`) needs the PD kinds, any other the
    colocated ones. The last attempt decides: a hand-off abandoned by a re-prefill (its KV
    lost, or of an older policy than the engine that took it) leaves a `decode_queued` that
    no `kv_transfer_done` follows, and the turn then runs on one engine.
    Other kinds are allowed beside them: a re-prefill, a migrated decode, an interrupted turn
    (`turn_interrupted`, async) and a `trajectory_dropped` (turn -1, async) change nothing here.
    A trajectory whose environment failed (`env_error`) before its last turn was submitted
    (a failed `reset`) ends with that turn unrun.
    """
    pd_kinds = {k.value for k in TURN_KINDS_PD}
    crossing = {EventKind.DECODE_QUEUED.value, EventKind.KV_TRANSFER_DONE.value}
    fixed_kinds = None if disaggregated is None else pd_kinds if disaggregated else {k.value for k in TURN_KINDS_COLOCATED}
    tool_kinds = {k.value for k in TOOL_KINDS}
    per_traj = (
        events.filter(pl.col("trajectory_id").is_in(list(trajectory_ids)))
        .group_by("trajectory_id", "turn")
        .agg(
            pl.col("kind").unique(),
            pl.col("kind").filter(pl.col("attempt") == pl.col("attempt").max()).unique().alias("last_kinds"),
        )
    )
    kinds: dict[str, dict[int, set[str]]] = {}
    last_kinds: dict[tuple[str, int], set[str]] = {}  # the kinds of each turn's last attempt
    for row in per_traj.iter_rows(named=True):
        kinds.setdefault(row["trajectory_id"], {})[row["turn"]] = set(row["kind"])
        last_kinds[row["trajectory_id"], row["turn"]] = set(row["last_kinds"])
    problems: dict[str, list[str]] = {}
    for trajectory_id in sorted(trajectory_ids):
        turns = kinds.get(trajectory_id, {})
        missing: list[str] = []
        finished_turn = next((t for t, k in turns.items() if EventKind.FINISHED.value in k), None)
        if finished_turn is None:
            missing.append("finished")
            finished_turn = max(turns, default=-1)
        if EventKind.STARTED.value not in turns.get(0, set()):
            missing.append("started")
        last = turns.get(finished_turn, set())
        # an environment that failed before the turn was submitted (env_error, reset included) ends it unrun
        unrun = EventKind.ENV_ERROR.value in last and EventKind.PREFILL_QUEUED.value not in last
        for turn in range(finished_turn + (0 if unrun else 1)):
            have = turns.get(turn, set())
            crossed = last_kinds.get((trajectory_id, turn), set()) & crossing
            turn_kinds = fixed_kinds or (pd_kinds if crossed else {k.value for k in TURN_KINDS_COLOCATED})
            want = turn_kinds | (tool_kinds if turn < finished_turn else set())
            missing += [f"turn {turn}: {k}" for k in sorted(want - have)]
        if missing:
            problems[trajectory_id] = missing
    return problems


def expects_pd_turns(config: Config) -> bool | None:
    """Which turns a run's log should show: PD (True), colocated (False) or either (None)."""
    if config.runs_allocator:  # roles change during the run
        return None
    split = Role.PREFILL in initial_roles(config).values()
    return None if split and config.local_prefill_max_tokens > 0 else split  # a split's short appends stay local
