"""The allocator prices prefill tokens by the context they attend over: the forecast's (or the
recorded log's) prefill engine-seconds, not a typical context rounded to a power of two."""

from __future__ import annotations

from dataclasses import replace

import msgspec

from actors.allocator.capacity import CapacityModel, prefill_s_per_token
from actors.allocator.demand import RecordedDemand, from_forecast
from actors.allocator.loads import colocated_load, stage_loads
from actors.allocator.state import Demand, EngineState, Fleet
from actors.config import EngineSection, LayoutSection
from actors.engine.admission import rank_chunk_tokens
from bus_schemas.control import Role
from bus_schemas.eventlog import events_frame
from bus_schemas.forecast import DemandForecast, TargetForecast
from bus_schemas.lifecycle import EventKind as K
from bus_schemas.lifecycle import LifecycleEvent
from forecasting.series import TokenCost

ENGINES = EngineSection(count=4, preset="h200-deepseek-v3-fp8", layout=LayoutSection(dp=8, ep=8))
COST = TokenCost.prefill_of(ENGINES.cost_preset(Role.PREFILL))


def test_a_prefill_token_costs_what_the_cost_model_gives_at_its_context():
    cap = CapacityModel(ENGINES, 2.0).at(12_000)  # priced at the 8,192-token bucket
    chunk = rank_chunk_tokens(ENGINES.max_batch_tokens, 8, divided=True)  # each of the 8 ranks' share
    assert cap.prefill_s_at(0.0) == cap.prefill_s_per_token  # unknown: the reference
    assert cap.prefill_s_at(cap.prefill_attention_tokens) == cap.prefill_s_per_token
    for attention in (3_000.0, 20_000.0, 60_000.0):  # linear in the context, as the cost model is
        expected = prefill_s_per_token(ENGINES.cost_preset(Role.PREFILL), chunk, round(attention - chunk / 2))
        assert abs(cap.prefill_s_at(attention) / expected - 1.0) < 1e-6
    assert cap.prefill_s_at(60_000.0) > 1.5 * cap.prefill_s_per_token


def test_prefill_loads_follow_the_attention_context():
    cap = CapacityModel(ENGINES, 2.0).at(12_000)
    base = Demand(50_000.0, 500.0, 12_000.0, "t")
    longer = replace(base, prefill_attention_tokens=2 * cap.prefill_attention_tokens)
    ratio = cap.prefill_s_at(longer.prefill_attention_tokens) / cap.prefill_s_per_token
    assert abs(stage_loads(longer, cap, 0.8)[0] / stage_loads(base, cap, 0.8)[0] - ratio) < 1e-9
    assert stage_loads(longer, cap, 0.8)[1] == stage_loads(base, cap, 0.8)[1]  # the decode side is unchanged
    assert colocated_load(longer, cap, 0.8, 4) > colocated_load(base, cap, 0.8, 4)


def test_attention_tokens_inverts_the_prefill_cost():
    one = COST.engine_s(500.0, 10_000.0)
    assert abs(COST.attention_tokens(one, 500.0) - 10_250.0) < 1e-6  # the prefix, and half its own tokens
    two = COST.engine_s(500.0, 10_000.0) + COST.engine_s(1_500.0, 2_000.0)
    assert abs(COST.attention_tokens(two, 2_000.0) - (500 * 10_250 + 1_500 * 2_750) / 2_000) < 1e-6
    assert TokenCost().attention_tokens(123.0, 100.0) == 0.0  # token counts price no attention
    assert COST.attention_tokens(1.0, 0.0) == 0.0


def _fleet(now_s: float) -> Fleet:
    return Fleet(now_s=now_s, engines=(EngineState("e0", Role.COLOCATED),))


def _target(name: str, mean: list[float]) -> TargetForecast:
    return TargetForecast(target=name, mean=mean, quantile_levels=[0.5], quantiles=[mean])


def test_a_forecast_states_its_costs_and_the_demand_reads_the_attention_context_from_them():
    fleet = _fleet(100.0)
    miss, engine_s = 2_000.0, COST.engine_s(500.0, 10_000.0) + COST.engine_s(1_500.0, 2_000.0)
    targets = [
        _target("prefill_miss_tokens", [miss, miss]),
        _target("prefill_new_tokens", [100.0, 100.0]),
        _target("decode_active_seqs", [10.0, 10.0]),
    ]
    forecast = DemandForecast(
        forecaster_id="f",
        model="lifecycle",
        tick=1,
        as_of_s=99.0,
        computed_at_s=99.5,
        bin_s=1.0,
        horizons_s=[1.0, 5.0],
        live_trajectories=3,
        events_total=10,
        targets=[*targets, _target("prefill_engine_s", [engine_s, engine_s])],
        prefill_cost_per_token_s=COST.per_token_s,
        prefill_cost_per_token_pair_s=COST.per_token_pair_s,
    )
    assert abs(from_forecast(forecast, fleet, 10.0).prefill_attention_tokens - (500 * 10_250 + 1_500 * 2_750) / 2_000) < 1e-6
    unstated = msgspec.structs.replace(forecast, prefill_cost_per_token_s=0.0, prefill_cost_per_token_pair_s=0.0)
    assert from_forecast(unstated, fleet, 10.0).prefill_attention_tokens == 0.0  # no costs stated: the reference
    older = msgspec.structs.replace(forecast, targets=targets)
    assert from_forecast(older, fleet, 10.0).prefill_attention_tokens == 0.0  # no engine-seconds forecast


def test_the_oracle_reads_the_attention_context_from_the_log():
    rows = [  # two prefills in the first second, one long-context one in the third
        ("prefill_done", 0.2, "t0", 10_000, 10_000, 500),
        ("prefill_done", 0.7, "t1", 2_000, 2_000, 1_500),
        ("prefill_done", 2.5, "t2", 40_000, 30_000, 1_000),
    ]
    events = events_frame(
        [
            LifecycleEvent(
                event_id=f"x{i}",
                kind=K.PREFILL_DONE,
                at_s=at_s,
                actor_id="e0",
                trajectory_id=traj,
                engine_id="e0",
                context_tokens=context,
                cached_prefix_tokens=cached,
                new_tokens=new,
            )
            for i, (_, at_s, traj, context, cached, new) in enumerate(rows)
        ]
    )
    recorded = RecordedDemand(events, COST)
    assert abs(recorded.at(_fleet(0.0), 1.0).prefill_attention_tokens - (500 * 10_250 + 1_500 * 2_750) / 2_000) < 1e-6
    # the window from 2 s holds the third prefill: 10,000 tokens recomputed from a 30,000 prefix, and 1,000 new
    expected = (11_000 * (30_000 + 11_000 / 2)) / 11_000
    assert abs(recorded.at(_fleet(2.0), 1.0).prefill_attention_tokens - expected) < 1e-6
