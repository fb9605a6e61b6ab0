"""`python -m ops.report RUN_DIR`: a recorded run as PNGs and a short report.

The recorded run is a tiny `prorsa` fleet in virtual time (`runners.simulate`, a few
seconds): the allocator splits two colocated engines into a prefill and a decode engine,
and the forecaster's forecasts are kept in `forecasts.parquet`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from actors.config import load_config, with_policy
from ops.critical_path import BUCKETS
from ops.report import FIGURES, ReportError, completion_times, initial_roles, report, role_counts
from tests.conftest import REPO, write_tiny_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory) -> Path:
    from runners.simulate import run

    tmp = tmp_path_factory.mktemp("report")
    path = write_tiny_config(tmp / "tiny.toml", policy="prorsa", steps=2)
    with path.open("a") as f:
        f.write('\n[allocator]\ntick_s = 1.0\nmin_dwell_s = 0.0\ncolocation = "never"\n')
    out = tmp / "run"
    summary = run(with_policy(load_config(path), None), out, show_progress=False)
    assert summary["status"] == "completed"
    return out


def test_the_report_writes_its_pngs_and_a_markdown_and_html_page(recorded_run: Path, tmp_path: Path):
    proc = subprocess.run(
        [sys.executable, "-m", "ops.report", str(recorded_run), "--out", str(tmp_path / "r")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "r"
    for name in FIGURES:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    md = (out / "report.md").read_text()
    for name in FIGURES:
        assert f"]({name})" in md
    html = (out / "report.html").read_text()
    assert all(f'src="{name}"' in html for name in FIGURES) and "<table>" in html
    facts = json.loads((out / "report.json").read_text())
    summary = json.loads((recorded_run / "summary.json").read_text())
    events = pl.read_parquet(recorded_run / "events.parquet")
    assert facts["trajectories_finished"] == summary["trajectories_finished"] == 8
    assert facts["role_switches"] == events.filter(pl.col("kind") == "role_switched").height >= 2
    assert [s["step"] for s in facts["steps"]] == [0, 1] and facts["rollout_s_total"] == pytest.approx(
        sum(s["rollout_s"] for s in summary["steps"]), abs=0.01
    )
    assert 0 < facts["completion_p50_s"] <= facts["completion_p90_s"] <= facts["completion_p99_s"]
    assert "forecasts.parquet" in md and "No forecast line" not in md  # the simulation recorded its forecasts
    # what ended each step: its last trajectory, whose time from the step's start is the step's rollout
    assert "## What ended each step" in md and [p["step"] for p in facts["critical_paths"]] == [0, 1]
    for path, step in zip(facts["critical_paths"], summary["steps"]):
        assert sum(path[b] for b in BUCKETS) == pytest.approx(step["rollout_s"], abs=0.01)
        assert path["prefill"] > 0 and path["decode"] > 0  # its turns' prefills and decodes, each in its own part
        assert f"| {step['step']} | {path['trajectory_id']} |" in md


def test_the_recorded_forecasts_carry_the_window_the_allocator_reads(recorded_run: Path):
    forecasts = pl.read_parquet(recorded_run / "forecasts.parquet")
    assert forecasts.height > 0 and forecasts["window_mean"].is_finite().all()
    first = forecasts.filter(pl.col("horizon_s") == pl.col("bin_s"))  # a one-bin window is that bin ...
    as_done = first.filter(~pl.col("target").is_in(["prefill_miss_tokens", "prefill_engine_s"]))
    assert as_done.height > 0 and (as_done["window_mean"] - as_done["mean"]).abs().max() < 1e-9
    # ... but a prefill's compute counts in the window when asked for, in the bin when done
    asked = first.filter(pl.col("target").is_in(["prefill_miss_tokens", "prefill_engine_s"]))
    assert asked.height > 0 and (asked["window_mean"] >= 0).all()
    longer = forecasts.filter(pl.col("horizon_s") > pl.col("bin_s"))
    assert longer.height > 0 and (longer["window_mean"] - longer["mean"]).abs().max() > 0  # more bins than the last one


def test_the_roles_follow_the_log_from_the_policys_start(recorded_run: Path):
    events = pl.read_parquet(recorded_run / "events.parquet")
    initial = initial_roles(recorded_run, events, "prorsa")  # no config.json: from the log and the policy
    assert initial == {"e0": "colocated", "e1": "colocated"}
    times, counts = role_counts(initial, events, float(events["at_s"].min()), float(events["at_s"].max()))
    assert (counts["colocated"][0], counts["prefill"][0], counts["decode"][0]) == (2, 0, 0)
    assert (counts["colocated"][-1], counts["prefill"][-1] + counts["decode"][-1]) == (0, 2)
    assert list(times) == sorted(times)


def test_completion_times_cover_every_finished_trajectory(recorded_run: Path):
    events = pl.read_parquet(recorded_run / "events.parquet")
    times = completion_times(events)
    assert times.height == events.filter(pl.col("kind") == "finished").height
    assert (times["completion_s"] > 0).all() and (times["since_step_s"] >= times["completion_s"]).all()


def test_the_default_output_is_the_run_folders_report_folder(recorded_run: Path, tmp_path: Path):
    import shutil

    run = tmp_path / "copy"
    shutil.copytree(recorded_run, run)
    (run / "forecasts.parquet").unlink()
    written = report(run)
    assert {p.parent for p in written.values()} == {run / "report"}
    assert "No forecast line" in (run / "report" / "report.md").read_text()


def test_bad_run_folders_are_one_line(tmp_path: Path):
    with pytest.raises(ReportError, match="no such run folder"):
        report(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="no such event log"):
        report(tmp_path / "empty")
    proc = subprocess.run(
        [sys.executable, "-m", "ops.report", str(tmp_path / "missing")], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 1 and proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
