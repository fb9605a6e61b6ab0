"""The lifecycle model's numerics against their plain definitions: the phase chain walked
as spectra equals a convolution per stage, the residual end masses summed per bucket equal
the per-trajectory sum, the compound Poisson quantiles match a simulation, and the point
forecast of prefill new tokens is their median."""

from __future__ import annotations

import numpy as np
import pytest

from bus_schemas.eventlog import events_frame
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from forecasting.compound import compound_poisson_quantiles
from forecasting.core import CoreConfig, ForecastCore
from forecasting.empirical import Empirical
from forecasting.live import DEC, PRE, TOOL
from forecasting.models import QUANTILES, FitError, History
from forecasting.models.chain import PhaseChain, truncated
from forecasting.models.lifecycle import Lifecycle
from forecasting.synthetic import synthetic_log
from tests.forecast_helpers import history_at

SLOTS, CYCLES = 40, 5


def _walk_by_convolution(phase: int, ends_by_cycle: np.ndarray, pmfs: np.ndarray, first_pre: np.ndarray | None = None) -> np.ndarray:
    """(3, slots) ends of PRE, DEC and TOOL: one convolution per stage of the chain."""
    out = np.zeros((3, SLOTS))
    kernel, m, stage = np.eye(1, SLOTS)[0], 0, phase
    entered_pre = False
    while m < len(ends_by_cycle):
        out[stage] += truncated(ends_by_cycle[m], kernel)
        m += stage == DEC
        stage = (stage + 1) % 3
        duration = first_pre if stage == PRE and first_pre is not None and not entered_pre else pmfs[stage]
        entered_pre |= stage == PRE
        kernel = truncated(kernel, duration)
    return out


@pytest.fixture
def pmfs() -> np.ndarray:
    rng = np.random.default_rng(3)
    raw = rng.gamma(2.0, 1.0, (3, SLOTS)) * np.exp(-np.arange(SLOTS) / rng.uniform(3, 15, (3, 1)))
    return 0.97 * raw / raw.sum(axis=1, keepdims=True)  # some mass beyond the horizon


@pytest.mark.parametrize("phase", [PRE, DEC, TOOL])
def test_the_chain_as_spectra_equals_a_convolution_per_stage(pmfs, phase):
    ends = np.random.default_rng(phase).uniform(0, 5, (CYCLES + 1, SLOTS))
    chain = PhaseChain(pmfs, CYCLES)
    np.testing.assert_allclose(chain.inverse(chain.spectrum(phase, ends)), _walk_by_convolution(phase, ends, pmfs), rtol=1e-9, atol=1e-12)


def test_a_start_is_an_arrival_then_a_chain_from_its_prompt_prefill(pmfs):
    """A burst walks from TOOL with its first PRE the prompt's: the same as its arrival plus
    a chain from PRE of the arrivals convolved with the prompt's PRE."""
    starts = np.random.default_rng(7).uniform(0, 3, SLOTS)
    weights = np.cumprod(np.r_[1.0, np.full(CYCLES, 0.8)])
    first_pre = np.roll(pmfs[PRE], 3)
    chain = PhaseChain(pmfs, CYCLES)
    via_pre = chain.inverse(chain.spectrum(PRE, weights[:, None] * truncated(starts, first_pre)[None, :]))
    via_pre[TOOL] += starts
    expected = _walk_by_convolution(TOOL, weights[:, None] * starts[None, :], pmfs, first_pre)
    np.testing.assert_allclose(via_pre, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("censored", [False, True])
def test_residual_sums_are_the_per_trajectory_residual_masses_summed(censored):
    rng = np.random.default_rng(11)
    stage = Empirical()
    stage.add_many(rng.lognormal(0.0, 1.0, 300))
    bucket = rng.integers(0, 60, 500)
    weights = rng.uniform(0, 1, (4, 500))
    step_s = 0.25
    if censored:  # a stage still running counts at risk: one grid for everyone, as the model does
        elapsed_s = bucket * step_s + rng.uniform(0, step_s, 500)
        got = stage.residual_sums(bucket, weights, step_s, SLOTS, elapsed_s)
        surv = stage.survival(step_s * np.arange(bucket.max() + SLOTS + 1), elapsed_s)
        per_trajectory = np.array([(surv[b : b + SLOTS] - surv[b + 1 : b + SLOTS + 1]) / surv[b] for b in bucket])
    else:
        got = stage.residual_sums(bucket, weights, step_s, SLOTS)
        per_trajectory = stage.residual_mass(bucket * step_s, step_s, SLOTS)
    np.testing.assert_allclose(got, weights @ per_trajectory, rtol=1e-10, atol=1e-13)


def test_stages_still_running_past_every_completed_one_are_not_ended_by_the_early_finishers():
    """Early in a first step only the short decodes have finished: a tail of their mean would
    end the long ones still running within seconds. With the running ones' time counted (the
    censored mean), the tail has the true mean of an exponential stage seen part-way."""
    rng = np.random.default_rng(3)
    true_mean_s, seen_at_s = 50.0, 10.0
    durations = rng.exponential(true_mean_s, 5000)
    stage = Empirical(max_samples=5000)
    stage.add_many(durations[durations <= seen_at_s])  # about a fifth finished
    running = np.full(int((durations > seen_at_s).sum()), seen_at_s)
    assert stage.values().max() < seen_at_s and stage.mean() < 6.0  # what finished is short
    assert stage._tail_mean_s(running) == pytest.approx(true_mean_s, rel=0.08)
    ends_within_10_s = 1.0 - stage.survival(np.array([seen_at_s + 10.0]), running)[0] / stage.survival(np.array([seen_at_s]), running)[0]
    assert ends_within_10_s == pytest.approx(1.0 - np.exp(-10.0 / true_mean_s), abs=0.03)  # memoryless: about 18%
    uncensored = 1.0 - stage.survival(np.array([seen_at_s + 10.0]))[0] / stage.survival(np.array([seen_at_s]))[0]
    assert uncensored > 0.8  # the samples' own mean: nearly all would end within 10 s


def test_a_first_step_s_long_decodes_are_forecast_to_keep_running():
    """The DeepSeek math case: every trajectory starts at once and decodes for an exponential
    100 s; 10 s in, only the short decodes have finished. The forecast of decode sequences
    20 s ahead keeps the running ones (about e^(-20/100) of them), not the early finishers' fate.
    (Single-turn math; a few two-turn swe trajectories give the model a completed tool call.)"""
    rng = np.random.default_rng(8)
    events = []

    def add(kind, at_s, i, family, turn=0, **fields):
        base = dict(trajectory_id=f"{family}{i}", task_family=family, actor_id="synthetic", step=0, policy_version=0)
        events.append(LifecycleEvent(event_id=f"{family}{i}-{len(events)}", kind=kind, at_s=at_s, turn=turn, **base, **fields))

    def turn(i, family, turn, start_s, duration_s):
        add(EventKind.PREFILL_QUEUED, start_s, i, family, turn, new_tokens=300, context_tokens=0)
        add(EventKind.PREFILL_DONE, start_s + 0.5, i, family, turn, new_tokens=300, context_tokens=0, cached_prefix_tokens=0)
        add(EventKind.DECODE_STARTED, start_s + 0.5, i, family, turn, new_tokens=300, context_tokens=0, cached_prefix_tokens=0)
        add(
            EventKind.DECODE_DONE,
            start_s + 0.5 + duration_s,
            i,
            family,
            turn,
            new_tokens=300,
            context_tokens=0,
            generated_tokens=int(20 * duration_s) + 1,
        )
        return start_s + 0.5 + duration_s

    for i, duration_s in enumerate(rng.exponential(100.0, 400).tolist()):
        add(EventKind.STARTED, 0.0, i, "math", new_tokens=300)
        add(EventKind.FINISHED, turn(i, "math", 0, 0.0, duration_s), i, "math")
    for i in range(5):  # decode 1 s, a 1 s tool call, then a second turn still decoding at the cut
        add(EventKind.STARTED, 0.0, i, "swe", new_tokens=300)
        end_s = turn(i, "swe", 0, 0.0, 1.0)
        add(EventKind.TOOL_STARTED, end_s, i, "swe")
        add(EventKind.TOOL_DONE, end_s + 1.0, i, "swe", duration_s=1.0, new_tokens=50)
        turn(i, "swe", 1, end_s + 1.0, 500.0)
    log = events_frame(sorted(events, key=lambda e: (e.at_s, e.event_id)))
    core = ForecastCore(CoreConfig(models=("naive",)))
    at_s = log["at_s"].to_numpy()
    for until_s in range(1, 11):
        core.tick(log.filter((at_s >= until_s - 1) & (at_s < until_s)), float(until_s))
    math_done = (log["kind"] == "decode_done") & (log["task_family"] == "math") & (log["at_s"] < 10.0)
    running = 400 - int(math_done.sum())
    assert 330 < running < 390  # about a tenth finished, all of them short
    history = History(1.0, 10.0, {t: s.view() for t, s in core.series.items()}, core.live)
    ahead_20_s = Lifecycle().update(history).predict(20).mean["decode_active_seqs"][19]
    assert ahead_20_s == pytest.approx(running * np.exp(-20.0 / 100.0) + 5, rel=0.15)


def test_compound_poisson_quantiles_match_a_simulation():
    rng = np.random.default_rng(5)
    samples = [rng.lognormal(np.log(400), 1.2, 2000), rng.normal(3000, 500, 500).clip(1)]
    rates = np.array([[0.05, 0.9, 3.0, 8.0, 0.0], [0.0, 0.0, 0.5, 2.0, 0.0]])
    levels = (0.1, 0.5, 0.9)
    got = compound_poisson_quantiles(rates, samples, levels)
    draws = 100_000
    totals = np.zeros((draws, rates.shape[1]))
    for rate, sizes in zip(rates, samples):
        counts = rng.poisson(rate, (draws, len(rate)))
        picks = sizes[rng.integers(0, len(sizes), counts.sum())]
        totals += np.bincount(np.repeat(np.arange(counts.size), counts.ravel()), picks, counts.size).reshape(counts.shape)
    expected = np.quantile(totals, levels, axis=0)
    assert got[:, 0].tolist() == [0.0, 0.0, 0.0]  # P(no arrival) = e^-0.05 > 0.9
    assert got[:, -1].tolist() == [0.0, 0.0, 0.0]
    np.testing.assert_allclose(got[:, 2:4], expected[:, 2:4], rtol=0.03, atol=60)
    assert got[1, 1] == pytest.approx(expected[1, 1], rel=0.03, abs=60)  # past P(none) = e^-0.9 < 0.5


def test_the_point_forecast_of_a_flow_is_its_median_while_its_mean_stays_the_mean():
    core = ForecastCore(CoreConfig(models=("naive",)))
    events = synthetic_log(trajectories=40, seed=1)
    at_s = events["at_s"].to_numpy()
    for until_s in range(1, 61):
        core.tick(events.filter((at_s >= until_s - 1) & (at_s < until_s)), float(until_s))
    history = History(1.0, 60.0, {t: s.view() for t, s in core.series.items()}, core.live)
    median, mean = Lifecycle().update(history).predict(10), Lifecycle(median_flows=False).update(history).predict(10)
    for flow in ("prefill_new_tokens", "prefill_miss_tokens", "prefill_engine_s", "decode_tokens"):
        np.testing.assert_array_equal(median.point_forecast(flow), median.quantiles[flow][QUANTILES.index(0.5)])
        np.testing.assert_array_equal(median.quantiles[flow], mean.quantiles[flow])
        np.testing.assert_array_equal(median.mean[flow], mean.mean[flow])  # demand consumers still get the mean
        np.testing.assert_array_equal(mean.point_forecast(flow), mean.mean[flow])
    new = "prefill_new_tokens"
    assert mean.mean[new].sum() > median.point_forecast(new).sum() > 0  # sizes are skewed: the median is lower
    np.testing.assert_array_equal(median.point_forecast("decode_active_seqs"), median.mean["decode_active_seqs"])  # a level


def test_the_turn_prior_counts_the_live_trajectories_turns_as_survived():
    """Early in a run only short trajectories have finished. The prior hazard (deaths per turn
    at risk) counts the live ones' turns, so trajectories are not all ended one turn past the
    live ones; with none live it is 1 / the finished ones' mean turns, as before."""
    from forecasting.empirical import TurnHazard

    hazard = TurnHazard()
    hazard.add_finished_many(np.array([0, 0]))  # two one-turn trajectories finished
    live = np.full(100, 5)  # a hundred at turn 5
    c = hazard.continue_prob(live)
    assert c[10] > 0.9  # no data past turn 5: the prior, 2 deaths in 2 + 500 turns at risk
    assert c[10] == pytest.approx(1 - 2 / 502, abs=1e-9)
    assert c[3] > 0.97  # 100 survived turn 3, none ended there
    assert 0.0 < c[0] < 1.0  # two of 102 ended at turn 0
    finished_only = TurnHazard()
    finished_only.add_finished_many(np.full(10, 3))  # ten four-turn trajectories
    assert finished_only.continue_prob(np.zeros(0, np.int64))[20] == pytest.approx(1 - 10 / 40)


def _burst(prefilled_at_s: list[float], decode_started_at_s: list[float | None], new_tokens: int = 300):
    """A step-0 burst of `new_tokens` prompts queued at t = 0: trajectory i prefilled at
    prefilled_at_s[i], decoding from decode_started_at_s[i] (None: not yet); no decode or
    tool call has ended."""
    events = []
    for i, (done_s, dec_s) in enumerate(zip(prefilled_at_s, decode_started_at_s)):
        base = dict(trajectory_id=f"t{i}", task_family="swe", actor_id="synthetic", step=0, policy_version=0, turn=0)
        events.append(LifecycleEvent(event_id=f"t{i}-0", kind=EventKind.STARTED, at_s=0.0, new_tokens=new_tokens, **base))
        events.append(
            LifecycleEvent(event_id=f"t{i}-1", kind=EventKind.PREFILL_QUEUED, at_s=0.0, new_tokens=new_tokens, context_tokens=0, **base)
        )
        events.append(
            LifecycleEvent(
                event_id=f"t{i}-2",
                kind=EventKind.PREFILL_DONE,
                at_s=done_s,
                new_tokens=new_tokens,
                context_tokens=0,
                cached_prefix_tokens=0,
                **base,
            )
        )
        if dec_s is not None:
            events.append(
                LifecycleEvent(
                    event_id=f"t{i}-3",
                    kind=EventKind.DECODE_STARTED,
                    at_s=dec_s,
                    new_tokens=new_tokens,
                    context_tokens=0,
                    cached_prefix_tokens=0,
                    **base,
                )
            )
    return events_frame(sorted(events, key=lambda e: (e.at_s, e.event_id)))


def test_a_runs_opening_burst_starts_decoding_when_the_prefill_queue_has_drained():
    """A colocated engine runs its prefills first: 400 prompts queued at t = 0 are prefilled
    one every 50 ms, and none starts decoding until the last is done (20 s). At 5 s no phase
    has ended; the queue has drained 99 prompts in 5 s, so the other 301 take 15.2 s more,
    and then all 400 decode (none has been seen to end). Before, no forecast until a
    prefill, a decode and a tool call had each ended: the naive one, 0 decoding throughout."""
    n = 400
    log = _burst([0.05 * (i + 1) for i in range(n)], [None] * n)
    history = history_at(log, 5)
    decoding = Lifecycle().update(history).predict(30).mean["decode_active_seqs"]
    assert decoding[:15].tolist() == [0.0] * 15  # still draining, 10 s ahead included
    assert decoding[15:].tolist() == [float(n)] * 15  # from the bin the queue empties in (15-16 s ahead): every one
    model = Lifecycle().update(history)
    with pytest.raises(FitError, match="no prefill finished"):  # nothing drained yet: no rate to read
        model.update(history_at(_burst([9.5] * n, [None] * n), 5))
    with pytest.raises(FitError, match="predict before update"):  # not from the history before
        model.predict(30)
    with pytest.raises(FitError, match="no prefill finished"):  # a prompt of no size: no rate either
        Lifecycle().update(history_at(_burst([0.05 * (i + 1) for i in range(n)], [None] * n, new_tokens=0), 5))


def test_decodes_not_yet_seen_to_end_are_forecast_to_keep_running():
    """A split's opening: each prompt starts decoding as soon as it is prefilled, one every
    50 ms; at 5 s 99 decode and none has ended. The prompts still queued start decoding
    within the horizon (their prefill queue's learned wait) and no decode ends: the forecast
    rises and never falls."""
    n = 400
    log = _burst([0.05 * (i + 1) for i in range(n)], [0.05 * (i + 1) for i in range(n)])
    decoding = Lifecycle().update(history_at(log, 5)).predict(30).mean["decode_active_seqs"]
    assert decoding[0] >= 99
    assert np.all(np.diff(decoding) >= -1e-9)  # none ends
    assert 250 < decoding[19] <= n  # most of the 301 queued have started 20 s ahead
