"""One run over two launchers (`ops.launch --only`), as two hosts would run it, on a local
3-server cluster: `--only` picks the actors, the control host creates and exports the run,
the engines' host waits for it and stops at its end (runners/cluster_check.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from actors.config import ConfigError, load_config
from ops.launch import actor_specs, main, select_actors
from runners.cluster_check import passed, run_check
from tests.conftest import REPO, write_tiny_config
from tests.subproc import read_until


def test_only_picks_groups_ids_and_ranges(tmp_path):
    config = load_config(write_tiny_config(tmp_path / "tiny.toml", policy="prorsa"))
    specs = actor_specs(config)

    def names(*groups: str) -> list[str]:
        return [spec.name for spec in select_actors(specs, list(groups))]

    assert names("control") == ["forecaster forecaster", "allocator allocator", "trainer trainer"]
    assert names("engines") == ["engine e0", "engine e1"]
    assert names("engines:e1") == ["engine e1"]
    assert names("engines:e0-e1", "engines:e1", "environments") == ["engine e0", "engine e1", "environment env0"]
    for bad in ("engines:e0-e7", "engines:e1-e0", "gpus", "control:trainer"):
        with pytest.raises(ConfigError, match=f"--only {bad}: "):
            select_actors(specs, [bad])


def test_only_needs_an_external_cluster(tmp_path, capsys):
    config = write_tiny_config(tmp_path / "tiny.toml")
    assert main([str(config), "--only", "engines"]) == 2
    assert "--only joins a run on an external NATS cluster" in capsys.readouterr().err
    assert main([str(config), "--only", "gpus", "--nats-url", "nats://127.0.0.1:1"]) == 2


@pytest.mark.e2e
def test_two_launchers_on_two_servers_serve_one_run(tmp_path):
    # bounded well inside pytest's timeout, so a stalled run fails with its hosts' logs
    summary = run_check(tmp_path, steps=1, time_scale=50.0, kill=False, first_finish_timeout_wall_s=90.0, run_timeout_wall_s=120.0)
    assert passed(summary), json.dumps(summary, indent=1)
    assert summary["trajectories_finished"] == summary["trajectories_expected"] == 4
    assert set(summary["actors"]) == {"trainer", "env0", "e0", "e1"}  # final reports from both hosts
    assert summary["lifecycle_events_emitted"] == summary["events"] > 0


@pytest.mark.e2e
def test_a_host_waiting_for_its_run_stops_on_sigterm_without_starting_actors(tmp_path, nats_server):
    config = write_tiny_config(tmp_path / "tiny.toml")
    config.write_text(config.read_text().replace('name = "tiny"', 'name = "never-started"'))  # the session server may hold a "tiny"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ops.launch",
            str(config),
            "--out",
            str(tmp_path / "run"),
            "--nats-url",
            nats_server.url,
            "--only",
            "engines",
            "--only",
            "environments",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
    )
    try:
        (line,) = read_until(proc, lambda seen: True, 60.0)
        assert line.startswith("waiting for run 'never-started'"), line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 130
        assert "started" not in proc.stdout.read()
        assert not list((tmp_path / "run" / "logs").iterdir())  # no actor ever spawned
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
