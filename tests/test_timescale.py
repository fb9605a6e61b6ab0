"""Time compression leaves results invariant: the same config at two time scales gives the
same per-step rollout times in model seconds.

Tolerance: 10% per step, at 4x against 12x. What separates the runs is wall-clock latency
(a bus hop, a timer wake-up: about a millisecond each, more when the CPU is busy) that
becomes model time multiplied by the scale. On a quiet machine 5x against 20x stays within
0.2-4% on this workload; with a second test run competing for the 2 cores, 20x drifted by
16% on the first step, and at 80x the first step drifts by about a third even when quiet.
Virtual-time simulation (runners.simulate) removes the effect entirely.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, write_tiny_config

pytestmark = pytest.mark.e2e

TOLERANCE = 0.10


def rollout_s(tmp_path: Path, time_scale: float) -> list[float]:
    config = write_tiny_config(tmp_path / f"tiny-{time_scale}.toml", time_scale=time_scale, steps=2)
    out = tmp_path / f"run-{time_scale}"
    proc = subprocess.run(
        [sys.executable, "-m", "ops.launch", str(config), "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return [s["rollout_s"] for s in json.loads((out / "summary.json").read_text())["steps"]]


def test_compressed_and_slower_runs_report_the_same_model_times(tmp_path: Path):
    slow, fast = rollout_s(tmp_path, 4.0), rollout_s(tmp_path, 12.0)
    assert len(slow) == len(fast) == 2
    for step, (a, b) in enumerate(zip(slow, fast)):
        assert abs(b - a) / a <= TOLERANCE, f"step {step}: {a:.2f} s at 4x vs {b:.2f} s at 12x"
