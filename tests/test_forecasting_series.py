"""Series binning on a hand-built log whose answers are worked out by hand."""

from __future__ import annotations

import polars as pl
import pytest

from bus_schemas.lifecycle import EventKind as K
from bus_schemas.lifecycle import LifecycleEvent
from forecasting.series import COLUMNS, bin_chunk, bin_events, chunk_totals, totals
from ops.export import events_frame


def ev(i: int, kind: K, at_s: float, traj: str = "", family: str = "", **fields) -> LifecycleEvent:
    return LifecycleEvent(event_id=f"e{i:02d}", kind=kind, at_s=at_s, actor_id="t", trajectory_id=traj, task_family=family, **fields)


def hand_built_log() -> pl.DataFrame:
    """a (swe): two turns, a tool call between; b (math): one long turn. Bins of 1 s."""
    a, b = dict(traj="a", family="swe"), dict(traj="b", family="math")
    return events_frame(
        [
            ev(0, K.STEP_STARTED, 0.0, step=0),  # fleet event: not in any series
            ev(1, K.STARTED, 0.2, **a, new_tokens=100),
            ev(2, K.PREFILL_QUEUED, 0.2, **a, new_tokens=100),
            ev(3, K.PREFILL_DONE, 0.5, **a, new_tokens=100),
            ev(4, K.DECODE_STARTED, 0.5, **a, new_tokens=100),
            ev(5, K.STARTED, 1.0, **b, new_tokens=200),
            ev(6, K.PREFILL_QUEUED, 1.0, **b, new_tokens=200),
            ev(7, K.PREFILL_DONE, 1.5, **b, new_tokens=200),
            ev(8, K.DECODE_STARTED, 1.5, **b, new_tokens=200),
            ev(9, K.DECODE_DONE, 2.5, **a, new_tokens=100, generated_tokens=40),
            ev(10, K.TOOL_STARTED, 2.5, **a),
            ev(11, K.TOOL_DONE, 3.25, **a, new_tokens=30, duration_s=0.75),
            ev(12, K.PREFILL_QUEUED, 3.25, **a, turn=1, new_tokens=30, context_tokens=140),
            ev(13, K.PREFILL_DONE, 3.5, **a, turn=1, new_tokens=30, context_tokens=140, cached_prefix_tokens=140),
            ev(14, K.DECODE_STARTED, 3.5, **a, turn=1, new_tokens=30, context_tokens=140, cached_prefix_tokens=140),
            ev(15, K.DECODE_DONE, 3.75, **a, turn=1, new_tokens=30, context_tokens=140, generated_tokens=10),
            ev(16, K.FINISHED, 3.75, **a, turn=1, generated_tokens=50),
            ev(17, K.DECODE_DONE, 4.0, **b, new_tokens=200, generated_tokens=25),
            ev(18, K.FINISHED, 4.0, **b, generated_tokens=25),
        ]
    )


EXPECTED_TOTALS = {
    "prefill_new_tokens": [100, 200, 0, 30, 0],
    "prefill_miss_tokens": [100, 200, 0, 30, 0],  # a's second prefill found its 140-token context cached
    "decode_tokens": [0, 0, 40, 10, 25],
    "arrivals": [1, 1, 0, 0, 0],
    "finishes": [0, 0, 0, 1, 1],
    "decode_active_seqs": [0.5, 1.5, 1.5, 1.25, 0],  # a: 0.5-2.5 and 3.5-3.75; b: 1.5-4.0
    "kv_tokens": [50, 200, 250, 242.5, 0],  # a: 100 then 170 tokens; b: 200 tokens
    "tool_active_trajs": [0, 0, 0.5, 0.25, 0],
}


def test_totals_per_bin_match_the_hand_computed_answers():
    series = bin_events(hand_built_log(), bin_s=1.0)
    assert series.filter(pl.col("task_family") == "all")["bin_start_s"].to_list() == [0.0, 1.0, 2.0, 3.0, 4.0]
    for column, expected in EXPECTED_TOTALS.items():
        assert totals(series, column) == pytest.approx(expected), column


def test_per_family_rows_split_the_total():
    series = bin_events(hand_built_log(), bin_s=1.0)
    swe = series.filter(pl.col("task_family") == "swe").sort("bin")
    math = series.filter(pl.col("task_family") == "math").sort("bin")
    assert swe["decode_active_seqs"].to_list() == pytest.approx([0.5, 1.0, 0.5, 0.25, 0])
    assert math["decode_active_seqs"].to_list() == pytest.approx([0, 0.5, 1.0, 1.0, 0])
    assert swe["prefill_new_tokens"].to_list() == pytest.approx([100, 0, 0, 30, 0])
    for column in COLUMNS:
        assert (swe[column] + math[column]).to_list() == pytest.approx(totals(series, column)), column


def test_binning_in_stretches_with_carried_levels_equals_one_pass():
    log = hand_built_log()
    whole = bin_events(log, bin_s=0.5, end_s=5.0)
    parts, carry = [], None
    for start_s, end_s in [(0.0, 1.5), (1.5, 2.0), (2.0, 3.5), (3.5, 5.0)]:
        chunk = log.filter((pl.col("at_s") >= start_s) & (pl.col("at_s") < end_s))
        part, carry = bin_chunk(chunk, start_s, end_s, 0.5, carry)
        parts.append(part)
    stitched = pl.concat(parts)
    for column in COLUMNS:
        assert totals(stitched, column) == pytest.approx(totals(whole, column)), column


def test_a_stretch_that_is_not_whole_bins_is_refused():
    with pytest.raises(ValueError, match="whole number"):
        bin_chunk(hand_built_log(), 0.0, 1.3, 1.0)


def test_numpy_chunk_totals_equal_the_polars_binning_stretch_by_stretch():
    log = hand_built_log()
    whole = bin_events(log, bin_s=0.5, end_s=5.0)
    parts, carry = {c: [] for c in COLUMNS}, None
    for start_s, end_s in [(0.0, 1.5), (1.5, 2.0), (2.0, 3.5), (3.5, 5.0)]:
        chunk = log.filter((pl.col("at_s") >= start_s) & (pl.col("at_s") < end_s))
        part, carry = chunk_totals(chunk, start_s, end_s, 0.5, carry)
        for column in COLUMNS:
            parts[column] += list(part[column])
    for column in COLUMNS:
        assert parts[column] == pytest.approx(totals(whole, column)), column
