"""Demand forecasting from the lifecycle log (pure library; see DESIGN.md section 5)."""
