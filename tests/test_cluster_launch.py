"""One run over two launchers (`ops.launch --only`), as two hosts would run it, on a local
3-server cluster: `--only` picks the actors, the control host creates and exports the run,
the engines' host waits for it and stops at its end (runners/cluster_check.py)."""

from __future__ import annotations

import pytest

from actors.config import ConfigError, load_config
from ops.launch import actor_specs, main, select_actors
from runners.cluster_check import passed, run_check
from tests.conftest import write_tiny_config


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
    summary = run_check(tmp_path, steps=1, time_scale=50.0, kill=False)
    assert passed(summary), summary
    assert summary["trajectories_finished"] == summary["trajectories_expected"] == 4
    assert set(summary["actors"]) == {"trainer", "env0", "e0", "e1"}  # final reports from both hosts
    assert summary["lifecycle_events_emitted"] == summary["events"] > 0
