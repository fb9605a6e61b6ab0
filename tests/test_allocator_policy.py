"""Allocation policy cores and the turn router on hand-built fleets (pure: no bus, no clock)."""

from __future__ import annotations

from dataclasses import replace

import msgspec
import pytest

from actors.allocator.capacity import CapacityModel
from actors.allocator.demand import from_forecast, from_queues
from actors.allocator.loads import stage_loads
from actors.allocator.policy import Fixed, Split
from actors.allocator.state import DEFAULT_CONTEXT_TOKENS, Demand, EngineState, Fleet
from actors.config import AllocatorSection, EngineSection, LayoutSection
from actors.environment.router import Router
from bus_schemas.control import Role
from bus_schemas.forecast import DemandForecast, TargetForecast
from bus_schemas.status import EngineStatus

P, D, C = Role.PREFILL, Role.DECODE, Role.COLOCATED
ENGINES = EngineSection(count=8, preset="h200-qwen3-30b-a3b", layout=LayoutSection(dp=4, ep=4))


def fleet(roles: list[Role], now_s: float = 100.0, **per_engine) -> Fleet:
    engines = []
    for i, role in enumerate(roles):
        fields = {k: v[i] for k, v in per_engine.items()}
        engines.append(EngineState(engine_id=f"e{i}", role=role, **fields))
    return Fleet(now_s=now_s, engines=tuple(engines))


def split(name="prorsa", weigh_cost=True, **allocator) -> Split:
    thresholds = {
        "colocation": "thresholds",
        "disaggregate_above_engines": 0.5,
        "colocate_below_engines": 0.25,
    }  # the mechanism, not the defaults
    return Split(name, ENGINES, AllocatorSection(**{"decision": "rules", **thresholds, **allocator}), weigh_cost=weigh_cost)


def demand_for(loads: tuple[float, float], context_tokens: float = 4096.0) -> Demand:
    """A demand whose stage loads (in engines) are `loads`."""
    cap = CapacityModel(ENGINES, AllocatorSection().decode_tpot_slack).at(context_tokens)
    util = AllocatorSection().prefill_target_util
    return Demand(loads[0] * util / cap.prefill_s_per_token, loads[1] * cap.decode_full_seqs, context_tokens, "test")


def test_short_appends_load_the_decode_side():
    cap = CapacityModel(ENGINES, 2.0).at(4096)
    full = demand_for((3.0, 5.0))
    p, d = stage_loads(Demand(full.prefill_tokens_per_s, full.decode_seqs, 4096.0, "t", remote_share=0.25), cap, 0.8)
    assert abs(p - 0.75) < 1e-6  # a quarter of the prefill tokens go to prefill engines
    assert abs(d - (5.0 + 0.75 * 3.0 * 0.8)) < 1e-6  # the rest is computed on decode engines, at full utilisation


def test_demand_for_builds_the_loads_it_claims():
    cap = CapacityModel(ENGINES, 2.0).at(4096)
    p, d = stage_loads(demand_for((3.0, 5.0)), cap, AllocatorSection().prefill_target_util)
    assert abs(p - 3.0) < 1e-6 and abs(d - 5.0) < 1e-6


def test_fixed_policies_only_restore_roles_that_drifted():
    policy = Fixed("static", {f"e{i}": P if i < 2 else D for i in range(4)})
    assert policy.decide(None, fleet([P, P, D, D])) == []
    [change] = policy.decide(None, fleet([P, D, D, D]))
    assert (change.engine_id, change.role) == ("e1", P)
    assert Fixed("colocated", {"e0": C}).decide(None, fleet([C])) == []


def test_split_follows_the_ratio_of_stage_loads():
    roles = [P, P, D, D, D, D, D, D]
    changes = split().decide(demand_for((6.0, 2.0)), fleet(roles))  # prefill-heavy: 6 of 8 should prefill
    assert sorted(c.engine_id for c in changes) == ["e2", "e3", "e4", "e5"] and all(c.role is P for c in changes)
    changes = split().decide(demand_for((1.0, 7.0)), fleet(roles))  # decode-heavy: 1 of 8
    assert len(changes) == 1 and changes[0].role is D


def test_the_split_size_is_the_one_with_the_least_bottleneck():
    from actors.allocator.loads import bottleneck, target_prefill_engines

    loads = (0.76, 1.42)  # 1.39 of 4 engines would prefill at equal utilisation
    assert bottleneck(loads, 2, 4) < bottleneck(loads, 1, 4)  # one prefill engine at 0.76, two decode engines at 0.71
    assert target_prefill_engines(loads, 4, 0) == 2  # not the nearer 1
    assert target_prefill_engines((1.42, 0.76), 4, 0) == 2
    assert target_prefill_engines((3.0, 5.0), 8, 0) == 3  # exact: 3:5
    assert target_prefill_engines(loads, 4, 1) == 1  # within the deadband of a running 1:3: kept


def test_split_keeps_one_engine_per_stage():
    roles = [P, P, D, D, D, D, D, D]
    to_prefill = split().decide(demand_for((50.0, 1.0)), fleet(roles))
    assert len(to_prefill) == 5  # 7 prefill, never 8
    to_decode = split().decide(demand_for((0.3, 9.0)), fleet(roles))
    assert len(to_decode) == 1  # 1 prefill left


def test_colocation_when_long_prefills_would_not_keep_a_prefill_engine_busy_with_hysteresis():
    pd, colocated = [P, P, D, D, D, D], [C] * 6
    to_colocated = split().decide(demand_for((0.1, 4.0)), fleet(pd))
    assert {c.role for c in to_colocated} == {C} and len(to_colocated) == 6
    assert split().decide(demand_for((0.4, 4.0)), fleet(colocated)) == []  # below the 0.5 to split again
    assert split().decide(demand_for((0.4, 4.0)), fleet(pd, role_since_s=[0.0] * 6))[0].role is D  # PD stays PD (2 -> 1 prefill)
    assert split().decide(demand_for((3.0, 0.5)), fleet(colocated)) == []  # a burst of prompts, little decoding: stay
    to_pd = split().decide(demand_for((2.0, 4.0)), fleet(colocated))
    assert sorted(c.role.value for c in to_pd) == ["decode"] * 4 + ["prefill"] * 2


def test_the_least_busy_engines_switch_and_nothing_moves_within_the_dwell():
    roles = [P, D, D, D]
    busy = dict(running_decode=[0, 50, 3, 9])
    [change] = split(min_gain_s=0.0).decide(demand_for((2.0, 2.0)), fleet(roles, **busy))
    assert (change.engine_id, change.role) == ("e2", P)  # e2 (3 in flight) rather than e1 (50) or e3 (9)
    recent = fleet(roles, now_s=100.0, role_since_s=[0.0, 0.0, 0.0, 95.0], **busy)  # e3 switched 5 s ago
    assert split(min_gain_s=0.0, min_dwell_s=10.0).decide(demand_for((2.0, 2.0)), recent) == []  # the fleet dwells


def test_prorsa_skips_a_change_that_does_not_pay_for_its_switches_but_reactive_makes_it():
    roles = [P, P, P, D, D, D, D, D]
    shifted = demand_for((3.75, 4.25))  # wants 4:4; the bottleneck drops 1.25 -> 1.0625: 15 engine-s over 10 s
    assert split(drain_deadline_s=15.0, min_gain_s=2.0).decide(shifted, fleet(roles)) == []  # one switch costs 15
    [change] = split(drain_deadline_s=8.0, min_gain_s=2.0).decide(shifted, fleet(roles))  # costs 8: pays
    assert change.role is P
    assert split(drain_deadline_s=8.0, min_gain_s=8.0).decide(shifted, fleet(roles)) == []  # hysteresis
    reactive = split("reactive", weigh_cost=False, drain_deadline_s=50.0)
    assert len(reactive.decide(shifted, fleet(roles))) == 1  # reactive never weighs the cost


def test_unresponsive_engines_are_left_out_and_no_decision_during_a_switch():
    roles = [P, D, D, D]
    state = fleet(roles, responsive=[True, False, True, True], running_decode=[0, 0, 5, 1])
    [change] = split(min_gain_s=0.0).decide(demand_for((3.0, 1.0)), state)  # 3 engines usable: wants 2 prefill
    assert change.engine_id == "e3"  # e1 does not answer; e2 is busier
    assert split().decide(demand_for((3.0, 1.0)), fleet(roles, switching=[False, True, False, False])) == []


def test_a_colocated_fleet_gets_a_stage_for_every_engine():
    changes = split().decide(demand_for((1.0, 3.0)), fleet([C, C, C, C], running_decode=[5, 0, 2, 9]))
    assert {c.engine_id: c.role for c in changes} == {"e1": P, "e0": D, "e2": D, "e3": D}


def test_no_demand_no_change():
    assert split().decide(None, fleet([P, D])) == []
    assert split().decide(Demand(0.0, 0.0), fleet([P, D, D])) == []


def test_demand_from_queues_and_from_a_forecast():
    state = fleet([P, D], waiting_prefill_tokens=[5000, 0], running_decode=[0, 40], decode_context_tokens=[0, 40 * 3000])
    q = from_queues(state, horizon_s=10.0)
    assert (q.prefill_tokens_per_s, q.decode_seqs, q.decode_context_tokens) == (500.0, 40.0, 3000.0)
    forecast = DemandForecast(
        forecaster_id="f",
        model="lifecycle",
        tick=1,
        as_of_s=90.0,
        computed_at_s=92.0,
        bin_s=1.0,
        horizons_s=[1.0, 5.0, 10.0, 20.0],
        live_trajectories=10,
        events_total=100,
        targets=[
            TargetForecast(target="prefill_miss_tokens", mean=[100.0, 200.0, 300.0, 9999.0], quantile_levels=[0.5], quantiles=[[0.0] * 4]),
            TargetForecast(target="prefill_new_tokens", mean=[10.0, 10.0, 10.0, 10.0], quantile_levels=[0.5], quantiles=[[0.0] * 4]),
            TargetForecast(target="decode_active_seqs", mean=[30.0, 40.0, -5.0, 9999.0], quantile_levels=[0.5], quantiles=[[0.0] * 4]),
        ],
    )
    f = from_forecast(forecast, state, horizon_s=10.0)
    assert f.prefill_tokens_per_s == 200.0 + 500.0  # no window published: mean over h <= 10 s, plus the backlog of now
    assert abs(f.decode_seqs - 70.0 / 3) < 1e-9  # a negative forecast counts as zero
    # a forecast that publishes its window means (every bin up to each horizon) is read at
    # the furthest horizon within the allocator's, not averaged over the sampled horizons
    windowed = msgspec.structs.replace(
        forecast, targets=[msgspec.structs.replace(t, window_mean=[m + 1.0 for m in t.mean]) for t in forecast.targets]
    )
    w = from_forecast(windowed, state, horizon_s=10.0)
    assert (w.prefill_tokens_per_s, w.decode_seqs) == (301.0 + 500.0, 0.0)  # the 10 s window; a negative one counts as zero
    assert from_forecast(windowed, state, horizon_s=7.0).prefill_tokens_per_s == 201.0 + 5000 / 7.0  # the 5 s window
    assert from_forecast(windowed, state, horizon_s=10.0, quantile=0.5).prefill_tokens_per_s == 0.0 + 500.0  # quantiles: per horizon
    order = [2, 0, 3, 1]  # the same forecast with its horizons listed out of order
    shuffled = msgspec.structs.replace(
        windowed,
        horizons_s=[windowed.horizons_s[i] for i in order],
        targets=[
            msgspec.structs.replace(
                t,
                mean=[t.mean[i] for i in order],
                quantiles=[[q[i] for i in order] for q in t.quantiles],
                window_mean=[t.window_mean[i] for i in order],
            )
            for t in windowed.targets
        ],
    )
    assert from_forecast(shuffled, state, horizon_s=10.0).prefill_tokens_per_s == 301.0 + 500.0
    assert f.decode_context_tokens == 3000.0  # the decoding sequences' context
    # nothing decodes now (a step's start): the next decodes start at the live trajectories' KV,
    # not at the typical 4,096 tokens; unknown where the live state is not known either
    idle = fleet([P, D], waiting_prefill_tokens=[5000, 0])
    live = msgspec.structs.replace(forecast, live_context_tokens=10 * 700)
    assert from_forecast(live, idle, horizon_s=10.0).decode_context_tokens == 700.0
    assert from_forecast(forecast, idle, horizon_s=10.0).decode_context_tokens == DEFAULT_CONTEXT_TOKENS
    assert not from_forecast(forecast, idle, horizon_s=10.0).live_known  # live trajectories, their KV not stated
    assert from_forecast(msgspec.structs.replace(forecast, live_trajectories=0), idle, horizon_s=10.0).live_known  # none live


def _status(engine_id: str, role: Role, waiting_tokens: int, switching: bool = False, running_decode: int = 0) -> EngineStatus:
    return EngineStatus(
        engine_id=engine_id,
        at_s=0.0,
        role=role,
        epoch=0,
        policy_version=0,
        backend="emulated",
        waiting_prefill=0,
        running_decode=running_decode,
        kv_used_tokens=0,
        kv_capacity_tokens=1,
        held_kv_handles=0,
        busy_fraction=0.0,
        waiting_prefill_tokens=waiting_tokens,
        switching=switching,
    )


def test_router_spreads_new_trajectories_before_any_heartbeat():
    router = Router(["e0", "e1", "e2"])
    assert [router.route("", "", 0, 1000) for _ in range(4)] == ["e0", "e1", "e2", "e0"]


def test_router_prefers_the_engine_holding_the_prefix_unless_it_is_far_busier():
    router = Router(["e0", "e1", "e2", "e3"])
    for s in (_status("e0", C, 5000), _status("e1", C, 0), _status("e2", D, 0), _status("e3", P, 0, switching=True)):
        router.observe(s)
    assert router.route("e0", "e0", 8000, 100) == "e0"  # 5000 queued < the 8000-token prefix a miss recomputes
    assert router.route("e0", "e0", 1000, 100) == "e1"  # too busy for a 1000-token prefix: least loaded
    assert router.route("", "", 0, 300) == "e1"  # a new trajectory: least loaded (decode and switching engines never)
    assert router.route("e2", "e2", 50_000, 10) in ("e0", "e1")  # its last engine decodes: no local prefill here
    assert router.counters()["prefill_short_tokens"] == 0  # placement is off


def test_per_turn_placement_keeps_short_appends_where_the_kv_is():
    router = Router(["e0", "e1", "e2"], local_prefill_max_tokens=1024)
    for s in (_status("e0", P, 0), _status("e1", D, 0), _status("e2", D, 0)):
        router.observe(s)
    assert router.route("e1", "e0", 6000, 400) == "e1"  # a short append: prefilled on the decode engine holding the KV
    assert router.route("e2", "e0", 12_000, 3000) == "e2"  # long, but short of half its context: recompute would cost more
    assert router.route("", "", 0, 3000) == "e0"  # a first prompt goes to the prefill engine
    assert router.route("e1", "e0", 2000, 1500) == "e0"  # a long append on a short context too
    assert router.counters()["prefill_short_tokens"] == 3400 and router.counters()["prefill_long_tokens"] == 4500


def test_a_full_decode_engine_under_prefill_first_lockstep_gets_no_appends():
    """One rank's append on a DP-attention decode engine under SGLang's prefill-first lockstep
    holds every rank's decodes for its chunk: R times a prefill engine's cost. Where the decode
    side is full (that engine's KV, or prefilled turns waiting for decode room), a short append
    goes to a prefill engine; elsewhere it stays where its KV is."""
    deepseek = EngineSection(count=4, preset="h200-deepseek-v3-fp8", layout=LayoutSection(dp=8, ep=8))
    assert deepseek.decode_lockstep
    assert not EngineSection(count=4, preset="h200-deepseek-v3-fp8", layout=LayoutSection(dp=8, ep=8), dp_sync="vllm").decode_lockstep
    assert not EngineSection(count=4, preset="h200-qwen3-8b").decode_lockstep  # one rank: nothing to hold

    def routed(lockstep: bool, used_tokens: int, held_handles: int = 0) -> str | None:
        router = Router(["e0", "e1"], local_prefill_max_tokens=1024, decode_lockstep=lockstep)
        router.observe(msgspec.structs.replace(_status("e0", P, 0), held_kv_handles=held_handles))
        router.observe(msgspec.structs.replace(_status("e1", D, 0, running_decode=2), kv_used_tokens=used_tokens, kv_capacity_tokens=1000))
        return router.route("e1", "e0", 6000, 400)

    assert routed(lockstep=True, used_tokens=950) == "e0"  # full lockstep decode engine: to the prefill engine
    assert routed(lockstep=True, used_tokens=500) == "e1"  # room left: the append stays where its KV is
    assert routed(lockstep=True, used_tokens=500, held_handles=3) == "e0"  # turns wait for decode room: the side is full
    assert routed(lockstep=False, used_tokens=950) == "e1"  # no lockstep: nothing stalls


def test_a_prefill_engine_turn_moves_only_to_keep_another_from_running_dry():
    router = Router(["e0", "e1", "e2"], local_prefill_max_tokens=1024)
    for s in (_status("e0", P, 20_000), _status("e1", P, 5000), _status("e2", D, 0)):
        router.observe(s)
    # e0 is 15k tokens busier than e1, far more than the 4k prefix, but e1 has 5k queued: moving
    # the turn would recompute 4k tokens and keep no engine from running dry
    assert router.route("e2", "e0", 4000, 3000) == "e0"
    router.observe(_status("e1", P, 1000))  # e1 is about to run dry: the turn moves there
    assert router.route("e2", "e0", 4000, 3000) == "e1"
    # a colocated home keeps the plain rule: 20k queued > 5k + the 4k prefix
    colocated = Router(["e0", "e1"])
    for s in (_status("e0", C, 20_000), _status("e1", C, 5000)):
        colocated.observe(s)
    assert colocated.route("e0", "e0", 4000, 3000) == "e1"
    assert router.counters()["turns_routed"] == 2 and colocated.counters()["turns_routed"] == 1  # every turn counts, wherever it goes


def test_a_short_append_leaving_a_busy_decode_engine_goes_to_its_prefix_holder():
    router = Router(["e0", "e1", "e2"], local_prefill_max_tokens=1024)
    for s in (_status("e0", P, 0), _status("e1", P, 0), _status("e2", D, 0, running_decode=50)):
        router.observe(s)
    # the decode engine holding the whole context is 50 sequences busy: the append goes to e1,
    # which prefilled the last turn and holds the prefix, not to e0 (least loaded by name)
    assert router.route("e2", "e1", 6000, 400) == "e1"
    assert router.counters()["routed_home"] == 1 and router.counters()["routed_balance"] == 0


# --- colocation or PD from the cost model (allocator.colocation = "cost-model") --------------------


def cost_model_split(engines: EngineSection = ENGINES, weigh_cost: bool = True, regime: bool = False) -> Split:
    """The cost-model rule; the load rules alone unless `regime` (the saturated regime, on by
    default, has its tests in test_allocator_throughput.py)."""
    return Split("prorsa", engines, AllocatorSection(saturated_regime=regime, decision="rules"), weigh_cost=weigh_cost)


def test_cost_model_colocated_load_charges_lockstep_prefill_on_dp_groups_only():
    from actors.allocator.loads import colocated_load

    def cap_for(dp_sync: str):
        return CapacityModel(
            EngineSection(count=8, preset="h200-qwen3-30b-a3b", layout=LayoutSection(dp=4, ep=4), dp_sync=dp_sync), 2.0
        ).at(4096)

    sglang, vllm, ideal = cap_for("sglang"), cap_for("vllm"), cap_for("ideal")
    assert (sglang.colocated_lockstep_ranks, vllm.colocated_lockstep_ranks, ideal.colocated_lockstep_ranks) == (4, 1, 1)
    assert vllm.colocated_mixed_penalty > 0.0 and ideal.colocated_mixed_penalty == 0.0
    util = AllocatorSection().prefill_target_util
    demand = demand_for((4.0, 4.0))  # 4 engines of prefill, 4 of decode, on 8 engines
    prefill, decode = 4.0, 4.0  # the default fleet has one layout: colocated loads equal the stage loads
    # SGLang prefill-first: a rank prefills half the time; the group decodes only while none does
    assert abs(colocated_load(demand, sglang, util, 8) - (8 * (1 - 0.5**4) + decode)) < 1e-6
    # vLLM: decode steps run eager while a peer prefills, nothing stalls
    prefill_vllm = demand.prefill_tokens_per_s * vllm.colocated_prefill_s_per_token / util
    expected = prefill_vllm + decode * (1 + vllm.colocated_mixed_penalty * prefill_vllm / 8)
    assert abs(colocated_load(demand, vllm, util, 8) - expected) < 1e-6
    prefill_ideal = demand.prefill_tokens_per_s * ideal.colocated_prefill_s_per_token / util
    assert prefill_ideal < prefill  # no normal-mode all-to-all in an ideal group's prefill steps
    assert abs(colocated_load(demand, ideal, util, 8) - (prefill_ideal + decode)) < 1e-6
    # the lockstep stall grows with the ranks that can each stall the group: more than in step
    assert colocated_load(demand, sglang, util, 8) > prefill + decode
    # a burst of twice the fleet's prefill takes twice the fleet: the stall saturates at every
    # engine, the prefill work does not vanish past it (the split's prefill load is not capped)
    burst = demand_for((16.0, 1.0))
    assert abs(colocated_load(burst, sglang, util, 8) - (16.0 + 1.0)) < 1e-6
    assert colocated_load(burst, sglang, util, 8) > colocated_load(demand_for((8.0, 1.0)), sglang, util, 8) + 7.0


def test_colocated_load_counts_the_live_histories_not_the_finished_trajectories_cache():
    from dataclasses import replace

    from actors.allocator.loads import colocated_load, relocatable_tokens

    cap = CapacityModel(ENGINES, 2.0).at(4096)
    tail = Demand(1000.0, 6.0, 4096.0, "t", kv_working_set_tokens=0.95 * 8 * cap.colocated_kv_tokens)  # a warm fleet, few live
    unknown = colocated_load(tail, cap, 0.8, 8)
    assert unknown > 7.0  # without the live state the warm cache reads as a full fleet
    live = replace(tail, live_context_tokens=200_000.0)
    assert colocated_load(live, cap, 0.8, 8) < 0.2 * unknown  # the cached prefixes of finished trajectories are no load
    busy = replace(tail, live_context_tokens=0.7 * 8 * cap.colocated_kv_tokens)
    assert (
        abs(colocated_load(busy, cap, 0.8, 8) - colocated_load(replace(tail, kv_working_set_tokens=busy.live_context_tokens), cap, 0.8, 8))
        < 1e-9
    )
    # between sync steps a forecast says none is live: that 0 is known, not missing, and the
    # warm pools hold only finished trajectories' prefixes (no load, nothing a split relocates)
    between_steps = replace(tail, decode_seqs=0.0, live_known=True)
    assert colocated_load(between_steps, cap, 0.8, 8) < 0.2 * unknown
    assert relocatable_tokens(between_steps) == 0.0 and relocatable_tokens(tail) == tail.kv_working_set_tokens


def test_working_set_counts_live_trajectories_the_fleet_no_longer_holds():
    from actors.allocator.loads import working_set_tokens

    held = Demand(prefill_tokens_per_s=0.0, decode_seqs=10, decode_context_tokens=8000, kv_working_set_tokens=2e6)
    assert working_set_tokens(held) == 2e6  # nothing known of live trajectories: what the fleet holds
    evicting = replace(held, live_trajectories=1000)
    assert working_set_tokens(evicting) == 8e6  # 1,000 live trajectories at 8k each, though the pools kept 2M


def test_cost_model_splits_only_when_the_saving_pays_for_every_switch():
    colocated = [C] * 8
    light = cost_model_split().decide(demand_for((0.3, 0.3)), fleet(colocated))
    assert light == []  # 8 engine-s saved over the horizon against 20 s of drains: stay colocated
    heavy = cost_model_split().decide(demand_for((3.0, 3.0)), fleet(colocated))
    assert {c.role for c in heavy} == {P, D} and sum(c.role is P for c in heavy) == 4
    ideal = EngineSection(count=8, preset="h200-qwen3-30b-a3b", layout=LayoutSection(dp=4, ep=4), dp_sync="ideal")
    assert cost_model_split(ideal).decide(demand_for((3.0, 3.0)), fleet(colocated)) == []  # nothing removed by a split


def test_cost_model_goes_back_to_colocated_when_that_saves_more_than_the_switches():
    pd = [P, P, P, P, D, D, D, D]
    back = cost_model_split().decide(demand_for((0.05, 7.0)), fleet(pd))  # 4 prefill engines idle, decode overloaded
    assert len(back) == 8 and {c.role for c in back} == {C}
    policy = cost_model_split()
    assert policy.decide(demand_for((6.0, 6.0)), fleet(pd)) == [] and policy.last_reason.startswith("hold 4:4")


GREEDY = msgspec.structs.replace(ENGINES, admission="vllm")  # engines admit everything and preempt


def test_a_working_set_the_decode_side_cannot_hold_keeps_a_greedy_fleet_colocated():
    from dataclasses import replace

    colocated = [C] * 8
    heavy = demand_for((3.0, 3.0))
    assert cost_model_split(GREEDY).decide(heavy, fleet(colocated)) != []  # splits when the KV fits
    kv_per_engine = CapacityModel(GREEDY, 2.0).at(4096).decode_kv_tokens
    full = replace(heavy, kv_working_set_tokens=0.8 * 8 * kv_per_engine)  # the fleet's KV 80% full, between turns
    policy = cost_model_split(GREEDY)
    assert policy.decide(full, fleet(colocated)) == [] and "would not fit" in policy.last_reason
    live = replace(heavy, live_trajectories=0.8 * 8 * kv_per_engine / 4096)  # the same working set, counted by trajectory
    assert cost_model_split(GREEDY).decide(live, fleet(colocated)) == []
    fleet_now = fleet(colocated, kv_held_tokens=[100] * 8)
    assert fleet_now.kv_working_set_tokens == 800
    # engines that queue what does not fit, with write-back: the histories left on the new decode
    # engines are cached prefixes they evict as they need room, and the next turns recompute
    # them on the prefill side (the relocation the split pays for), so no veto
    policy = cost_model_split()
    assert policy.decide(full, fleet(colocated)) == [] and "would not fit" not in policy.last_reason and "costs" in policy.last_reason


def test_with_write_back_a_split_decode_side_holds_only_what_it_decodes():
    from dataclasses import replace

    cap = CapacityModel(ENGINES, 2.0).at(4096)
    demand = demand_for((3.0, 3.0))
    warm = replace(demand, kv_working_set_tokens=0.9 * 8 * cap.decode_kv_tokens)  # histories and cached prefixes fill the fleet
    assert stage_loads(warm, cap, 0.8) == stage_loads(demand, cap, 0.8)  # they live on the prefill side
    no_writeback = msgspec.structs.replace(ENGINES, kv_writeback="none")
    cap_none = CapacityModel(no_writeback, 2.0).at(4096)
    kept = stage_loads(warm, cap_none, 0.8)[1]  # without write-back the decode engines keep them
    assert (
        abs(kept - warm.kv_working_set_tokens / (0.9 * cap_none.decode_kv_tokens)) < 1e-9 and kept > stage_loads(demand, cap_none, 0.8)[1]
    )


def test_a_split_pays_for_recomputing_the_kv_its_decode_engines_hold():
    from actors.allocator.loads import relocation_s

    colocated = [C] * 8
    heavy = demand_for((3.0, 3.0))
    cap = CapacityModel(ENGINES, 2.0).at(4096)
    held = replace(heavy, kv_working_set_tokens=0.2 * 8 * cap.decode_kv_tokens)  # fits 4 decode engines easily
    assert relocation_s(held, cap, 4, 8) == held.kv_working_set_tokens * 0.5 * cap.prefill_s_per_token
    policy = cost_model_split()
    assert policy.decide(held, fleet(colocated)) == []  # the KV on the 4 engines going decode costs more than the gain
    assert f"costs {4 * AllocatorSection().drain_deadline_s + relocation_s(held, cap, 4, 8):.1f}" in policy.last_reason


def test_kv_that_no_longer_exists_costs_a_split_nothing_to_relocate():
    """Right after a weight update the engines have dropped the older policy's KV (and at a
    step's start no turn has prefilled yet): the live trajectories' histories must be
    recomputed under any arrangement, so the split that the held KV priced out above is bought
    at once, for its switches alone."""
    from actors.allocator.loads import relocation_s, working_set_tokens

    cap = CapacityModel(ENGINES, 2.0).at(4096)
    held = replace(demand_for((3.0, 3.0)), kv_working_set_tokens=0.2 * 8 * cap.decode_kv_tokens)
    assert cost_model_split().decide(held, fleet([C] * 8)) == []  # as above: relocating the held KV costs too much
    updated = replace(held, kv_working_set_tokens=0.0, live_trajectories=held.kv_working_set_tokens / 4096)
    assert working_set_tokens(updated) == pytest.approx(held.kv_working_set_tokens)  # the same histories, live
    assert relocation_s(updated, cap, 4, 8) == 0.0  # ... but none of their KV is held anywhere
    split_now = cost_model_split().decide(updated, fleet([C] * 8))
    assert {c.role for c in split_now} == {P, D}


def test_the_prefill_work_of_an_arrangement_is_learned_only_once_it_has_settled():
    policy = split()
    demand = replace(demand_for((3.0, 5.0)), prefill_new_tokens_per_s=1.0)
    roles = [P] * 3 + [D] * 5
    policy.decide(demand, fleet(roles, now_s=20.0, role_since_s=[0.0] * 8))  # 20 s after a change: turns still recompute
    assert policy.miss_ratio == {}
    policy.decide(demand, fleet(roles, now_s=100.0, role_since_s=[0.0] * 8))
    assert "pd" in policy.miss_ratio


def test_an_arrangements_prefill_work_per_new_token_leaves_out_the_backlog():
    """A stage that falls behind queues work; the queue is demand, but not prefill work each new
    token brings in that arrangement (a split whose prefill side is short would read as one that
    recomputes 20 tokens per new one, and keep the fleet off every split after)."""
    fleet_now = fleet([P] * 3 + [D] * 5, now_s=100.0, role_since_s=[0.0] * 8, waiting_prefill_tokens=[400_000] + [0] * 7)
    forecast = DemandForecast(
        forecaster_id="f",
        model="lifecycle",
        tick=1,
        as_of_s=100.0,
        computed_at_s=100.0,
        bin_s=1.0,
        horizons_s=[10.0],
        live_trajectories=10,
        events_total=100,
        targets=[
            TargetForecast(target=target, mean=[mean], quantile_levels=[0.5], quantiles=[[mean]])
            for target, mean in (("prefill_miss_tokens", 3000.0), ("prefill_new_tokens", 1000.0), ("decode_active_seqs", 100.0))
        ],
    )
    demand = from_forecast(forecast, fleet_now, 10.0)
    assert demand.prefill_backlog_tokens_per_s == 40_000.0 and demand.prefill_tokens_per_s == 43_000.0
    assert demand.prefill_flow_tokens_per_s == 3000.0
    policy = split()
    policy.decide(demand, fleet_now)
    assert policy.miss_ratio == {"pd": 3.0}  # the flow's 3 per new token, not 43
    policy.miss_ratio["colocated"] = 1.5
    as_colocated = policy._as_in(demand, "colocated", "pd")
    assert as_colocated.prefill_tokens_per_s == 1500.0 + 40_000.0  # the flow scales, the queue is queued once
    # right after a change the arrangement is judged at its steady flow, and the queue still waits
    assert policy._steady(replace(demand, prefill_tokens_per_s=49_000.0), "pd").prefill_tokens_per_s == 3000.0 + 40_000.0


def test_a_split_hovering_at_a_rounding_edge_keeps_its_size():
    roles = [P, P, P, D, D, D, D, D]
    assert split().decide(demand_for((3.5, 4.5)), fleet(roles)) == []  # ideal 3.5 engines: within the deadband of 3
    assert len(split().decide(demand_for((3.8, 4.2)), fleet(roles))) == 1  # ideal 3.8: beyond it, grow to 4


def test_a_change_that_undoes_the_last_one_is_held_off_longer_each_time():
    policy = split(min_dwell_s=0.0)
    grow, shrink = demand_for((5.0, 3.0)), demand_for((2.0, 6.0))
    roles4, roles5 = [P] * 4 + [D] * 4, [P] * 5 + [D] * 3
    assert len(policy.decide(grow, fleet(roles4, now_s=100.0))) == 1  # 4 -> 5
    assert len(policy.decide(shrink, fleet(roles5, now_s=110.0))) == 3  # undoes it: allowed once, starts a hold
    hold_s = policy.damping.penalty_s
    assert hold_s >= AllocatorSection().horizon_s
    assert policy.decide(grow, fleet([P] * 2 + [D] * 6, now_s=110.0 + hold_s / 2)) == []  # a reversal inside the hold
    assert policy.decide(grow, fleet([P] * 2 + [D] * 6, now_s=110.0 + hold_s + 1.0)) != []  # after it


def test_colocation_buys_a_costly_split_once_its_losses_cover_the_cost():
    """Ski rental: a split whose KV recompute costs more than a horizon saves is made once the
    engine-seconds colocation lost since the split started paying cover that cost."""
    cap = CapacityModel(ENGINES, 2.0).at(4096)
    held = replace(demand_for((3.0, 3.0)), kv_working_set_tokens=0.2 * 8 * cap.decode_kv_tokens)
    policy = cost_model_split()
    split_at_s = None
    for tick in range(400):
        now_s = 100.0 + 2.0 * tick
        if policy.decide(held, fleet([C] * 8, now_s=now_s)):
            split_at_s = now_s
            break
        assert "colocation lost" in policy.last_reason
    assert split_at_s is not None and split_at_s > 100.0  # not at once: one horizon does not pay for it
    # a tick where the split stops paying starts the count again
    policy = cost_model_split()
    policy.decide(held, fleet([C] * 8, now_s=100.0))
    assert policy.decide(held, fleet([C] * 8, now_s=102.0)) == []
    assert policy.regret_s > 0.0
    policy.decide(demand_for((0.01, 0.01)), fleet([C] * 8, now_s=104.0))
    assert policy.regret_s == 0.0


def test_a_split_whose_working_set_outgrows_its_decode_side_goes_back():
    no_writeback = msgspec.structs.replace(ENGINES, kv_writeback="none")  # histories stay on the decode engines
    cap = CapacityModel(no_writeback, 2.0).at(4096)
    pd = [P] * 4 + [D] * 4
    fits = replace(demand_for((3.0, 3.0)), kv_working_set_tokens=0.5 * 4 * cap.decode_kv_tokens)
    assert cost_model_split(no_writeback).decide(fits, fleet(pd)) == []
    outgrown = replace(fits, kv_working_set_tokens=1.2 * 4 * cap.decode_kv_tokens)
    policy = cost_model_split(no_writeback)
    back = policy.decide(outgrown, fleet(pd))
    assert {c.role for c in back} == {C} and "working set" in policy.last_reason and "outgrew 4 decode engines" in policy.last_reason


def test_with_write_back_a_split_goes_back_only_when_its_decoding_sequences_outgrow_it():
    cap = CapacityModel(ENGINES, 2.0).at(4096)
    assert not cap.decode_holds_histories  # the default fleet writes each turn's KV back to the prefill side
    pd = [P] * 4 + [D] * 4
    # a working set beyond the decode side: the histories live on the prefill side, so the split holds
    outgrown = replace(demand_for((3.0, 3.0)), kv_working_set_tokens=1.2 * 4 * cap.decode_kv_tokens)
    policy = cost_model_split()
    assert policy.decide(outgrown, fleet(pd)) == [] and "outgrew" not in policy.last_reason
    # ... but a greedy fleet does not split into one: entering, the histories on the new decode
    # engines stay there for a turn, and its decode engines would preempt and recompute
    entering = cost_model_split(GREEDY)
    assert entering.decide(outgrown, fleet([C] * 8)) == [] and "would not fit" in entering.last_reason
    # the sequences it decodes, at their contexts, no longer fit 4 decode engines: back to colocated
    decoding = replace(outgrown, decode_seqs=1.2 * 4 * cap.decode_kv_tokens / 4096)
    policy = cost_model_split()
    back = policy.decide(decoding, fleet(pd))
    assert {c.role for c in back} == {C} and "decoding sequences' KV" in policy.last_reason
