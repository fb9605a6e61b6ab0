"""The lockstep mechanism check (runners/lockstep_check.py): a DP-attention engine whose
ranks prefill out of step loses input throughput, by as much as published measurements
report at a serving benchmark's concurrency; engines without DP attention lose nothing."""

from runners.lockstep_check import PUBLISHED_LOSS, check


def test_desynchronised_prefill_loses_throughput_within_the_published_range():
    result = check("h200-deepseek-v3-fp8", "sglang")
    low, high = PUBLISHED_LOSS
    assert low <= result.loss <= high, f"{result.loss:.1%} outside {low:.0%}-{high:.0%}"


def test_a_single_rank_engine_has_no_ranks_to_fall_out_of_step():
    assert abs(check("h200-qwen3-30b-a3b", "sglang").loss) < 0.01
