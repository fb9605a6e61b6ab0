"""Async rollout draws the same tasks as sync: group i is task i % B of batch i // B, so a
workload whose mix shifts between steps is rolled out alike in both modes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import polars as pl

from runners.rollout import _WORKLOADS, SUITES, Case, run_config
from runners.simulate import run


def test_async_rolls_out_the_task_families_sync_does(tmp_path: Path):
    suite = SUITES["smoke"]
    shift = replace(next(w for w in _WORKLOADS if w.name == "shift"), overrides={"swe": {"turns_max": 2}})
    families = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        run(run_config(suite, Case("main", suite.fleets[0], shift, 4, mode=mode), "colocated"), out, show_progress=False)
        started = pl.read_parquet(out / "events.parquet").filter(pl.col("kind") == "started")
        families[mode] = dict(started.group_by("task_family").len().iter_rows())
    assert len(families["sync"]) >= 2  # the mix does shift between the steps
    assert families["async"] == families["sync"]
