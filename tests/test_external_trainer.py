"""A user's own trainer beside Prorsa (`trainer.update = "external"`): `ops.launch` starts the
example of runners/external_trainer.py as the `updater` actor, Prorsa's trainer sends it each
step's trajectories over NATS and serves the weights it returns to the engines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

pytest.importorskip("torch", reason="the torch backend is the optional [torch] extra; the dev extra CI installs includes it")

from actors.config import ConfigError, load_config
from tests.conftest import REPO
from tests.test_launch import launch_to_completion
from tests.torch_helpers import write_torch_config


def external_config(tmp_path: Path, module: str = "runners.external_trainer") -> Path:
    config = write_torch_config(tmp_path / "torch.toml", checkpoint="", steps=2, stop_at_eos=False)
    text = config.read_text().replace("[trainer]\n", f'[trainer]\nupdate = "external"\nupdate_module = "{module}"\n')
    config.write_text(text)
    return config


@pytest.mark.e2e
def test_an_external_trainer_trains_every_step_and_the_engines_load_its_weights(tmp_path: Path):
    out = tmp_path / "run"
    summary = launch_to_completion(external_config(tmp_path), out, timeout_wall_s=300)
    assert summary["status"] == "completed" and summary["trajectories_finished"] == 16
    trainer = summary["actors"]["trainer"]
    assert trainer["external_updates"] == 2 and trainer.get("train_updates", 0) == 0  # none trained in Prorsa's trainer
    assert trainer["trained_tokens"] > 0 and trainer["weights_chunks_served"] > 0
    assert summary["actors"]["e0"]["weights_bytes_loaded"] == summary["actors"]["e1"]["weights_bytes_loaded"] > 0
    loaded = pl.read_parquet(out / "events.parquet").filter(pl.col("kind") == "policy_loaded")
    assert sorted(loaded["policy_version"].to_list()) == [1, 1, 2, 2]
    log = (out / "logs" / "updater-updater.log").read_text()
    assert "policy 1: loss" in log and "policy 2: loss" in log


@pytest.mark.e2e
def test_a_run_whose_external_trainer_does_not_answer_stops_with_a_line_that_says_so(tmp_path: Path):
    """A module that is no external trainer (json.tool exits at once on the updater's flags):
    the run stops, and what it prints names the subject nobody answers."""
    config = external_config(tmp_path, module="json.tool")  # exits at once: nobody answers
    text = config.read_text().replace("[trainer]\n", "[trainer]\nupdate_timeout_wall_s = 5.0\n")
    config.write_text(text)
    proc = subprocess.run(
        [sys.executable, "-m", "ops.launch", str(config), "--out", str(tmp_path / "run")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "prorsa.train.update" in proc.stdout + proc.stderr + "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*.log"))


def test_external_update_needs_its_module_and_a_real_backend(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text('[engines]\nbackend = "torch"\n[trainer]\nupdate = "external"\n')
    with pytest.raises(ConfigError, match="update_module go together"):
        load_config(path)
    path.write_text('[trainer]\nupdate = "external"\nupdate_module = "runners.external_trainer"\n')
    with pytest.raises(ConfigError, match="trains real models"):
        load_config(path)
