"""The lifecycle model in async RL (docs/async.md): no step boundaries, so it reads the
cadence from batch_ready and the waves of starts each batch admits (under `hold`, once the
new version is published), and predicts the burst after each version that a step-based
model never sees coming."""

from __future__ import annotations

import numpy as np
import polars as pl

from bus_schemas.lifecycle import EventKind as K
from bus_schemas.lifecycle import LifecycleEvent
from forecasting.live import LiveState, batch_trajectories
from forecasting.models import History
from forecasting.models.lifecycle import Lifecycle
from forecasting.synthetic import synthetic_async_log, synthetic_log
from ops.export import events_frame

WAVE, TRAIN_S, GAP_S = 16, 10.0, 40.0


def _state_at(events: pl.DataFrame, until_s: float) -> LiveState:
    state = LiveState()
    state.ingest(events.filter(pl.col("at_s") < until_s))
    return state


def _forecast(state: LiveState, now_s: float, bins: int, target: str = "prefill_new_tokens"):
    history = History(1.0, now_s, {}, state)
    prediction = Lifecycle().update(history).predict(bins)
    return prediction.mean[target], prediction.point_forecast(target)


def _log(**kw) -> pl.DataFrame:
    return synthetic_async_log(batches=8, wave=WAVE, seed=3, gap_s=GAP_S, train_s=TRAIN_S, **kw)


def _anchors(events: pl.DataFrame, kind: str) -> list[float]:
    return events.filter(pl.col("kind") == kind)["at_s"].to_list()


def test_the_mode_and_the_async_cadence_come_from_the_events_alone():
    events = _log()
    state = _state_at(events, float(events["at_s"].max()) + 1)
    assert state.mode == "async"
    assert len(state.batch_ready_s) == 8 and state.batch_gap_s.n == 7
    assert 0.85 * GAP_S <= state.batch_gap_s.mean() <= 1.15 * GAP_S
    # every wave starts train_s after its batch: the offset the model learns, never the first fill's
    assert state.wave_offset_s.n == 8 * WAVE and np.allclose(state.wave_offset_s.values(), TRAIN_S)
    assert state.started_per_cycle[0] == 2 * WAVE and all(state.started_per_cycle[k] == WAVE for k in range(1, 9))
    sync = LiveState()
    sync.ingest(events_frame([LifecycleEvent(event_id="s", kind=K.STEP_STARTED, at_s=0.0, actor_id="trainer", step=0)]))
    sync.ingest(synthetic_log(trajectories=5, seed=1))
    assert sync.mode == "sync"
    assert batch_trajectories("staleness [3, 29]; masked turns 0") == 32 and batch_trajectories("odd") is None


def test_the_burst_after_a_new_version_is_predicted_and_a_step_based_view_misses_it():
    events = _log()
    ready = _anchors(events, "batch_ready")
    wave_tokens = events.filter((pl.col("kind") == "started") & (pl.col("step") == 6))["new_tokens"].sum()
    now_s = float(np.ceil(ready[5])) + 1.0  # batch 5 is ready; its wave comes with version 6, train_s later
    wave_bin = int(np.floor(ready[5] + TRAIN_S)) - int(now_s)
    state = _state_at(events, now_s)
    mean, point = _forecast(state, now_s, 20)
    burst = mean[max(wave_bin - 1, 0) : wave_bin + 2].sum()
    assert burst >= 0.5 * wave_tokens  # most of the wave's prompts, around when they come
    assert point[wave_bin] >= 0.5 * wave_tokens / 2  # the point forecast has the block (it is near certain)
    assert mean[: wave_bin - 2].max() < 0.2 * burst  # and not before
    state.mode = "sync"  # the step-based view of the same log: no step_started, no starts foreseen
    step_mean, _ = _forecast(state, now_s, 20)
    assert step_mean[max(wave_bin - 1, 0) : wave_bin + 2].sum() < 0.2 * burst


def test_a_wave_that_does_not_come_fades_and_an_unlikely_one_stays_out_of_the_point_forecast():
    events = _log(idle_batches=1)  # the last batch admits no wave (the run's end)
    ready = _anchors(events, "batch_ready")
    on_time = _state_at(events, ready[-1] + 1.0).cadence(ready[-1] + 1.0)
    late_s = ready[-1] + 3 * TRAIN_S
    late = _state_at(events, late_s).cadence(late_s)
    assert on_time.pending == WAVE and on_time.pending_chance > 0.8
    assert late.pending_chance < 0.2 * on_time.pending_chance
    # between batches the next wave is a whole block that lands in one of several bins: the
    # mean spreads it over them, and the median of each (the point forecast) leaves it out
    now_s = float(np.ceil(ready[3] + TRAIN_S)) + 3.0  # wave 4 started; the next one is ~GAP_S - 3 s away
    state = _state_at(events, now_s)
    mean, point = _forecast(state, now_s, 45)
    wave_tokens = events.filter((pl.col("kind") == "started") & (pl.col("step") == 4))["new_tokens"].sum()
    maybe = mean > 0.1 * wave_tokens
    assert maybe.any() and mean.max() < 0.5 * wave_tokens
    assert point[maybe].max() < 0.05 * wave_tokens  # prompts counted one by one would put ~mean here
