"""The validation set: published H100/H200 measurements that set no constant (docs/calibration.md,
"Validation set"). These are the honest figures; the fitting set in test_costmodel.py only guards
against regressions."""

from __future__ import annotations

import statistics

import pytest

from runners.calibration import POINTS, VALIDATION, evaluate_validation, summary


def test_validation_and_fitting_sets_are_disjoint_and_sourced():
    assert not {p.point for p in VALIDATION} & {p.point for p in POINTS}
    for p in VALIDATION:
        assert p.url.startswith("https://") and p.setting and p.tag in ("[M]", "[D]") and p.covers


def test_summary_is_the_median_and_max_of_the_h100_h200_time_errors():
    records = evaluate_validation()
    errors = [abs(r["time_error"]) for r in records if r["gpu"] in ("h100", "h200")]
    s = summary(records)
    assert s["points"] == len(errors) >= 9
    assert s["median_abs_time_error"] == pytest.approx(statistics.median(errors), abs=1e-4)
    assert s["max_abs_time_error"] == pytest.approx(max(errors), abs=1e-4)


@pytest.mark.parametrize("regime", ["prefill tp>=2", "moe small batch", "fp8"])
def test_each_named_regime_has_a_validation_point_within_20_percent(regime):
    """TP prefill, MoE small-batch decode and FP8 small-batch decode each within 20% somewhere."""
    errors = [abs(r["time_error"]) for r in evaluate_validation() if regime in r["covers"]]
    assert errors and min(errors) <= 0.20


def test_validation_median_meets_its_target():
    assert summary(evaluate_validation())["median_abs_time_error"] <= 0.10


@pytest.mark.xfail(
    strict=True,
    reason="not met: small-batch BF16 decode on H200 from vLLM's CI (Llama-3-70B TP4 -24.5%, Llama-3.1-8B -18.8%) "
    "runs slower than the model predicts; see docs/calibration.md 'Open gaps'. Strict: remove this mark when it passes.",
)
def test_validation_max_meets_its_target():
    assert summary(evaluate_validation())["max_abs_time_error"] <= 0.20
