"""The evaluator (one predicted finish time per arrangement, the best taken) and what it reads
from the forecaster: the live trajectories' work left (pure: no bus, no clock)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import polars as pl
import pytest

from actors.allocator.capacity import CapacityModel
from actors.allocator.demand import ORACLE_STAGE_WINDOW_S, RecordedDemand
from actors.allocator.evaluator import Inputs, evaluate, prefill_latency, return_engine_s, tpot
from actors.allocator.policy import CONFIRM_DECISIONS, Split
from actors.allocator.side_share import SideShare
from actors.allocator.state import Demand
from actors.config import AllocatorSection, EngineSection, LayoutSection
from bus_schemas.control import Role
from forecasting.empirical import Empirical
from forecasting.live import DEC, POOLED, stage_durations
from forecasting.remaining import exposure_mean, remaining, turns_after
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
    left = remaining(history_at(log, now_s).live, now_s)
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
    left = remaining(history_at(log, 1).live, 1)  # prompts queued, nothing decoded yet
    assert left.turns > 0 and left.mean_s == 0.0


def test_a_prior_log_times_the_work_left_before_the_run_has_timed_a_turn():
    """Learned from an earlier run's log, the forecaster prices the prompts of a step's start
    at once (turns left and their stage times), and holds none of that run's trajectories."""
    prior = synthetic_log(trajectories=300, seed=3, spread_s=120.0, max_turns=6, min_turns=6)
    log = synthetic_log(trajectories=20, seed=1, spread_s=1.0)
    live = history_at(log, 1, prior=prior).live
    left = remaining(live, 1)
    assert remaining(history_at(log, 1).live, 1).mean_s == 0.0  # without it: nothing timed yet
    assert left.mean_s > 0 and all(s > 0 for s in left.stage_s[:2])
    assert live.live_count() == int(log.filter(pl.col("at_s") < 1)["trajectory_id"].n_unique())
    assert 5.0 < left.turns / live.live_count() <= 6.5  # the prior's 6 turns each, none done yet
    appends = [live.stats[f].miss_tokens.mean() for f in live.families]  # an append's, learned from the prior
    assert min(appends) <= left.prefill_tokens <= max(appends) and min(appends) > 0
    with pytest.raises(ValueError, match="before any event"):
        live.learn_from(prior)


def inputs(demand: Demand, current: int = 0, remaining_s: float = 1000.0, **kw) -> Inputs:
    cap = CapacityModel(DEEPSEEK, AllocatorSection().decode_tpot_slack).at(CONTEXT_TOKENS)
    fields = dict(colocated_demand=demand, split_demand=demand, cap=cap, n=4, current=current, util=0.8, drain_s=5.0)
    return Inputs(**{**fields, **kw}, remaining_s=remaining_s)


def busy_demand(prefill_share: float) -> Demand:
    """256 sequences decoding, prefill work filling `prefill_share` of every colocated engine."""
    cap = CapacityModel(DEEPSEEK, AllocatorSection().decode_tpot_slack).at(CONTEXT_TOKENS)
    tokens_s = prefill_share * 4 / cap.prefill_s_at(0.0, colocated=True)
    return Demand(tokens_s, 256.0, CONTEXT_TOKENS, "test", kv_working_set_tokens=2e6, live_trajectories=300.0)


STALLED = replace(busy_demand(0.25), remaining_s=1000.0, turn_stage_s=(10.0, 60.0, 30.0))  # a split pays
CALM = replace(busy_demand(0.0), decode_seqs=8.0, remaining_s=1000.0, turn_stage_s=(60.0, 10.0, 30.0))  # colocation pays


def evaluator_policy(**allocator) -> Split:
    return Split("prorsa", DEEPSEEK, AllocatorSection(decision="evaluator", **allocator), weigh_cost=True)


def decide_confirmed(policy: Split, demand: Demand, roles: list[Role], at_s: float, **per_engine) -> list:
    """CONFIRM_DECISIONS decisions in a row, a second apart; the last one's changes."""
    changes = []
    for i in range(CONFIRM_DECISIONS):
        changes = policy.decide(demand, fleet(roles, at_s + i, **per_engine))
    return changes


def saving_and_cost(demand: Demand) -> tuple[float, float]:
    """The best split's engine-seconds saved per second of work left, and its switch's cost."""
    probe = evaluate(inputs(demand, stage_s=demand.turn_stage_s, remaining_s=1000.0))
    assert probe.best != 0
    return 4 * (1.0 - probe.pace[probe.best] / probe.pace[0]), probe.cost_s[probe.best]


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


def test_the_allocator_changes_arrangement_only_once_staying_loses_for_consecutive_decisions():
    """`allocator.decision = "evaluator"`: a split found best is bought on the CONFIRM_DECISIONS-th
    decision in a row that finds staying not best; a decision that finds staying best in
    between starts the count again."""
    split, long = evaluator_policy(), STALLED
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
    from its decode_started to its decode_done, and an append's size the mean of the appends
    prefilled within it."""
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
    in_window = (pl.col("at_s") >= now_s) & (pl.col("at_s") < now_s + ORACLE_STAGE_WINDOW_S)
    appends = log.filter((pl.col("kind") == "prefill_done") & (pl.col("turn") > 0) & in_window)
    missed = appends["context_tokens"] - appends["cached_prefix_tokens"] + appends["new_tokens"]
    assert math.isclose(recorded.turn_prefill_tokens(now_s), float(missed.mean()), rel_tol=1e-9) and missed.mean() > 0


def role_switches(log: pl.DataFrame, switches: list[tuple[float, str, str]]) -> pl.DataFrame:
    """`log` with role_switched events (at_s, engine, new role) added."""
    rows = pl.DataFrame(
        {
            "event_id": [f"rs{i}" for i in range(len(switches))],
            "kind": ["role_switched"] * len(switches),
            "at_s": [at_s for at_s, _, _ in switches],
            "actor_id": [engine for _, engine, _ in switches],
            "role": [role for _, _, role in switches],
        }
    )
    return pl.concat([log, rows], how="diagonal_relaxed")


def test_the_oracle_knows_the_arrangement_the_recorded_run_timed_its_stages_in():
    """The recorded run starts colocated, splits 1:3 at 100 s (its engines switching over two
    seconds) and colocates again at 300 s: the stage window from now reads the arrangement it
    held longest in the window, the earlier on a tie."""
    log = synthetic_log(trajectories=50, seed=3, spread_s=60.0, max_turns=3, min_turns=3)
    split = [(100.0, "e0", "prefill"), (101.0, "e1", "decode"), (101.0, "e2", "decode"), (102.0, "e3", "decode")]
    back = [(300.0, f"e{i}", "colocated") for i in range(4)]
    recorded = RecordedDemand(role_switches(log, split + back), initial={f"e{i}": "colocated" for i in range(4)})
    assert [recorded.arrangement_at(t) for t in (0.0, 99.0, 100.0, 101.5, 150.0, 300.0)] == [0, 0, 1, 1, 1, 0]
    assert recorded.stages_timed_in(10.0) == 0 and recorded.stages_timed_in(80.0) == 1  # 80 s: 40 s of the window split
    assert recorded.stages_timed_in(200.0) == 1 and recorded.stages_timed_in(280.0) == 0  # 280 s: 40 s back colocated
    assert recorded.stages_timed_in(70.0) == 0  # a tie (30 s each): the earlier
    static = RecordedDemand(log, initial={"e0": "prefill", "e1": "decode", "e2": "decode", "e3": "decode"})
    assert static.stages_timed_in(0.0) == 1  # no switch: the roles it started in


def test_stage_times_timed_in_another_arrangement_are_scaled_from_it():
    """The oracle is colocated while the recorded run it reads was in the best split: the
    recorded stage times are that split's, so they are scaled from it, and the finish times are
    those of the same turns timed in colocation: the arrangement of now moves only the switch
    costs. Read as colocation's own (as if timed there), colocation would look as fast as the
    split."""
    stage_s, left_s = STALLED.turn_stage_s, 1000.0
    timed_colocated = evaluate(inputs(STALLED, current=0, stage_s=stage_s, remaining_s=left_s))
    b = timed_colocated.best
    assert b != 0
    # the same turns timed in b: each stage as the evaluator scales it there, the tool call unchanged
    at = inputs(STALLED, current=0, stage_s=stage_s)
    prefill_s, decode_s, tool_s = stage_s
    split_stage_s = (prefill_s * prefill_latency(at, b) / prefill_latency(at, 0), decode_s * tpot(at, b) / tpot(at, 0), tool_s)
    ratio = sum(split_stage_s) / sum(stage_s)
    assert ratio < 0.9
    timed_split = evaluate(inputs(STALLED, current=0, stage_s=split_stage_s, remaining_s=left_s * ratio, timed_in=b))
    for a in range(4):
        assert math.isclose(timed_split.finish_s[a], timed_colocated.finish_s[a], rel_tol=1e-9), a
    assert timed_split.cost_s == timed_colocated.cost_s  # switches are from the fleet's arrangement
    naive = evaluate(inputs(STALLED, current=0, stage_s=split_stage_s, remaining_s=left_s * ratio))
    assert math.isclose(naive.finish_s[0], left_s * ratio) and naive.finish_s[0] < 0.9 * timed_split.finish_s[0]


def test_a_splits_prefill_side_share_is_read_from_its_engines_counters():
    """Before a split has run, a lockstep decode side is priced as sending every prefill token
    to the prefill side (the router's share elsewhere); once a split has run settled, the share
    its prefill engines computed; colocated stretches and a restarted engine's reset counter
    are not counted."""
    share = SideShare()
    assert share.share(lockstep_decode=True, router_share=0.1) == 1.0
    assert share.share(lockstep_decode=False, router_share=0.1) == 0.1
    colocated = [Role.COLOCATED] * 4
    share.observe(list(fleet(colocated, prefilled_tokens_total=[0, 0, 0, 0]).engines), split_settled=False)
    share.observe(list(fleet(colocated, prefilled_tokens_total=[100, 100, 100, 100]).engines), split_settled=False)
    assert share.share(lockstep_decode=True, router_share=0.1) == 1.0  # colocated: nothing read
    split_roles = [Role.PREFILL] + [Role.DECODE] * 3
    share.observe(list(fleet(split_roles, prefilled_tokens_total=[400, 200, 200, 200]).engines), split_settled=True)
    assert math.isclose(share.share(lockstep_decode=True, router_share=0.1), 300 / 600)
    share.observe(list(fleet(split_roles, prefilled_tokens_total=[50, 200, 200, 200]).engines), split_settled=True)
    assert math.isclose(share.share(lockstep_decode=True, router_share=0.1), 300 / 600)  # a restart: no tokens counted


def test_the_evaluator_prices_a_split_at_the_share_its_prefill_side_computes():
    """The router's own count falls towards 0 while the fleet is colocated; a lockstep split
    priced at it prefills every append on its decode side and stalls, priced at its engines'
    reading it does not."""
    demand = replace(busy_demand(0.25), remote_share=0.0)
    stage_s = (10.0, 60.0, 30.0)
    stalled = evaluate(inputs(demand, stage_s=stage_s, split_demand=demand))
    read = evaluate(inputs(demand, stage_s=stage_s, split_demand=replace(demand, remote_share=1.0)))
    assert all(read.pace[a] < stalled.pace[a] for a in range(1, 4))
    assert stalled.best == 0 and read.best != 0


def test_the_evaluator_leaves_when_staying_loses_though_the_best_split_alternates():
    """Splits within a few percent of each other trade places from one decision to the next;
    the fleet still leaves colocation on the CONFIRM_DECISIONS-th decision, for the last best."""
    split = evaluator_policy()
    decode_heavy = replace(busy_demand(0.1), decode_seqs=1024.0, remaining_s=1000.0, turn_stage_s=(5.0, 90.0, 5.0))
    even = replace(decode_heavy, turn_stage_s=(50.0, 50.0, 0.0))
    bests = [evaluate(inputs(d, stage_s=d.turn_stage_s)).best for d in (decode_heavy, even)]
    assert 0 not in bests and bests[0] != bests[1], bests
    demands = [decode_heavy, even] * CONFIRM_DECISIONS
    for i, demand in enumerate(demands[: CONFIRM_DECISIONS - 1]):
        assert split.decide(demand, fleet([Role.COLOCATED] * 4, 100.0 + i)) == [], split.last_reason
    changes = split.decide(demands[CONFIRM_DECISIONS - 1], fleet([Role.COLOCATED] * 4, 110.0))
    assert sum(c.role is Role.PREFILL for c in changes) == bests[(CONFIRM_DECISIONS - 1) % 2], split.last_reason


def test_the_roles_a_fleet_starts_in_have_no_dwell_under_the_evaluator():
    """At a run's start (epoch 0, roles held since 0) the evaluator may act within the minimum
    dwell; after a switch (epoch 1) the dwell holds it; the rules keep the dwell throughout."""
    evaluator = evaluator_policy(min_dwell_s=10.0)
    started = fleet([Role.COLOCATED] * 4, 3.0)
    evaluator.decide(STALLED, started)
    assert "dwell" not in evaluator.last_reason
    switched = fleet([Role.COLOCATED] * 4, 3.0, epoch=[1] * 4)
    assert evaluator.decide(STALLED, switched) == [] and "dwell" in evaluator.last_reason
    rules = Split("prorsa", DEEPSEEK, AllocatorSection(decision="rules", min_dwell_s=10.0), weigh_cost=True)
    assert rules.decide(STALLED, started) == [] and "dwell" in rules.last_reason


def test_a_stage_mean_counts_the_turns_still_in_it():
    """Stages that start together and end first are the short ones: 5 s after 4,000 decodes of
    exponential length (mean 10 s) started, those ended average about 2.3 s. Counting the live
    ones' 5 s so far as exposure gives back the mean; once the samples kept are a window, the
    ended ones' mean is taken as it is."""
    rng = np.random.default_rng(7)
    durations_s = rng.exponential(10.0, 4000)
    ended = Empirical(5000)
    ended.add_many(durations_s[durations_s < 5.0])
    live_elapsed_s = np.full(int((durations_s >= 5.0).sum()), 5.0)
    assert ended.mean() < 2.6
    assert math.isclose(exposure_mean(ended, live_elapsed_s), 10.0, rel_tol=0.1)
    window = Empirical(100)
    window.add_many(durations_s[durations_s < 5.0])
    assert exposure_mean(window, live_elapsed_s) == window.mean()
    assert exposure_mean(Empirical(), live_elapsed_s) == 0.0  # nothing ended: no estimate


def test_the_work_left_weighs_the_decodes_still_running_early_in_a_step():
    """A step whose trajectories start together: a few seconds in, the turn the work left is
    priced with decodes far longer than the decodes that have ended (uniform 1-16 s)."""
    log = synthetic_log(trajectories=200, seed=5, spread_s=1.0)
    live = history_at(log, 8).live
    left = remaining(live, 8)
    ended_mean_s = stage_durations(live.stats[POOLED], live.stats[POOLED])[DEC].mean()
    assert 0 < 2 * ended_mean_s < left.stage_s[1], (ended_mean_s, left.stage_s)


def test_a_move_must_save_at_least_its_switch_again_net_of_it():
    """The finish times are forecasts: a move whose saving, net of its switch, is less than
    the switch costs is not bought (a forecast that overstates the saving by up to half still
    does not lose); with twice the work left it is."""
    saving_per_s, cost_s = saving_and_cost(STALLED)
    assert saving_per_s > 0

    def bought(remaining_s: float) -> bool:
        return bool(decide_confirmed(evaluator_policy(), replace(STALLED, remaining_s=remaining_s), [Role.COLOCATED] * 4, 100.0))

    assert not bought(1.5 * cost_s / saving_per_s)  # saves 0.5x its cost net
    assert bought(3.0 * cost_s / saving_per_s)  # saves 2x its cost net


def test_colocation_never_splits_a_colocated_fleet_at_the_first_decision():
    """`allocator.colocation = "never"` rules colocation out under the evaluator as under the
    rules: a colocated fleet moves to the best split at its first decision, even where
    staying colocated would be priced faster."""
    idle = replace(busy_demand(0.0), remaining_s=5.0, turn_stage_s=(10.0, 60.0, 30.0))
    assert evaluate(inputs(idle, stage_s=idle.turn_stage_s, remaining_s=5.0)).best == 0  # colocation's, if allowed
    never = evaluator_policy(colocation="never")
    changes = never.decide(idle, fleet([Role.COLOCATED] * 4, 100.0))
    assert len(changes) == 4 and 0 < sum(c.role is Role.PREFILL for c in changes) < 4, never.last_reason
    assert never.last_reason.startswith("split colocated -> ")  # the move, as role_switched events carry it


def test_a_move_that_was_undone_must_save_twice_as_much_the_next_time():
    """A split the evaluator bought and then undid overstated its saving once: the next split
    must save, net of its switch, twice its cost; a fleet that never undid one needs once."""
    saving_per_s, cost_s = saving_and_cost(STALLED)
    again = replace(STALLED, remaining_s=2.5 * cost_s / saving_per_s)  # saves 1.5x its cost net

    def decisions(policy: Split, demand: Demand, roles: list[Role], at_s: float, epoch: int) -> list:
        return decide_confirmed(policy, demand, roles, at_s, epoch=[epoch] * 4, role_since_s=[at_s - 100.0] * 4)

    undid = evaluator_policy()
    split_roles = [c.role for c in decisions(undid, STALLED, [Role.COLOCATED] * 4, 200.0, 0)]
    assert Role.PREFILL in split_roles
    assert decisions(undid, CALM, split_roles, 400.0, 1), undid.last_reason  # back to colocation: the split undone
    assert decisions(undid, again, [Role.COLOCATED] * 4, 1000.0, 2) == [] and "less than" in undid.last_reason
    assert decisions(evaluator_policy(), again, [Role.COLOCATED] * 4, 1000.0, 0)


def test_after_a_change_the_evaluator_counts_its_decisions_again():
    """Decisions that found another best before a change do not count towards leaving the
    arrangement the change made: right after going back to colocation, a split found best
    waits for CONFIRM_DECISIONS decisions again."""
    policy = evaluator_policy(min_dwell_s=0.0)
    roles = [c.role for c in decide_confirmed(policy, STALLED, [Role.COLOCATED] * 4, 100.0)]
    assert Role.PREFILL in roles
    back = decide_confirmed(policy, CALM, roles, 200.0, epoch=[1] * 4)
    assert back and all(c.role is Role.COLOCATED for c in back), policy.last_reason
    assert policy.decide(STALLED, fleet([Role.COLOCATED] * 4, 300.0, epoch=[2] * 4)) == []
    assert f"1 of {CONFIRM_DECISIONS}" in policy.last_reason


def test_a_cheap_move_with_a_dear_way_back_must_save_the_way_back():
    """Growing a 1:3 split to 2:2 costs a drain, shrinking it back recomputes what the leaving
    prefill engine held: a grow whose net saving covers its own switch but not the way back
    is not bought; with enough work left it is."""
    split_roles = [Role.PREFILL, Role.DECODE, Role.DECODE, Role.DECODE]
    probe_inputs = inputs(STALLED, current=1, stage_s=STALLED.turn_stage_s, remaining_s=1000.0)
    probe = evaluate(probe_inputs)
    assert probe.best == 2
    forward_s, back_s = probe.cost_s[2], return_engine_s(probe_inputs, 2)
    assert back_s > 4 * forward_s  # a shrink recomputes, a grow drains
    saving_per_s = probe.gain_engine_s(4) / 1000.0

    def bought(remaining_s: float) -> bool:
        demand = replace(STALLED, remaining_s=remaining_s)
        since = {"role_since_s": [0.0] * 4, "epoch": [1] * 4}
        return bool(decide_confirmed(evaluator_policy(), demand, split_roles, 500.0, **since))

    assert not bought(0.5 * (forward_s + back_s) / saving_per_s)  # pays its switch, not the way back
    assert bought(1.5 * back_s / saving_per_s)


def test_the_work_left_is_its_live_trajectories_mean_demand_by_littles_law():
    """Each of 100 live trajectories spends 60 of its 100 s turn decoding and sends 2,000
    prefill tokens a turn: 60 decode at once, 2,000 prefill tokens a second, no backlog."""
    demand = replace(
        busy_demand(0.5),
        live_trajectories=100.0,
        turn_stage_s=(10.0, 60.0, 30.0),
        turn_prefill_tokens=2000.0,
        prefill_backlog_tokens_per_s=5e4,
    )
    later = demand.over_work_left()
    assert later is not None
    assert math.isclose(later.decode_seqs, 60.0) and math.isclose(later.prefill_tokens_per_s, 2000.0)
    assert later.prefill_backlog_tokens_per_s == 0.0
    assert replace(demand, turn_prefill_tokens=0.0).over_work_left() is None  # a prefill's size not known
    assert replace(demand, turn_stage_s=(0.0, 0.0, 0.0)).over_work_left() is None  # a turn not timed


def test_the_horizon_prices_its_own_seconds_and_the_work_after_it_its_mean_demand():
    """A step's opening: the horizon's demand (CALM) pays for colocation, the work after it
    (STALLED) for a split. With 1,000 s left the split finishes first; with no more work than
    the horizon, colocation does."""
    calm, stalled = replace(CALM, turn_stage_s=STALLED.turn_stage_s), STALLED

    def best(remaining_s: float) -> int:
        probe = inputs(calm, stage_s=stalled.turn_stage_s, remaining_s=remaining_s, later=(stalled, stalled), horizon_s=10.0)
        return evaluate(probe).best

    assert evaluate(inputs(calm, stage_s=stalled.turn_stage_s, remaining_s=1000.0)).best == 0  # the horizon alone
    assert best(1000.0) != 0
    assert best(10.0) == 0
