"""The forecaster actor: lifecycle events in, demand forecasts out (forecasting.core)."""
