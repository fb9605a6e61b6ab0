"""What the allocator learns of the engines' speed: the engines' own step times against their
prior cost model (actors/engine/timing.py), blended into its capacities
(actors/allocator/measured.py), and engines whose truth differs from that prior
(`engines.truth`)."""

from __future__ import annotations

import msgspec
import polars as pl
import pytest

from actors.allocator.capacity import CapacityModel, Scales, scaled_capacity
from actors.allocator.measured import PRIOR_ITERATIONS, MeasuredSpeed
from actors.config import Config, EngineSection, load_config
from actors.engine.core import EngineCore
from actors.engine.emulated.costmodel import PRESETS, scaled
from bus_schemas.control import Role
from bus_schemas.status import EngineTiming, IterationTimes
from runners.simulate import run
from tests.conftest import write_tiny_config
from tests.test_engine_core import work

PRESET = PRESETS["h100-qwen3-8b"]


def run_core(truth, prior) -> EngineTiming:
    core = EngineCore("e0", Role.COLOCATED, truth, 2048, 16, 8, prior=prior)
    for i in range(4):
        core.admit_prefill(work(f"t{i}", new=3000 + 100 * i))
    while (batch := core.plan(1.0)) is not None:
        core.complete(batch)
    return core.timing.report()


def test_an_engine_that_runs_its_prior_reports_prior_time_equal_to_what_it_ran():
    timing = run_core(PRESET, None)
    assert timing.prefill.iterations > 0 and timing.decode_short.iterations > 0
    for kind in ("prefill", "prefill_short", "decode", "decode_short", "mixed", "mixed_short"):
        t = getattr(timing, kind)
        assert t.busy_s == t.prior_s


def test_an_engine_slower_than_its_prior_reports_both_times_for_the_same_steps():
    slow = scaled(PRESET, prefill=1.3, decode=0.75)
    truth, prior = run_core(slow, PRESET), run_core(PRESET, None)
    # full chunks are bound by the prefill compute: about 1.3x; decode steps by the weights: 0.75-0.8x
    assert 1.2 < truth.prefill.busy_s / truth.prefill.prior_s <= 1.3
    assert 0.75 <= truth.decode_short.busy_s / truth.decode_short.prior_s < 0.85
    # the prior time of those steps is what the prior engine itself took for the same work
    assert truth.prefill.prior_s == pytest.approx(prior.prefill.busy_s, rel=1e-9)
    assert truth.prefill.prefill_tokens == prior.prefill.prefill_tokens


def test_steps_of_short_chunks_or_a_part_empty_pool_are_counted_apart():
    from actors.engine.sequence import Batch
    from actors.engine.timing import kind_of

    core = EngineCore("e0", Role.COLOCATED, PRESET, 2048, 16, 8)
    core.admit_prefill(work("a", new=2100))
    core.admit_prefill(work("b", new=30))
    full = core.plan(1.0)
    assert kind_of(full, 2048) == "prefill"
    core.complete(full)
    assert kind_of(core.plan(1.0), 2048) == "prefill_short"  # 52 + 30 tokens of 2048
    decode = Batch([], [object()], 1, 0.01)
    assert kind_of(decode, 2048) == "decode_short"
    decode.kv_full = True
    assert kind_of(decode, 2048) == "decode"


def times(busy_s: float, prior_s: float, steps: int) -> IterationTimes:
    return IterationTimes(iterations=steps, busy_s=busy_s, prior_s=prior_s)


def test_exact_engines_leave_every_capacity_as_the_prior_gives_it():
    speed = MeasuredSpeed()
    for n in range(1, 6):
        report = EngineTiming(prefill=times(0.1 * n, 0.1 * n, 10 * n), decode=times(0.3 * n, 0.3 * n, 50 * n))
        speed.observe("e0", "a", report, 1000, 1000)
        speed.tick()
    assert speed.scales() == Scales() and speed.scales().unit
    cap = CapacityModel(EngineSection(preset="h100-qwen3-8b"), 2.0).at(4096)
    assert scaled_capacity(cap, speed.scales()) is cap


def test_measurements_overrule_the_prior_as_they_accumulate_count_weighted():
    speed = MeasuredSpeed()
    speed.observe("e0", "a", EngineTiming(prefill=times(1.3, 1.0, 20)), 800, 1000)
    # 20 steps at 1.3 against the prior's PRIOR_ITERATIONS at 1.0
    assert speed.factor("prefill") == pytest.approx((PRIOR_ITERATIONS + 20 * 1.3) / (PRIOR_ITERATIONS + 20))
    speed.observe("e0", "a", EngineTiming(prefill=times(131.3, 101.0, 2020)), 800, 1000)
    assert speed.factor("prefill") == pytest.approx(1.3, rel=0.01)
    scales = speed.scales()
    # no mixed step seen: mixed starts from the prefill factor; no decode step: from 1
    assert scales.mixed == pytest.approx(scales.prefill) and scales.decode == 1.0
    assert scales.kv == pytest.approx(0.8)


def test_a_restarted_engine_counts_from_zero_again_and_a_reordered_report_is_skipped():
    speed = MeasuredSpeed()
    speed.observe("e0", "a", EngineTiming(decode=times(50.0, 100.0, 1000)), 1, 1)
    before = list(speed.sums["decode"])
    speed.observe("e0", "a", EngineTiming(decode=times(40.0, 80.0, 900)), 1, 1)  # older than the last
    assert speed.sums["decode"] == before
    speed.observe("e0", "b", EngineTiming(decode=times(5.0, 10.0, 100)), 1, 1)  # a new incarnation
    assert speed.sums["decode"] == [before[0] + 5.0, before[1] + 10.0, before[2] + 100]


def test_learned_capacities_scale_the_prior_and_resize_the_batches_the_pools_hold():
    engines = msgspec.convert({"preset": "h200-deepseek-v3-fp8", "layout": {"dp": 8, "ep": 8}}, EngineSection)
    cap = CapacityModel(engines, 2.0).at(8192)
    learned = scaled_capacity(cap, Scales(prefill=1.3, decode=0.8, mixed=1.5, kv=0.5))
    assert learned.prefill_s_per_token == pytest.approx(1.3 * cap.prefill_s_per_token)
    assert learned.colocated_prefill_s_per_token == pytest.approx(1.5 * cap.colocated_prefill_s_per_token)
    assert learned.min_tpot_s == pytest.approx(0.8 * cap.min_tpot_s)
    assert learned.decode_kv_tokens == round(0.5 * cap.decode_kv_tokens)
    assert learned.decode_kv_seqs == round(0.5 * cap.decode_kv_seqs)
    # half the batch: a shorter step, read along the prior's slope, then 0.8x
    half = cap.decode_kv_step_s - cap.decode_step_s_per_seq * (cap.decode_kv_seqs - learned.decode_kv_seqs)
    assert learned.decode_kv_step_s == pytest.approx(0.8 * half)


def test_truth_is_for_emulated_engines_and_names_known_presets_that_fit():
    with pytest.raises(msgspec.ValidationError, match="emulated engines only"):
        msgspec.convert({"backend": "torch", "truth": {"prefill": 1.3}}, EngineSection)
    with pytest.raises(msgspec.ValidationError, match="unknown engines.truth.preset"):
        msgspec.convert({"truth": {"preset": "a100-qwen3-8b"}}, EngineSection)
    with pytest.raises(msgspec.ValidationError, match="engines.truth"):  # DeepSeek-V3 on 8 H100s: 640 GB
        msgspec.convert(
            {"preset": "h200-deepseek-v3-fp8", "layout": {"dp": 8, "ep": 8}, "truth": {"preset": "h100-deepseek-v3-fp8"}}, EngineSection
        )
    with pytest.raises(msgspec.ValidationError, match="spread"):
        msgspec.convert({"truth": {"spread": 1.0}}, EngineSection)


def test_engines_of_one_fleet_differ_within_the_spread_and_the_fleet_truth_has_none():
    engines = msgspec.convert({"preset": "h100-qwen3-8b", "truth": {"prefill": 1.3, "spread": 0.1}}, EngineSection)
    mean = engines.truth_preset(Role.PREFILL)
    assert mean.t_tok_s == pytest.approx(1.3 * PRESET.t_tok_s)
    own = [engines.truth_preset(Role.PREFILL, f"e{i}").t_tok_s / PRESET.t_tok_s for i in range(8)]
    assert all(1.3 * 0.9 <= f <= 1.3 * 1.1 for f in own) and len(set(own)) == 8
    assert own[0] == engines.truth_preset(Role.PREFILL, "e0").t_tok_s / PRESET.t_tok_s  # fixed per engine
    assert EngineSection(preset="h100-qwen3-8b").truth_preset(Role.DECODE, "e0") == EngineSection(preset="h100-qwen3-8b").cost_preset(
        Role.DECODE
    )


def simulate_with_truth(tmp_path, capacity: str) -> pl.DataFrame:
    path = write_tiny_config(tmp_path / f"{capacity}.toml", policy="prorsa", steps=2)
    text = path.read_text().replace("[engines]\n", "[engines]\ntruth = { decode = 0.75, kv = 0.8, spread = 0.1 }\n")
    path.write_text(text + f'\n[allocator]\ncapacity = "{capacity}"\n')
    config = load_config(path)
    assert isinstance(config, Config) and not config.engines.truth.exact
    summary = run(config, tmp_path / capacity, show_progress=False)
    assert summary["status"] == "completed" and summary["trajectories_lost"] == 0
    return pl.read_parquet(tmp_path / capacity / "allocations.parquet")


def test_a_run_on_engines_unlike_their_prior_learns_their_speed_and_pools(tmp_path):
    measured, model = simulate_with_truth(tmp_path, "measured"), simulate_with_truth(tmp_path, "model")
    last = measured.tail(1).to_dicts()[0]
    assert last["capacity_kv_scale"] == pytest.approx(0.8, abs=0.01)
    assert 0.7 < last["capacity_decode_scale"] < 0.9  # decode steps 0.75x, their fixed overheads not
    # priced by the cost model alone, the same run keeps the prior's figures
    assert set(model["capacity_decode_scale"]) == {1.0} and set(model["capacity_kv_scale"]) == {1.0}
