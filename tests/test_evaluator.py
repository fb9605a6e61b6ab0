"""The evaluator (one predicted finish time per arrangement, the best taken) and what it reads
from the forecaster: the live trajectories' work left (pure: no bus, no clock)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import polars as pl

from actors.allocator.capacity import CapacityModel
from actors.allocator.demand import ORACLE_STAGE_WINDOW_S, RecordedDemand
from actors.allocator.evaluator import Inputs, evaluate
from actors.allocator.policy import CONFIRM_DECISIONS, Split
from actors.allocator.state import Demand
from actors.config import AllocatorSection, EngineSection, LayoutSection
from bus_schemas.control import Role
from forecasting.remaining import remaining, turns_after
from forecasting.synthetic import synthetic_log
from tests.forecast_helpers import history_at
from tests.test_allocator_policy import fleet

DEEPSEEK = EngineSection(count=4, preset="h200-deepseek-v3-fp8", layout=LayoutSection(dp=8, ep=8))
CONTEXT_TOKENS = 20_000.0


def test_turns_after_a_turn_follow_the_continuation_probabilities():
    after = turns_after(np.full(200, 0.75))
    assert math.isclose(after[0], 0.75 / 0.25, rel_tol=1e-9)  # geometric: c / (1 - c) far from the last tracked turn
    assert after[199] == 0.75 and after[200] == 0.0  # none after the last one tracked
    assert list(turns_after(np.array([1.0, 1.0, 0.0]))) == [2.0, 1.0, 0.0, 0.0]  # two more, then it ends


def test_remaining_work_matches_what_the_log_goes_on_to_do():
    """Trajectories of exactly 6 turns: once many have finished, the hazard knows nearly every
    one ends after its sixth, so the turns left of the live ones are about what the log shows
    them doing after now (a little more: the hazard's prior keeps a chance of going on past the
    longest turn seen; one turn off per trajectory would be 30% off), and their seconds left
    about the time to their last event."""
    log = synthetic_log(trajectories=300, seed=3, spread_s=120.0, max_turns=6, min_turns=6)
    now_s = 90
    left = remaining(history_at(log, now_s).live)
    spans = log.group_by("trajectory_id").agg(pl.col("at_s").min().alias("first_s"), pl.col("at_s").max().alias("last_s"))
    live = spans.filter((pl.col("first_s") < now_s) & (pl.col("last_s") >= now_s))
    live_ids = live["trajectory_id"].implode()
    ahead = log.filter((pl.col("kind") == "decode_done") & (pl.col("at_s") >= now_s) & pl.col("trajectory_id").is_in(live_ids))
    assert live.height > 50 and spans.filter(pl.col("last_s") < now_s).height > 50  # many live, many finished
    assert ahead.height <= left.turns < 1.2 * ahead.height, (left.turns, ahead.height)
    true_mean_s = float((live["last_s"] - now_s).mean())
    assert 0.5 * true_mean_s < left.mean_s < 1.5 * true_mean_s, (left.mean_s, true_mean_s)
    assert all(s > 0 for s in left.stage_s)


def test_no_remaining_seconds_before_a_decode_has_been_timed():
    log = synthetic_log(trajectories=20, seed=1, spread_s=1.0)
    left = remaining(history_at(log, 1).live)  # prompts queued, nothing decoded yet
    assert left.turns > 0 and left.mean_s == 0.0


def inputs(demand: Demand, current: int = 0, remaining_s: float = 1000.0, **kw) -> Inputs:
    cap = CapacityModel(DEEPSEEK, AllocatorSection().decode_tpot_slack).at(CONTEXT_TOKENS)
    fields = dict(colocated_demand=demand, split_demand=demand, cap=cap, n=4, current=current, util=0.8, drain_s=5.0)
    return Inputs(**fields, remaining_s=remaining_s, **kw)


def busy_demand(prefill_share: float) -> Demand:
    """256 sequences decoding, prefill work filling `prefill_share` of every colocated engine."""
    cap = CapacityModel(DEEPSEEK, AllocatorSection().decode_tpot_slack).at(CONTEXT_TOKENS)
    tokens_s = prefill_share * 4 / cap.prefill_s_at(0.0, colocated=True)
    return Demand(tokens_s, 256.0, CONTEXT_TOKENS, "test", kv_working_set_tokens=2e6, live_trajectories=300.0)


def test_a_lockstep_stalled_fleet_splits_when_enough_work_is_left_to_pay_for_it():
    """DP8 lockstep: with a quarter of each colocated engine prefilling, decodes run (3/4)^8 of
    the time; a split's decode engines never stall. Over a long remainder the split finishes
    first despite its switch; over a short one the switch is not worth it."""
    stage_s = (10.0, 60.0, 30.0)
    long = evaluate(inputs(busy_demand(0.25), remaining_s=1000.0, stage_s=stage_s))
    assert long.best != 0 and long.finish_s[long.best] < long.finish_s[0]
    assert long.pace[long.best] < long.pace[0]
    short = evaluate(inputs(busy_demand(0.25), remaining_s=5.0, stage_s=stage_s))
    assert short.best == 0  # 5 s left cannot pay for drains and relocation
    assert short.cost_s[1] > 0 and short.cost_s[0] == 0.0


def test_with_headroom_everywhere_and_no_turn_timings_nothing_is_worth_a_switch():
    """The load model's pace is max(1, utilisation): headroom is not a saving."""
    idle = Demand(1.0, 4.0, CONTEXT_TOKENS, "test", kv_working_set_tokens=1e5, live_trajectories=8.0)
    evaluation = evaluate(inputs(idle, remaining_s=10_000.0))
    assert evaluation.pace == [1.0, 1.0, 1.0, 1.0]
    assert evaluation.best == 0


def test_a_split_whose_decode_side_cannot_hold_the_working_set_is_no_candidate():
    """Without queueing admission a decode side that cannot hold the working set preempts and
    recomputes without end: every split is ruled out, whatever its pace."""
    engines = EngineSection(count=4, preset="h200-deepseek-v3-fp8", layout=LayoutSection(dp=8, ep=8), admission="vllm")
    cap = CapacityModel(engines, AllocatorSection().decode_tpot_slack).at(CONTEXT_TOKENS)
    demand = replace(busy_demand(0.25), kv_working_set_tokens=4 * cap.colocated_kv_tokens)
    evaluation = evaluate(replace(inputs(demand, stage_s=(10.0, 60.0, 30.0)), cap=cap))
    assert evaluation.best == 0 and all(math.isinf(f) for f in evaluation.finish_s[1:])


def test_a_saturated_fleet_takes_the_arrangement_that_turns_over_most_and_keeps_a_tie():
    demand = busy_demand(0.25)
    rates = [1000.0, 1500.0, 1200.0, 0.0]  # decode tokens per second; 3:1 not rated
    evaluation = evaluate(inputs(demand, current=2, rates=rates))
    assert evaluation.best == 1 and math.isinf(evaluation.finish_s[3])
    assert math.isclose(evaluation.finish_s[2], 1000.0)  # staying: the work left at today's pace
    assert evaluation.gain_engine_s(4) > 0
    tie = evaluate(inputs(demand, current=2, rates=[1000.0, 1200.0, 1200.0, 1200.0]))
    assert tie.best == 2  # no faster arrangement: no switch


def test_the_allocator_changes_arrangement_only_once_the_same_best_holds_for_consecutive_decisions():
    """`allocator.decision = "evaluator"`: a split found best is bought on the CONFIRM_DECISIONS-th
    decision in a row that finds it; a decision that finds staying best in between starts the
    count again."""
    split = Split("prorsa", DEEPSEEK, AllocatorSection(decision="evaluator"), weigh_cost=True)
    long = replace(busy_demand(0.25), remaining_s=1000.0, turn_stage_s=(10.0, 60.0, 30.0))
    short = replace(long, remaining_s=5.0)
    now_s = 100.0
    for demand in [long] * (CONFIRM_DECISIONS - 1) + [short] + [long] * (CONFIRM_DECISIONS - 1):
        assert split.decide(demand, fleet([Role.COLOCATED] * 4, now_s)) == [], split.last_reason
        now_s += 10.0
    assert f"{CONFIRM_DECISIONS - 1} of {CONFIRM_DECISIONS}" in split.last_reason
    changes = split.decide(long, fleet([Role.COLOCATED] * 4, now_s))
    prefill = sum(c.role is Role.PREFILL for c in changes)
    assert len(changes) == 4 and 0 < prefill < 4, split.last_reason
    assert split.last_reason.startswith("split")


def test_the_oracle_reads_the_work_left_and_the_turn_stages_from_the_recorded_log():
    """The oracle's remaining_s is the true mean time to the live trajectories' last event; its
    stage times are the means of the stages that start within the window, one turn's decode
    from its decode_started to its decode_done."""
    log = synthetic_log(trajectories=300, seed=3, spread_s=120.0, max_turns=6, min_turns=6)
    recorded, now_s = RecordedDemand(log), 90.0
    spans = log.group_by("trajectory_id").agg(pl.col("at_s").min().alias("first_s"), pl.col("at_s").max().alias("last_s"))
    live = spans.filter((pl.col("first_s") <= now_s) & (pl.col("last_s") > now_s))
    assert math.isclose(recorded.remaining_s(now_s), float((live["last_s"] - now_s).mean()), rel_tol=1e-9)
    assert recorded.remaining_s(float(spans["last_s"].max()) + 1.0) == 0.0  # nothing live after the run
    keys = ["trajectory_id", "turn"]
    starts = log.filter(pl.col("kind") == "decode_started").group_by(keys).agg(pl.col("at_s").min().alias("s"))
    ends = log.filter(pl.col("kind") == "decode_done").group_by(keys).agg(pl.col("at_s").min().alias("e"))
    window = starts.join(ends, on=keys).filter((pl.col("s") >= now_s) & (pl.col("s") < now_s + ORACLE_STAGE_WINDOW_S))
    prefill_s, decode_s, tool_s = recorded.turn_stage_s(now_s)
    assert math.isclose(decode_s, float((window["e"] - window["s"]).mean()), rel_tol=1e-9)
    assert prefill_s > 0 and tool_s > 0
