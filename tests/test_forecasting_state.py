"""The live trajectory state: applying a tick's events as one vectorised chunk gives the
same trajectories and learned distributions however the log is cut into ticks, and the
sync-RL cadence (trainer gap, launch spread, pending starts) is read from fleet events."""

from __future__ import annotations

import msgspec
import numpy as np
import polars as pl

from bus_schemas.lifecycle import FINAL_STEP, LifecycleEvent
from bus_schemas.lifecycle import EventKind as K
from forecasting.live import POOLED, LiveState
from forecasting.series import live_context_by_bin
from forecasting.synthetic import synthetic_events, synthetic_log
from ops.export import events_frame


def _ingest(events: pl.DataFrame, tick_s: float) -> LiveState:
    state = LiveState(capacity=8)  # small: the slot arrays grow on the way
    at_s = events["at_s"].to_numpy()
    start = 0
    for k in range(1, int(at_s.max() / tick_s) + 2):
        cut = int(np.searchsorted(at_s, k * tick_s))
        state.ingest(events.slice(start, cut - start))
        start = cut
    return state


def _view(state: LiveState) -> tuple:
    slots = sorted(
        (t, int(state.phase[i]), float(state.entered_s[i]), int(state.turn[i]), bool(state.prefilled[i])) for t, i in state._slot.items()
    )
    stats = {
        (key, name): tuple(getattr(st, name).values())
        for key, st in state.stats.items()
        for name in ("obs_tokens", "gen_tokens", "miss_tokens", "prompt_tokens", "prompt_pre_s")
    }
    stages = {(key, i): tuple(st.stage_s[i].values()) for key, st in state.stats.items() for i in range(3)}
    turns = {key: tuple(st.turns.last_turn_counts) for key, st in state.stats.items()}
    return slots, stats, stages, turns, dict(state.started_per_step), state.events


def test_the_state_does_not_depend_on_how_the_log_is_cut_into_ticks():
    events = synthetic_log(trajectories=60, seed=4, spread_s=15.0, max_turns=5)
    at_s = events["at_s"].to_numpy()
    mid = events.filter(pl.col("at_s") < float(np.median(at_s)))  # a log cut mid-run: trajectories live
    for log in (events, mid):
        assert _view(_ingest(log, 0.25)) == _view(_ingest(log, 1.0)) == _view(_ingest(log, 7.0))
    state = _ingest(mid, 1.0)
    assert 0 < state.live_count() == int(state.alive.sum()) < 60
    assert state.stats[POOLED].stage_s[1].n > 0 and state.stats[POOLED].turns.n > 0


def _histories_by_hand(events: pl.DataFrame, until_s: float) -> int:
    """The KV each live trajectory holds before `until_s`: its last queued turn's context, and
    its new tokens once prefilled (not after a re-prefill), or all of a decoded turn's tokens;
    nothing once finished."""
    last: dict[str, int] = {}
    queued: dict[str, tuple[int, int]] = {}
    for kind, tid, context, new, generated in (
        events.filter(pl.col("at_s") < until_s)
        .select("kind", "trajectory_id", "context_tokens", "new_tokens", "generated_tokens")
        .iter_rows()
    ):
        if kind == "prefill_queued":
            queued[tid] = (context, new)
            last[tid] = context
        elif kind == "prefill_done":
            last[tid] = sum(queued[tid])
        elif kind == "reprefill":
            last[tid] = queued[tid][0]
        elif kind == "decode_done":
            last[tid] = context + new + generated
        elif kind == "finished":
            last[tid] = 0
    return sum(last.values())


def test_the_live_histories_are_counted_alike_by_the_forecaster_and_the_oracle():
    """The live histories the allocator sizes colocation's KV on: the forecaster's live state
    and the oracle's reading of a recorded log count the same tokens at every cut."""
    log = synthetic_events(trajectories=40, seed=7, spread_s=10.0, max_turns=6)
    # a turn re-sent to prefill (its KV was lost) changes no history; older logs' reprefill
    # events carry no token counts
    resent = [
        msgspec.structs.replace(e, kind=K.REPREFILL, event_id=e.event_id + "-again", new_tokens=0, context_tokens=0)
        for i, e in enumerate(log)
        if e.kind is K.PREFILL_QUEUED and i % 3 == 0
    ]
    # ... and one whose KV is lost after its prefill (preempted): it holds its context alone
    resent += [
        msgspec.structs.replace(e, kind=K.REPREFILL, event_id=e.event_id + "-lost", new_tokens=0, context_tokens=0)
        for i, e in enumerate(log)
        if e.kind is K.PREFILL_DONE and i % 4 == 0
    ]
    assert resent
    events = events_frame(log + resent).sort("at_s", maintain_order=True)
    end_s = float(events["at_s"].max())
    per_bin = live_context_by_bin(events, 1.0, int(end_s) + 1)
    for cut_s in np.arange(1.0, int(end_s) + 1.0, 2.0):
        state = _ingest(events.filter(pl.col("at_s") < cut_s), 1.0)
        expected = _histories_by_hand(events, cut_s)
        assert state.live_context_tokens() == expected == per_bin[int(cut_s) - 1]
    assert 0 < _histories_by_hand(events, 8.0) and per_bin[-1] == 0  # every trajectory finished


def ev(i: int, kind: K, at_s: float, **fields) -> LifecycleEvent:
    return LifecycleEvent(event_id=f"e{i:03d}", kind=kind, at_s=at_s, actor_id="t", **fields)


def test_step_cadence_and_pending_starts_of_the_running_step():
    log = [ev(0, K.STEP_STARTED, 0.0, step=0)]
    log += [ev(1 + i, K.STARTED, 0.5 * (i + 1), trajectory_id=f"a{i}", task_family="swe", step=0, new_tokens=10) for i in range(4)]
    log += [ev(10 + i, K.FINISHED, 10.0 + i, trajectory_id=f"a{i}", task_family="swe", step=0) for i in range(4)]
    log += [ev(20, K.ROLLOUT_DONE, 14.0, step=0), ev(21, K.STEP_STARTED, 34.0, step=1)]
    log += [ev(22, K.STARTED, 35.0, trajectory_id="b0", task_family="swe", step=1, new_tokens=10)]
    log += [ev(30, K.FINISHED, 36.0, trajectory_id="a0", task_family="swe", step=0)]  # a stray: ignored
    state = LiveState()
    state.ingest(events_frame(log))
    assert state.step_gap_s.values().tolist() == [20.0]
    assert state.start_offset_s.values().tolist() == [0.5, 1.0, 1.0, 1.5, 2.0]
    assert state.step == 1 and state.pending_starts() == 3  # step 0 started 4; step 1 one so far
    assert state.live_count() == 1 and state.stats["swe"].turns.n == 4


def test_no_step_is_foreseen_after_the_run_s_last_rollout():
    """The trainer marks its last step's rollout_done; past it the cadence brings no next step
    (before, the forecast expected one, and the allocator switched roles while the trainer
    trained the last step)."""
    log = [ev(0, K.STEP_STARTED, 0.0, step=0), ev(1, K.STARTED, 0.5, trajectory_id="a", task_family="swe", step=0, new_tokens=10)]
    log += [ev(2, K.FINISHED, 9.0, trajectory_id="a", task_family="swe", step=0), ev(3, K.ROLLOUT_DONE, 9.0, step=0)]
    log += [ev(4, K.STEP_STARTED, 29.0, step=1), ev(5, K.STARTED, 29.5, trajectory_id="b", task_family="swe", step=1, new_tokens=10)]
    log += [ev(6, K.FINISHED, 40.0, trajectory_id="b", task_family="swe", step=1)]
    between, after_last = LiveState(), LiveState()
    between.ingest(events_frame(log[:4]))
    after_last.ingest(events_frame(log + [ev(7, K.ROLLOUT_DONE, 40.0, step=1, detail=FINAL_STEP)]))
    assert (between.cadence(15.0).next_size, between.cadence(15.0).next_chance) == (1, 1.0)
    assert (after_last.cadence(45.0).next_size, after_last.cadence(45.0).next_chance) == (1, 0.0)


def test_events_after_a_finish_are_ignored_in_the_same_chunk_and_later():
    turn = [
        ev(0, K.STARTED, 0.0, trajectory_id="a", task_family="swe", new_tokens=10),
        ev(1, K.PREFILL_QUEUED, 0.0, trajectory_id="a", task_family="swe", new_tokens=10),
        ev(2, K.DECODE_STARTED, 1.0, trajectory_id="a", task_family="swe"),
        ev(3, K.DECODE_DONE, 2.0, trajectory_id="a", task_family="swe", generated_tokens=5),
        ev(4, K.FINISHED, 2.0, trajectory_id="a", task_family="swe"),
        ev(5, K.STARTED, 2.5, trajectory_id="b", task_family="math", new_tokens=7),
    ]
    strays = [
        ev(6, K.DECODE_STARTED, 2.6, trajectory_id="a", task_family="swe"),
        ev(7, K.DECODE_DONE, 3.5, trajectory_id="a", task_family="swe", generated_tokens=99),
    ]
    clean, same_chunk, later = LiveState(), LiveState(), LiveState()
    clean.ingest(events_frame(turn))
    same_chunk.ingest(events_frame(turn + strays))
    later.ingest(events_frame(turn))
    later.ingest(events_frame(strays))
    assert _view(same_chunk)[:-1] == _view(later)[:-1] == _view(clean)[:-1]  # all but the event count
    assert clean.live_count() == 1 and clean.stats["swe"].gen_tokens.values().tolist() == [5.0]


def test_the_step_mix_is_the_share_of_each_family_started():
    log = [ev(0, K.STEP_STARTED, 0.0, step=0)]
    log += [ev(1 + i, K.STARTED, 0.1 * i, trajectory_id=f"a{i}", task_family=("swe", "swe", "swe", "math")[i], step=0) for i in range(4)]
    state = LiveState()
    state.ingest(events_frame(log))
    assert {state.families[f]: share for f, share in state.step_mix(0).items()} == {"swe": 0.75, "math": 0.25}
    assert state.step_mix(1) == {}
