"""Demand forecasting from the lifecycle log (pure library; see docs/forecasting.md)."""
