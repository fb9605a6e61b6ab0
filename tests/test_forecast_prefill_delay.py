"""A prefill's compute counts when the prefill is done (the series' prefill_miss_tokens and
prefill_engine_s are credited at prefill_done), not when it is queued: the lifecycle model
moves each expected prefill by the delays its family's prefills took, each weighted by its
size (forecasting.empirical.SizedDelays), and spreads the prefills waiting now over the
delays longer than their wait. The window mean the allocator provisions on counts the same
compute when it is asked for (`Prediction.asked`)."""

from __future__ import annotations

import numpy as np
import pytest

from bus_schemas.eventlog import events_frame
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from forecasting.empirical import SizedDelays
from forecasting.models.lifecycle import Lifecycle
from tests.forecast_helpers import history_at

QUEUE_TO_DONE_S = 4.0  # every prefill after the first turn: queued, then done 4 s later
DECODE_S, TOOL_S = 2.0, 3.0


def _log(n: int, until_s: float):
    """n trajectories started 0.1 s apart, each cycling prefill (4 s; the prompt 0.5 s),
    decode (2 s), tool call (3 s), with 1000 new tokens per turn on a growing context, none
    cached; events before `until_s`."""
    events = []

    def add(kind, at_s, i, turn=0, **fields):
        if at_s < until_s:
            base = dict(trajectory_id=f"t{i}", task_family="swe", actor_id="synthetic", step=0, policy_version=0)
            events.append(LifecycleEvent(event_id=f"t{i}-{len(events)}", kind=kind, at_s=at_s, turn=turn, **base, **fields))

    for i in range(n):
        at_s, context = 0.1 * i, 0
        add(EventKind.STARTED, at_s, i, new_tokens=1000)
        for turn in range(40):
            done_s = at_s + (QUEUE_TO_DONE_S if turn else 0.5)
            tokens = dict(new_tokens=1000, context_tokens=context)
            add(EventKind.PREFILL_QUEUED, at_s, i, turn, **tokens)
            add(EventKind.PREFILL_DONE, done_s, i, turn, cached_prefix_tokens=0, **tokens)
            add(EventKind.DECODE_STARTED, done_s, i, turn, cached_prefix_tokens=0, **tokens)
            add(EventKind.DECODE_DONE, done_s + DECODE_S, i, turn, generated_tokens=100, **tokens)
            add(EventKind.TOOL_STARTED, done_s + DECODE_S, i, turn)
            add(EventKind.TOOL_DONE, done_s + DECODE_S + TOOL_S, i, turn, duration_s=TOOL_S, new_tokens=1000)
            at_s, context = done_s + DECODE_S + TOOL_S, context + 1100
    return events_frame(sorted(events, key=lambda e: (e.at_s, e.event_id)))


def test_a_prefills_compute_is_forecast_when_it_will_be_done_not_when_it_is_queued():
    """20 trajectories in lockstep: every 9 s their turns are queued within 2 s, and done 4 s
    later. The forecast's compute peaks where the log's does, 4 s after the new tokens'."""
    now_s = 60
    prediction = Lifecycle().update(history_at(_log(20, until_s=now_s), now_s)).predict(30)
    mean, asked = prediction.mean, prediction.asked
    later = _log(20, until_s=now_s + 30)
    done = later.filter((later["kind"] == "prefill_done") & (later["at_s"] >= now_s) & (later["at_s"] < now_s + 30))
    bins = np.floor(done["at_s"].to_numpy() - now_s).astype(int)
    actual = np.bincount(bins, (done["context_tokens"] + done["new_tokens"]).to_numpy(), minlength=30)[:30]
    for first, last in ((0, 9), (9, 18), (18, 27)):  # one cycle each
        window = slice(first, last)
        queued_peak = first + int(np.argmax(mean["prefill_new_tokens"][window]))
        assert first + int(np.argmax(mean["prefill_miss_tokens"][window])) == first + int(np.argmax(actual[window])) == queued_peak + 4
        assert first + int(np.argmax(mean["prefill_engine_s"][window])) == queued_peak + 4
        # as asked for (queued), what the window mean the allocator provisions on counts
        assert first + int(np.argmax(asked["prefill_miss_tokens"][window])) == queued_peak
    near = np.convolve(actual > 0, np.ones(3), mode="same") > 0  # the log's compute bins, +-1
    assert mean["prefill_miss_tokens"][near].sum() > 0.8 * mean["prefill_miss_tokens"].sum()
    for target in ("prefill_miss_tokens", "prefill_engine_s"):
        assert prediction.window_mean(target, 9) == pytest.approx(asked[target][:10].mean())
        assert asked[target].sum() == pytest.approx(mean[target].sum(), rel=0.25)  # the same work, timed apart


def test_prefills_waiting_now_land_as_the_delays_longer_than_their_wait():
    delays = SizedDelays(2)
    delays.add_many(np.array([1.0, 4.0, 4.0]), np.array([[100.0, 6.0], [300.0, 1.0], [300.0, 1.0]]))
    step_s, slots = 0.25, 40
    # queued 2 s ago: only the 4 s delays are longer: it lands 2 s from now
    landed = delays.residual(0, np.array([2.0]), np.array([500.0]), step_s, slots)
    assert landed.sum() == pytest.approx(500.0)
    assert np.flatnonzero(landed).tolist() == [8]
    # queued just now: a tenth of the mass (100 of 700) lands in 1 s, the rest in 4 s
    landed = delays.residual(0, np.array([0.0]), np.array([700.0]), step_s, slots)
    assert landed[4] == pytest.approx(100.0) and landed[16] == pytest.approx(600.0)
    # waited longer than any delay seen: it lands now
    assert delays.residual(0, np.array([9.0]), np.array([50.0]), step_s, slots)[0] == pytest.approx(50.0)
    # engine-seconds weigh the delays their own way: 6 of 8 land in 1 s
    landed = delays.residual(1, np.array([0.0]), np.array([8.0]), step_s, slots)
    assert landed[4] == pytest.approx(6.0) and landed[16] == pytest.approx(2.0)
    # arrivals move by the size-weighted delays; without samples they stay where they are
    arrivals = np.eye(1, slots)[0] * 7.0
    assert delays.lagged(0, arrivals, step_s)[[4, 16]] == pytest.approx([1.0, 6.0])
    assert delays.lagged(1, arrivals, step_s)[[4, 16]] == pytest.approx([5.25, 1.75])
    assert np.array_equal(SizedDelays(2).lagged(0, arrivals, step_s), arrivals)


def test_the_ring_keeps_the_most_recent_delays():
    delays = SizedDelays(1, max_samples=3)
    delays.add_many(np.array([1.0, 2.0]), np.array([[1.0], [1.0]]))
    delays.add_many(np.array([3.0, 4.0]), np.array([[1.0], [1.0]]))
    assert delays.n == 3
    assert delays.shape(0, 1.0, 10)[[2, 3, 4]] == pytest.approx([1 / 3] * 3)  # 1 s dropped out
    delays.add_many(np.arange(5.0, 10.0), np.ones((5, 1)))  # more than it holds at once: the last 3
    assert delays.n == 3 and delays.shape(0, 1.0, 10)[[7, 8, 9]] == pytest.approx([1 / 3] * 3)


def test_the_window_the_allocator_reads_does_not_depend_on_the_delays():
    """What the allocator provisions on (the window, as asked) is the same whatever the
    delays; with none learned the forecast as done is the forecast as asked."""
    now_s = 60
    history = history_at(_log(20, until_s=now_s), now_s)
    timed = Lifecycle().update(history).predict(30)
    for stats in history.live.stats.values():
        stats.prefill_delays, stats.prompt_delays = SizedDelays(2), SizedDelays(2)
    untimed = Lifecycle().update(history).predict(30)
    for target in ("prefill_miss_tokens", "prefill_engine_s"):
        assert np.allclose(timed.asked[target], untimed.asked[target])
        assert np.allclose(untimed.mean[target], untimed.asked[target])
        assert not np.allclose(timed.mean[target], timed.asked[target])
        assert [timed.window_mean(target, h) for h in (4, 9, 29)] == pytest.approx([untimed.window_mean(target, h) for h in (4, 9, 29)])
