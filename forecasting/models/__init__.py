"""Forecasting models behind one interface (base.Forecaster), registered by name."""

from forecasting.models import hybrid, lifecycle, timeseries  # noqa: F401  (registers the models)
from forecasting.models.base import QUANTILES, REGISTRY, TARGETS, FitError, Forecaster, History, Prediction, make

__all__ = ["QUANTILES", "REGISTRY", "TARGETS", "FitError", "Forecaster", "History", "Prediction", "make"]
