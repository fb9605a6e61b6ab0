"""Forecast accuracy per horizon: MAE, sMAPE, MASE against naive, pinball loss and coverage.

All functions take aligned 1-d arrays over the evaluation points of one (target, horizon):
`actual[i]` is what happened in the bin that forecast i was for. MASE here is the ratio of
the model's MAE to the naive (last value) forecast's MAE on the same points and horizon,
so naive scores 1 and < 1 is better than naive.
"""

from __future__ import annotations

import numpy as np


def mae(actual: np.ndarray, forecast: np.ndarray) -> float:
    return float(np.mean(np.abs(actual - forecast))) if len(actual) else float("nan")


def smape(actual: np.ndarray, forecast: np.ndarray) -> float:
    """Symmetric MAPE in [0, 2]; a bin where both are 0 counts as a perfect forecast."""
    if not len(actual):
        return float("nan")
    denom = np.abs(actual) + np.abs(forecast)
    ratio = np.divide(2 * np.abs(actual - forecast), denom, out=np.zeros_like(denom, dtype=float), where=denom > 0)
    return float(ratio.mean())


def mase(actual: np.ndarray, forecast: np.ndarray, naive: np.ndarray) -> float:
    scale = mae(actual, naive)
    if not scale > 0:
        return float("nan")  # naive was perfect (or no points): the ratio means nothing
    return mae(actual, forecast) / scale


def pinball(actual: np.ndarray, quantiles: np.ndarray, levels: tuple[float, ...]) -> float:
    """Mean pinball (quantile) loss over the levels; quantiles has shape (len(levels), n)."""
    if not len(actual):
        return float("nan")
    losses = []
    for q, pred in zip(levels, quantiles):
        diff = actual - pred
        losses.append(np.mean(np.maximum(q * diff, (q - 1) * diff)))
    return float(np.mean(losses))


def coverage(actual: np.ndarray, lower: np.ndarray, upper: np.ndarray) -> float:
    """Share of actuals inside [lower, upper]."""
    if not len(actual):
        return float("nan")
    return float(np.mean((actual >= lower) & (actual <= upper)))
