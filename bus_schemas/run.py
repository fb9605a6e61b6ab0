"""Run-wide facts every actor agrees on, kept in a JetStream key-value bucket."""

from __future__ import annotations

import msgspec

RUN_BUCKET = "prorsa_run"
ORIGIN_KEY = "origin"


class RunOrigin(msgspec.Struct, frozen=True, kw_only=True):
    """Model time 0 of the run. Model time = (wall time - origin_wall_s) * time_scale."""

    origin_wall_s: float  # Unix time, seconds
    run_name: str = ""
