"""Prefill and decode engine-seconds: the series weighs each prefill and each decode by the
cost model, and the lifecycle model prices each live trajectory's next prefill, and each
running decode, on its own context."""

from __future__ import annotations

import numpy as np
import pytest

from forecasting import series
from forecasting.core import CoreConfig, ForecastCore
from forecasting.series import TokenCost
from forecasting.synthetic import synthetic_log

COST = TokenCost(per_token_s=2e-5, per_token_pair_s=1e-8)  # attention-heavy: the context matters
DECODE_COST = TokenCost(per_token_s=1e-4, per_token_pair_s=2e-8)  # a KV read per context token


def _core(cost: TokenCost, until_s: int = 40, decode_cost: TokenCost = series.UNIT_COST) -> ForecastCore:
    events = synthetic_log(60, seed=2, spread_s=20.0, min_turns=6, max_turns=10)
    core = ForecastCore(CoreConfig(models=("lifecycle",), horizons_s=(1.0, 10.0), prefill_cost=cost, decode_cost=decode_cost))
    at_s = events["at_s"].to_numpy()
    start = 0
    for t in range(1, until_s + 1):
        cut = int(np.searchsorted(at_s, t))
        core.tick(events.slice(start, cut - start), float(t))
        start = cut
    return core


def test_the_series_weighs_a_prefill_by_its_tokens_and_its_context():
    events = synthetic_log(20, seed=4, spread_s=10.0)
    binned = series.bin_events(events, 1.0, cost=COST)
    done = events.filter(events["kind"] == "prefill_done")
    miss = (done["context_tokens"] - done["cached_prefix_tokens"] + done["new_tokens"]).to_numpy().astype(float)
    prefix = done["cached_prefix_tokens"].to_numpy().astype(float)
    expected = (COST.per_token_s * miss + COST.per_token_pair_s * miss * (prefix + miss / 2)).sum()
    assert sum(series.totals(binned, "prefill_engine_s")) == pytest.approx(expected)
    unit = series.bin_events(events, 1.0)  # no cost model: engine-seconds count the tokens
    assert series.totals(unit, "prefill_engine_s") == series.totals(unit, "prefill_miss_tokens")


def test_a_longer_context_makes_the_next_prefill_cost_more():
    core = _core(COST)
    model = core.models["lifecycle"]
    before = model.predict(10)
    core.live.context[core.live.alive] *= 2.0  # every live trajectory twice as deep into its episode
    after = model.predict(10)
    # the synthetic log caches the whole context: the missed tokens stay, their attention cost grows
    assert np.allclose(after.mean["prefill_miss_tokens"], before.mean["prefill_miss_tokens"])
    assert after.mean["prefill_engine_s"].sum() > 1.05 * before.mean["prefill_engine_s"].sum()


def test_without_a_cost_model_engine_seconds_forecast_the_missed_tokens():
    prediction = _core(series.UNIT_COST).models["lifecycle"].predict(10)
    assert np.allclose(prediction.mean["prefill_engine_s"], prediction.mean["prefill_miss_tokens"])
    assert prediction.mean["prefill_engine_s"].sum() > 0


def test_the_series_weighs_a_decode_by_its_tokens_and_the_context_it_reads():
    events = synthetic_log(20, seed=4, spread_s=10.0)
    binned = series.bin_events(events, 1.0, cost=COST, decode_cost=DECODE_COST)
    done = events.filter(events["kind"] == "decode_done")
    generated = done["generated_tokens"].to_numpy().astype(float)
    context = (done["context_tokens"] + done["new_tokens"]).to_numpy().astype(float)
    assert context.max() > 0
    expected = (DECODE_COST.per_token_s * generated + DECODE_COST.per_token_pair_s * generated * (context + generated / 2)).sum()
    assert sum(series.totals(binned, "decode_engine_s")) == pytest.approx(expected)
    totals, _ = series.chunk_totals(
        events, 0.0, float(len(series.totals(binned, "decode_engine_s"))), 1.0, cost=COST, decode_cost=DECODE_COST
    )
    assert np.allclose(totals["decode_engine_s"], series.totals(binned, "decode_engine_s"))  # the forecaster's per-tick path agrees
    unit = series.bin_events(events, 1.0)  # no cost model: engine-seconds count the tokens
    assert series.totals(unit, "decode_engine_s") == series.totals(unit, "decode_tokens")


def test_a_running_decode_on_a_longer_context_costs_more():
    core = _core(COST, decode_cost=DECODE_COST)
    live, model = core.live, core.models["lifecycle"]
    decoding = live.alive & (live.phase == 1)
    assert decoding.sum() > 0
    before = model.predict(10)
    live.context[decoding] *= 3.0  # only the running decodes read a longer context
    after = model.predict(10)
    assert np.allclose(after.mean["decode_tokens"], before.mean["decode_tokens"])
    assert after.mean["decode_engine_s"][:3].sum() > 1.2 * before.mean["decode_engine_s"][:3].sum()
    stats = live.stats["*"]  # the decodes that start later: at the family's learned sizes
    assert stats.decode_engine_s.n == stats.gen_tokens.n > 0


def test_without_a_cost_model_decode_engine_seconds_forecast_the_decode_tokens():
    prediction = _core(series.UNIT_COST).models["lifecycle"].predict(10)
    assert np.allclose(prediction.mean["decode_engine_s"], prediction.mean["decode_tokens"])
    assert prediction.mean["decode_engine_s"].sum() > 0
