"""`runners.bench bus` on the real server, small: every figure (plaintext and over TLS) is measured and nothing is lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runners.bench_bus import bench

pytestmark = pytest.mark.bus


async def test_the_bus_bench_measures_every_figure_and_loses_nothing(tmp_path: Path):
    result = await bench(tmp_path, n_events=3000, n_fsync_events=300, n_switches=10, fleet=8, heartbeat_wall_s=0.05, repeats=2)
    assert json.loads((tmp_path / "bus.json").read_text()) == result
    assert result["lost"] == 0 and result["duplicated"] == 0  # every emitted id is in the LIFECYCLE stream, once
    assert result["events_per_s_async"] > 0 and result["events_per_s_fsync"] > 0
    assert 0 < result["control_p50_ms"] <= result["control_p99_ms"] < 10_000
    assert result["events_per_s_async_tls"] > 0 and 0 < result["control_p50_ms_tls"] <= result["control_p99_ms_tls"] < 10_000
    measured = result["measured"]
    assert measured["switches"] == 10 and measured["disk_fsyncs_per_s"] > 0
    runs = measured["runs_async"] + measured["runs_fsync"] + measured["runs_async_tls"]
    assert len(runs) == 6 and all(r["lost"] == 0 and r["duplicated"] == 0 for r in runs)
    assert all(0 < r["peak_in_flight"] <= 1024 and r["client_cpu_us_per_event"] > 0 for r in runs)
