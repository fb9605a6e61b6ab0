"""What ends each step (`ops.critical_path`), on hand-written lifecycle logs whose answers
are known: the last trajectory of each step, and its time by what it was doing."""

from __future__ import annotations

import polars as pl
import pytest

from ops.critical_path import BUCKETS, breakdown, critical_paths, markdown_lines, summed


def _log(rows: list[tuple]) -> pl.DataFrame:
    """(kind, at_s, step, trajectory_id, turn) rows as a lifecycle log."""
    return pl.DataFrame(
        [
            {"kind": k, "at_s": t, "step": s, "trajectory_id": traj, "task_family": "swe" if traj else "", "turn": turn}
            for k, t, s, traj, turn in rows
        ],
        schema={
            "kind": pl.String,
            "at_s": pl.Float64,
            "step": pl.Int64,
            "trajectory_id": pl.String,
            "task_family": pl.String,
            "turn": pl.Int64,
        },
    )


def _two_turns(traj: str, step: int, t0: float) -> list[tuple]:
    """A PD trajectory started 1 s into its step at t0: two turns, a 15 s tool call between,
    a KV write-back that changes nothing for it; it finishes at t0 + 30."""
    at = [
        ("started", 1.0, None),
        ("prefill_queued", 1.0, 0),
        ("prefill_started", 3.0, 0),
        ("kv_writeback_done", 3.5, 0),
        ("prefill_done", 4.0, 0),
        ("kv_transfer_done", 4.5, 0),
        ("decode_started", 5.0, 0),
        ("decode_done", 10.0, 0),
        ("tool_started", 10.0, 0),
        ("tool_done", 25.0, 0),
        ("prefill_queued", 25.0, 1),
        ("prefill_started", 25.5, 1),
        ("prefill_done", 26.0, 1),
        ("decode_started", 26.0, 1),
        ("decode_done", 30.0, 1),
        ("finished", 30.0, None),
    ]
    return [(kind, t0 + t, step, traj, turn) for kind, t, turn in at]


EXPECTED = {
    "start": 1.0,
    "environment": 0.0,
    "prefill_wait": 2.5,
    "prefill": 1.5,
    "decode_wait": 1.0,
    "decode": 9.0,
    "tool": 15.0,
    "batch": 0.0,
}


def test_a_trajectorys_time_goes_to_the_state_each_event_puts_it_in():
    log = _log([("step_started", 0.0, 0, "", None), *_two_turns("a", 0, 0.0)])
    assert breakdown(log.filter(pl.col("trajectory_id") == "a"), 0.0) == pytest.approx(EXPECTED)
    late = breakdown(log.filter(pl.col("trajectory_id") == "a"), 0.0, end_s=32.5)  # the batch formed 2.5 s after it finished
    assert late == pytest.approx(EXPECTED | {"batch": 2.5})


def test_each_sync_step_is_ended_by_its_last_trajectory_and_the_buckets_add_up_to_its_rollout():
    rows = [
        ("step_started", 0.0, 0, "", None),
        *_two_turns("s0-early", 0, -5.0),
        *_two_turns("s0-last", 0, 0.0),
        ("rollout_done", 30.0, 0, "", None),
        ("step_started", 40.0, 1, "", None),
        *_two_turns("s1-last", 1, 40.0),
        *_two_turns("s1-early", 1, 38.0),
        ("rollout_done", 70.5, 1, "", None),
    ]
    paths = critical_paths(_log(rows), "sync")
    assert [(p["step"], p["trajectory_id"], p["turns"]) for p in paths] == [(0, "s0-last", 2), (1, "s1-last", 2)]
    assert {b: paths[0][b] for b in BUCKETS} == pytest.approx(EXPECTED)
    assert {b: paths[1][b] for b in BUCKETS} == pytest.approx(EXPECTED | {"batch": 0.5})  # rollout_done came 0.5 s after it
    total = summed(paths)
    assert sum(total.values()) == pytest.approx(30.0 + 30.5)  # each step from its start to its rollout_done
    assert total["tool"] == 30.0 and total["decode"] == 18.0


def test_an_async_run_is_one_stretch_to_its_last_batch_and_a_later_finish_is_not_its_end():
    rows = [
        ("step_started", 0.0, 0, "", None),
        *_two_turns("a-trained", 0, 10.0),
        ("batch_ready", 45.0, 1, "", None),
        *_two_turns("b-after-the-last-batch", 1, 20.0),  # finishes at 50: no batch took it
    ]
    (path,) = critical_paths(_log(rows), "async")
    assert path["trajectory_id"] == "a-trained" and path["step"] is None
    assert path["start"] == pytest.approx(11.0) and path["batch"] == pytest.approx(5.0)  # trained while the trainer was busy
    assert sum(path[b] for b in BUCKETS) == pytest.approx(45.0)
    row = next(line for line in markdown_lines([path]) if "a-trained" in line)  # the report's row: no step in async
    assert row.startswith("| – | a-trained | swe | 2 | 11.0 |") and row.endswith("| 15.0 | 5.0 |")


def test_a_step_with_no_finished_trajectory_is_left_out():
    rows = [("step_started", 0.0, 0, "", None), ("started", 1.0, 0, "x", None), ("prefill_queued", 1.0, 0, "x", 0)]
    assert critical_paths(_log(rows), "sync") == [] and markdown_lines([]) == []


def test_events_of_one_instant_are_taken_in_the_order_they_happen_not_the_logs():
    """A log sorts ties by event id, which can put a prefill's start before the trajectory's
    start, the next turn's queueing before the tool's end, or a decode's start before the
    prefill's end: the same log in reverse gives every tie of `_two_turns` the wrong order
    (started/prefill_queued, decode_done/tool_started, tool_done/next prefill_queued,
    prefill_done/decode_started, decode_done/finished), and the same breakdown."""
    rows = _two_turns("a", 0, 0.0)
    assert breakdown(_log(rows[::-1]), 0.0) == pytest.approx(EXPECTED)
    log = _log([("step_started", 0.0, 0, "", None), *rows[::-1], ("rollout_done", 30.0, 0, "", None)])
    (path,) = critical_paths(log, "sync")
    assert {b: path[b] for b in BUCKETS} == pytest.approx(EXPECTED)


def test_a_decode_moved_or_cut_mid_turn_stays_decode_until_it_is_done():
    rows = [
        ("started", 0.0, 0, "a", None),
        ("prefill_queued", 0.0, 0, "a", 0),
        ("prefill_started", 1.0, 0, "a", 0),
        ("prefill_done", 2.0, 0, "a", 0),
        ("decode_started", 2.0, 0, "a", 0),
        ("decode_migrated", 5.0, 0, "a", 0),  # a role switch moved it; no new decode_started follows
        ("turn_interrupted", 7.0, 0, "a", 0),  # a weight update cut it; recomputed and resumed without an event
        ("decode_done", 12.0, 0, "a", 0),
        ("finished", 12.0, 0, "a", None),
    ]
    out = breakdown(_log(rows), 0.0)
    assert out["decode"] == pytest.approx(10.0) and out["decode_wait"] == 0.0 and out["prefill_wait"] == pytest.approx(1.0)


def test_an_async_run_leaves_out_a_dropped_trajectory_and_a_repeated_finish_counts_once():
    rows = [
        ("step_started", 0.0, 0, "", None),
        *_two_turns("a-trained", 0, 0.0),
        *_two_turns("b-dropped", 0, 5.0),
        ("trajectory_dropped", 35.0, 0, "b-dropped", None),
        ("finished", 33.0, 0, "a-trained", None),
        ("batch_ready", 40.0, 1, "", None),
    ]
    (path,) = critical_paths(_log(rows), "async")
    assert path["trajectory_id"] == "a-trained" and path["finished_at_s"] == 30.0  # its first finish
    assert path["batch"] == pytest.approx(10.0) and sum(path[b] for b in BUCKETS) == pytest.approx(40.0)
