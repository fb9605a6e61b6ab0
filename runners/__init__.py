"""Offline runners: replay of recorded logs, virtual-time simulation and benchmarks (see docs/simulation.md, docs/forecasting.md, docs/allocation.md and docs/calibration.md)."""
