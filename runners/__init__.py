"""Offline runners: replay of recorded logs and benchmarks (see DESIGN.md sections 5 and 7)."""
