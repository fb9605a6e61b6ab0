"""The saturated regime's throughput model (actors/allocator/throughput.py) and the choice the
cost-model policy makes from it when the live working set exceeds the fleet's KV."""

from __future__ import annotations

from dataclasses import replace

import pytest

from actors.allocator.capacity import CapacityModel
from actors.allocator.loads import relocation_s
from actors.allocator.policy import Split
from actors.allocator.state import Demand, EngineState, Fleet
from actors.allocator.throughput import (
    RATIO_MIN_TICKS,
    RatioMeter,
    arrangement_ratio,
    arrangement_ratios,
    colocated_rate,
    history_miss_share,
    history_pools_tokens,
    lockstep_rate,
    saturated,
    saturated_ratio,
    split_rate,
)
from actors.config import AllocatorSection, EngineSection, LayoutSection
from bus_schemas.control import Role

P, D, C = Role.PREFILL, Role.DECODE, Role.COLOCATED


def deepseek(**engines) -> EngineSection:
    """The bench's DeepSeek-V3 fleet: 4 engines of 8 GPUs, DP attention + EP8."""
    return EngineSection(count=4, preset="h200-deepseek-v3-fp8", layout=LayoutSection(dp=8, ep=8), **engines)


DEEPSEEK = deepseek()
CONTEXT_TOKENS = 16384


def test_lockstep_rate_is_time_sharing_for_one_rank_and_slower_for_more():
    a, k = 1000.0, 0.002  # 1,000 tokens/s with no prefill; 2 ms of prefill per engine per decode token
    assert abs(lockstep_rate(a, k, 1) - a / (1 + a * k)) < 1e-6  # D = a (1 - D k)
    assert lockstep_rate(a, 0.0, 8) == a
    eight = lockstep_rate(a, k, 8)
    assert abs(eight - a * (1 - eight * k) ** 8) < 1e-6  # the fixed point holds
    assert eight < lockstep_rate(a, k, 4) < lockstep_rate(a, k, 1)  # each rank's prefill stalls the group


def test_a_split_is_bound_by_its_prefill_side_or_by_its_decode_side():
    cap = CapacityModel(DEEPSEEK, 2.0).at(CONTEXT_TOKENS)
    q = 10.0  # prefill tokens per decode token
    one, three = split_rate(cap, 4, 1, q, 1.0), split_rate(cap, 4, 3, q, 1.0)
    assert abs(one - 1 / (q * cap.prefill_s_per_token)) < 1e-6  # one prefill engine, flat out
    decode_only = cap.decode_kv_seqs / cap.decode_kv_step_s  # one decode engine, never stalled
    assert abs(three - min(3 / (q * cap.prefill_s_per_token), decode_only)) < 1e-6
    # short appends prefilled on the decode engines stall their lockstep groups
    assert split_rate(cap, 4, 2, q, 0.5) < split_rate(cap, 4, 2, q, 1.0)
    assert split_rate(cap, 4, 0, q, 1.0) == split_rate(cap, 4, 4, q, 1.0) == 0.0


def test_colocation_loses_to_a_split_only_where_lockstep_stalls_it():
    q = 10.0
    sglang = CapacityModel(DEEPSEEK, 2.0).at(CONTEXT_TOKENS)
    best_split = max(split_rate(sglang, 4, p, q, 1.0) for p in (1, 2, 3))
    assert colocated_rate(sglang, 4, q) < best_split  # eight ranks' prefills out of step hold the decodes
    ideal = CapacityModel(deepseek(dp_sync="ideal"), 2.0).at(CONTEXT_TOKENS)
    assert ideal.colocated_lockstep_ranks == 1
    assert colocated_rate(ideal, 4, q) > max(split_rate(ideal, 4, p, q, 1.0) for p in (1, 2, 3))


def test_saturated_needs_a_working_set_past_the_fleets_kv_and_queueing_admission():
    cap = CapacityModel(DEEPSEEK, 2.0).at(CONTEXT_TOKENS)
    fleet_kv = 4 * cap.colocated_kv_tokens
    assert not saturated(0.8 * fleet_kv, cap, 4) and saturated(1.2 * fleet_kv, cap, 4)
    greedy = CapacityModel(deepseek(admission="vllm"), 2.0).at(CONTEXT_TOKENS)
    assert not saturated(1.2 * fleet_kv, greedy, 4)  # admitted and preempted: the KV-fit rules hold


def _ticks(
    meter: RatioMeter, start: tuple[int, int, int], per_tick: tuple[int, int, int], ticks: int, at: int | None
) -> tuple[int, int, int]:
    """`ticks` observations of the same per-tick counts, from the cumulative `start`."""
    totals = start
    for _ in range(ticks):
        totals = tuple(t + d for t, d in zip(totals, per_tick))
        meter.observe(*totals, at)
    return totals


def test_the_ratio_meter_reads_the_arrangement_of_now_over_a_window_and_keeps_the_one_before_until_then():
    meter = RatioMeter()
    meter.observe(0, 0, 0, 0)
    assert meter.reading() is None and meter.new_ratio is None
    totals = _ticks(meter, (0, 0, 0), (1000, 100, 50), RATIO_MIN_TICKS - 1, 0)  # colocated
    assert meter.reading() is None and meter.new_ratio == 0.5  # not yet a window of it
    totals = _ticks(meter, totals, (1000, 100, 50), 1, 0)
    assert meter.reading() == (0, 10.0)
    totals = _ticks(meter, totals, (4000, 100, 50), 3, None)  # a change settling: new tokens count, q does not
    assert meter.reading() == (0, 10.0) and meter.new_ratio == 0.5
    meter.observe(100, 210, 105, None)  # an engine restarted: its counters fell, skipped
    totals = _ticks(meter, (100, 210, 105), (40_000, 100, 50), 2, 3)  # settled as 3:1: two ticks of a transient
    assert meter.reading() == (0, 10.0)  # colocation's stands until 3:1 has a window of its own
    totals = _ticks(meter, totals, (300, 100, 50), RATIO_MIN_TICKS - 2, 3)
    q = meter.reading()[1]
    assert meter.reading()[0] == 3 and 3.0 < q < 400.0  # the transient's ticks decay out of it
    totals = _ticks(meter, totals, (300, 100, 50), 120, 3)
    assert abs(meter.reading()[1] - 3.0) < 0.01
    _ticks(meter, totals, (1000, 100, 50), 1, 0)  # back to colocated, read afresh: the split's stands a window
    assert abs(meter.reading()[1] - 3.0) < 0.01


def _fleet(roles: list[Role], now_s: float, prefilled: int, decoded: int, held_tokens: int) -> Fleet:
    n = len(roles)
    engines = tuple(
        EngineState(
            f"e{i}", role, kv_held_tokens=held_tokens // n, prefilled_tokens_total=prefilled // n, decoded_tokens_total=decoded // n
        )
        for i, role in enumerate(roles)
    )
    return Fleet(now_s, engines, new_tokens_total=decoded // 2)  # half a new token per decode token


def _run_colocated(policy: Split, demand: Demand, held: int, q: float = 10.0, ticks: int = 400) -> list:
    """Ticks of a colocated fleet computing q prefill tokens per decode token (half a new
    token), to the first change."""
    changes: list = []
    for tick in range(ticks):
        changes = policy.decide(demand, _fleet([C] * 4, 100.0 + 2 * tick, int(q * 1_000_000) * tick, 1_000_000 * tick, held))
        if changes:
            break
    return changes


def test_a_saturated_colocated_fleet_splits_where_the_split_turns_over_more():
    """Working set past the fleet's KV: the demand's flows no longer tell the arrangements
    apart, and the KV-fit veto (a split's decode side cannot hold it) would keep colocation;
    the throughput model splits, once the saving pays for the switches."""
    cap = CapacityModel(DEEPSEEK, 2.0).at(CONTEXT_TOKENS)
    held = int(1.5 * 4 * cap.colocated_kv_tokens)
    demand = Demand(2e5, 1000, CONTEXT_TOKENS, "test", kv_working_set_tokens=held, prefill_new_tokens_per_s=2e4)
    policy = Split("prorsa", DEEPSEEK, AllocatorSection(decision="rules", saturated_regime=True))
    assert policy.decide(demand, _fleet([C] * 4, 100.0, 0, 0, held)) == []  # nothing measured yet
    assert policy.last_reason.startswith("colocated: colocated load")  # no reading of q: the load rules judge
    changes = _run_colocated(policy, demand, held)
    assert changes and {c.role for c in changes} == {P, D}, policy.last_reason
    assert "saturated" in policy.last_reason
    # off, on a fleet whose decode side keeps the histories (no write-back): the veto stands
    # (with write-back there is no veto, and the load rules judge alone)
    off = Split("prorsa", deepseek(kv_writeback="none"), AllocatorSection(decision="rules", saturated_regime=False))
    assert _run_colocated(off, demand, held) == [] and "would not fit" in off.last_reason
    p = sum(c.role is P for c in changes)
    assert abs(saturated_ratio(policy.ratios, histories_follow=False) - 10.0) < 1e-9  # 95% recomputed: every arrangement's q
    rates = {k: split_rate(cap, 4, k, 10.0, 1.0) for k in (1, 2, 3)}
    assert rates[p] == max(rates.values()) > colocated_rate(cap, 4, 10.0)
    # greedy admission: a decode side past its KV preempts without end, the veto stands
    assert (
        _run_colocated(Split("prorsa", deepseek(admission="vllm"), AllocatorSection(decision="rules", saturated_regime=True)), demand, held)
        == []
    )


def test_a_fleet_whose_caches_keep_its_histories_is_judged_by_the_saturated_model_only_with_write_back():
    """Past its KV on paper, but recomputing little (0.6 prefill tokens per decode token for
    0.5 new). Without KV write-back a split's decode engines would keep the histories from
    its prefill side, which would recompute far more, and the model cannot tell how much: the
    KV-fit veto stands. With write-back the histories follow the turns to the prefill side
    (a split computes about what colocation does): the model judges, and the fleet splits."""
    cap = CapacityModel(DEEPSEEK, 2.0).at(CONTEXT_TOKENS)
    held = int(1.5 * 4 * cap.colocated_kv_tokens)
    demand = Demand(2e5, 1000, CONTEXT_TOKENS, "test", kv_working_set_tokens=held, prefill_new_tokens_per_s=2e4)
    policy = Split("prorsa", deepseek(kv_writeback="none"), AllocatorSection(decision="rules", saturated_regime=True))
    assert _run_colocated(policy, demand, held, q=0.6) == [] and "would not fit" in policy.last_reason
    assert abs(policy.ratios.reading()[1] - 0.6) < 1e-9 and saturated_ratio(policy.ratios, histories_follow=False) is None
    policy = Split("prorsa", DEEPSEEK, AllocatorSection(decision="rules", saturated_regime=True))
    changes = _run_colocated(policy, demand, held, q=0.6, ticks=800)  # bought once colocation has lost its cost
    assert {c.role for c in changes} == {P, D} and "saturated" in policy.last_reason


def test_a_split_in_a_saturated_fleet_is_held_or_undone_by_the_rating_never_resized_by_it():
    """Once split, a saturated fleet goes back to colocation when colocation turns over more,
    else holds: a resize between splits is not judged by readings taken while the split still
    recomputes what it relocated (it went 2:2 -> 3:1 on such a reading, DeepSeek SWE at 32
    per GPU), and with no reading at all the load rules, which cannot judge a saturated
    fleet, do not undo it either."""
    cap = CapacityModel(DEEPSEEK, 2.0).at(CONTEXT_TOKENS)
    held = int(1.5 * 4 * cap.colocated_kv_tokens)
    demand = Demand(2e5, 1000, CONTEXT_TOKENS, "test", kv_working_set_tokens=held, prefill_new_tokens_per_s=2e4)
    policy = Split("prorsa", DEEPSEEK, AllocatorSection(decision="rules", saturated_regime=True, min_dwell_s=0.0))
    roles = [P, D, D, D]  # 1:3; the rating's best is another split
    rates = {k: split_rate(cap, 4, k, 10.0, 1.0) for k in (1, 2, 3)}
    assert max(rates, key=rates.get) != 1
    for tick in range(200):
        changes = policy.decide(demand, _fleet(roles, 1000.0 + 2 * tick, 10_000_000 * tick, 1_000_000 * tick, held))
        assert changes == [], policy.last_reason
    assert policy.last_reason.startswith("hold 1:3, saturated")
    fresh = Split("prorsa", DEEPSEEK, AllocatorSection(decision="rules", saturated_regime=True, min_dwell_s=0.0))
    assert fresh.decide(demand, _fleet(roles, 1000.0, 0, 0, held)) == []
    assert "no prefill-per-decode reading" in fresh.last_reason


def test_a_saturated_fleet_prices_a_split_on_the_kv_its_live_trajectories_hold():
    """A saturated colocated fleet holds, beside the live trajectories' KV, finished ones'
    prefixes that it evicts as it needs room: a split relocates only the live KV, so the same
    saving buys it sooner where the live trajectories hold less (below saturation the held KV
    stays the measure)."""
    cap = CapacityModel(DEEPSEEK, 2.0).at(CONTEXT_TOKENS)
    held = int(1.5 * 4 * cap.colocated_kv_tokens)
    all_live = Demand(2e5, 1000, CONTEXT_TOKENS, "test", kv_working_set_tokens=held, prefill_new_tokens_per_s=2e4, live_context_tokens=held)
    some_live = replace(all_live, live_context_tokens=0.3 * held)
    assert abs(relocation_s(some_live, cap, 2, 4, saturated=True) - 0.3 * relocation_s(all_live, cap, 2, 4, saturated=True)) < 1e-6
    assert relocation_s(some_live, cap, 2, 4) == relocation_s(all_live, cap, 2, 4)  # below saturation: what is held

    def split_tick(demand: Demand) -> int:
        policy = Split("prorsa", DEEPSEEK, AllocatorSection(decision="rules", saturated_regime=True))
        for tick in range(400):
            if policy.decide(demand, _fleet([C] * 4, 100.0 + 2 * tick, 10_000_000 * tick, 1_000_000 * tick, held)):
                assert "saturated" in policy.last_reason
                return tick
        raise AssertionError(f"no split in 400 ticks: {policy.last_reason}")

    assert split_tick(some_live) < split_tick(all_live)


def test_a_saturated_fleets_tail_buys_no_split():
    """A step's tail: the engines' KV is still full of finished trajectories' prefixes, so the
    fleet reads saturated, but a few sequences are left. The rates are a busy fleet's; a split
    saves only what it would of the work there is, which pays for nothing."""
    cap = CapacityModel(DEEPSEEK, 2.0).at(CONTEXT_TOKENS)
    held = int(1.5 * 4 * cap.colocated_kv_tokens)
    live = {"kv_working_set_tokens": held, "live_context_tokens": 0.5 * held}  # the forecaster knows what the live ones hold
    busy = Demand(2e5, 1000, CONTEXT_TOKENS, "test", prefill_new_tokens_per_s=2e4, **live)
    tail = Demand(300.0, 0.5, CONTEXT_TOKENS, "test", prefill_new_tokens_per_s=30.0, **(live | {"live_context_tokens": 8 * CONTEXT_TOKENS}))
    assert _run_colocated(Split("prorsa", DEEPSEEK, AllocatorSection(decision="rules", saturated_regime=True)), busy, held)
    policy = Split("prorsa", DEEPSEEK, AllocatorSection(decision="rules", saturated_regime=True))
    assert _run_colocated(policy, tail, held) == [], policy.last_reason
    assert "saturated" in policy.last_reason  # the regime judged it, and bought nothing


def moe_dp4(**engines) -> EngineSection:
    """The bench's moe-stage fleet with its stage layouts off: 8 engines of 4 GPUs, every role
    DP attention + EP4 (the ablation row where a split's prefill side kept too few histories)."""
    return EngineSection(count=8, preset="h200-qwen3-30b-a3b", layout=LayoutSection(dp=4, ep=4), **engines)


def test_an_arrangement_that_keeps_fewer_live_histories_is_rated_at_the_recompute_it_adds():
    """Write-back to the prefill side: a split keeps every live history in its prefill
    engines' pools, colocation in every engine's. Histories that just fit the colocated pools
    fit a quarter of them in 2:6, so 2:6 misses 3 of 4 turns, each recomputing its history."""
    cap = CapacityModel(moe_dp4(), 2.0).at(20_000)
    assert cap.histories_on_prefill and cap.prefill_kv_tokens == cap.colocated_kv_tokens
    live = history_pools_tokens(cap, 8, 0)  # the colocated pools, exactly full
    assert history_pools_tokens(cap, 8, 2) == live / 4
    assert history_miss_share(live, history_pools_tokens(cap, 8, 0)) == 0.0
    assert abs(history_miss_share(live, history_pools_tokens(cap, 8, 2)) - 0.75) < 1e-12
    q, per_decode = 2.0, 24.0  # 24 history tokens per decode token: 20k-token histories, 830 decode tokens a turn
    assert arrangement_ratio(q, 0.5, cap, 8, 0, 0, live, 0.0, per_decode) == q  # what was measured
    assert abs(arrangement_ratio(q, 0.5, cap, 8, 2, 0, live, 0.0, per_decode) - (q + 0.75 * per_decode)) < 1e-9
    assert (
        q < arrangement_ratio(q, 0.5, cap, 8, 4, 0, live, 0.0, per_decode) < arrangement_ratio(q, 0.5, cap, 8, 2, 0, live, 0.0, per_decode)
    )
    # read in 2:6 (its misses in the reading, with whatever it relocated), colocation is rated
    # at that reading, not credited for the histories it would keep
    assert arrangement_ratio(20.0, 0.5, cap, 8, 0, 2, live, 0.0, per_decode) == 20.0
    # histories that fit every arrangement's pools, or kept elsewhere (no write-back: on the
    # decode engines; a store tier: for any engine): one q for all
    assert arrangement_ratio(q, 0.5, cap, 8, 2, 0, live / 5, 0.0, per_decode) == q
    for writeback in ("none", "store"):
        other = CapacityModel(moe_dp4(kv_writeback=writeback), 2.0).at(20_000)
        assert arrangement_ratio(q, 0.5, other, 8, 2, 0, live, 0.0, per_decode) == q
    # histories past the colocated pools, and colocation already recomputing most of them (q
    # 20.5: 20 tokens a decode token beyond the new ones, 5 in 6 turns miss; its pools keep
    # less than the model's 90%, as they also hold the decoding sequences' growth): a split's
    # pools, scaled alike, miss at most every turn, and 3:5 adds only what that leaves
    thrashing = 2 * live
    miss_coloc = 20.0 / per_decode
    assert arrangement_ratio(20.5, 0.5, cap, 8, 0, 0, thrashing, 0.0, per_decode) == 20.5
    kept_3_5 = (1 - miss_coloc) * thrashing * 3 / 8
    expected = 20.5 + (1 - kept_3_5 / thrashing - miss_coloc) * per_decode
    assert abs(arrangement_ratio(20.5, 0.5, cap, 8, 3, 0, thrashing, 0.0, per_decode) - expected) < 1e-9
    unscaled = (
        history_miss_share(thrashing, history_pools_tokens(cap, 8, 3)) - history_miss_share(thrashing, history_pools_tokens(cap, 8, 0))
    ) * per_decode
    assert 0 < expected - 20.5 < 3.0 < unscaled  # 2.5 where the pools as sized would add 7.5


def test_a_saturated_fleet_rates_a_split_at_the_histories_its_prefill_side_cannot_keep():
    """The ablation row at 409 s (moe-stage SWE at 64 per GPU, stage layouts off): 1,645 live
    trajectories hold 31.9M tokens of history, the colocated pools' worth, 1,474 of them
    decoding; colocation computes 2.1 prefill tokens per decode token. Rated at that q, 2:6
    turns over 1.32x colocation and was bought; its two prefill engines then missed most
    histories and the row lost 2.9%. With the turns counted, 2:6 is rated at the histories
    its prefill pools cannot keep (all but what its six decode engines hold while they
    decode) and falls below colocation; without them, one q for all, as before. (That
    row gave every DP rank the whole prefill chunk and no engine a host KV tier.)"""
    engines = moe_dp4(dp_chunk="full", host_kv_tier=False)
    demand = Demand(
        50_979.0,
        1_474.0,
        20_185.0,
        "test",
        remote_share=0.65,
        kv_working_set_tokens=35.7e6,
        prefill_new_tokens_per_s=20_657.0,
        live_trajectories=1_645.0,
        live_context_tokens=31.9e6,
    )
    cap = CapacityModel(engines, 2.0).at(demand.decode_context_tokens)

    def ratings(turns_counted: bool) -> list[float]:
        policy = Split("prorsa", engines, AllocatorSection(decision="rules", saturated_regime=True))
        for tick in range(2 * RATIO_MIN_TICKS):  # a window of colocation's reading, then a few ticks
            decoded = 1_000_000 * tick
            fleet = _fleet([C] * 8, 400.0 + 2 * tick, int(2.1 * decoded), decoded, int(35.7e6))
            fleet = replace(fleet, new_tokens_total=int(0.66 * decoded), turns_total=decoded // 830 if turns_counted else 0)
            policy.decide(demand, fleet)
        assert abs(policy.ratios.reading()[1] - 2.1) < 1e-6
        return arrangement_ratios(policy.ratios, demand, cap, 8, 2.1)

    one_q = ratings(turns_counted=False)
    assert one_q == [2.1] * 8
    assert split_rate(cap, 8, 2, 2.1, 1.0) > 1.3 * colocated_rate(cap, 8, 2.1)  # what bought 2:6
    qs = ratings(turns_counted=True)
    assert qs[0] == 2.1 and all(a >= b for a, b in zip(qs[1:], qs[2:]))  # fewer prefill pools, more recompute
    assert qs[2] > 4.0 and split_rate(cap, 8, 2, qs[2], 1.0) < colocated_rate(cap, 8, qs[0])


def test_a_fleet_with_fewer_live_trajectories_than_its_pools_hold_decodes_them_at_their_own_batch():
    """The ablation row's tail at 691 s (160 live trajectories, 8 engines whose pools hold 244
    sequences each at the context): the rates count a step of at most the live trajectories,
    and a smaller batch's shorter step, not the KV-bound batch the pools would hold."""
    cap = CapacityModel(moe_dp4(), 2.0).at(30_667)
    full = cap.colocated_kv_seqs
    assert full > 200 and cap.kv_step_s_at(full, colocated=True) == cap.colocated_kv_step_s
    # the step shrinks with the batch, but not in proportion (weights and ranks' fixed costs)
    small_s = cap.kv_step_s_at(20, colocated=True)
    assert 20 / full * cap.colocated_kv_step_s < small_s < cap.colocated_kv_step_s
    assert colocated_rate(cap, 8, 0.73, live=None) == colocated_rate(cap, 8, 0.73, live=10 * 8 * full)
    tail = colocated_rate(cap, 8, 0.73, live=160.0)
    assert tail < 0.6 * colocated_rate(cap, 8, 0.73)
    assert abs(tail - lockstep_rate(160 / small_s, 0.73 * cap.colocated_prefill_s_per_token / 8, cap.colocated_lockstep_ranks)) < 1e-6
    # fewer decodes bring less prefill to stall the lockstep groups: a split's edge shrinks
    edge = max(split_rate(cap, 8, p, 0.73, 1.0) for p in (1, 2)) / colocated_rate(cap, 8, 0.73)
    tail_edge = max(split_rate(cap, 8, p, 0.73, 1.0, live=160.0) for p in (1, 2)) / tail
    assert 1.0 < tail_edge < edge - 0.04


def test_a_host_tier_keeps_histories_in_host_memory_too():
    """With a host KV tier every history pool is 1 + host_kv_ratio times its GPU pool, so a
    split whose prefill side cannot keep every live history on the GPU misses fewer."""
    with_tier = CapacityModel(moe_dp4(host_kv_ratio=2.0), 2.0).at(16_000)
    without = CapacityModel(moe_dp4(host_kv_tier=False), 2.0).at(16_000)
    assert with_tier.history_kv_scale == 3.0 and without.history_kv_scale == 1.0
    for p in (0, 2):
        assert history_pools_tokens(with_tier, 8, p) == pytest.approx(3.0 * history_pools_tokens(without, 8, p))
    kept = 1.5 * history_pools_tokens(without, 8, 2)
    assert history_miss_share(kept, history_pools_tokens(with_tier, 8, 2)) < history_miss_share(kept, history_pools_tokens(without, 8, 2))
