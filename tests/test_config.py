from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from actors.config import ConfigError, initial_roles, load_config, with_policy
from bus_schemas.control import Role
from tests.conftest import REPO, write_tiny_config


def test_demo_configs_load():
    for path in sorted((REPO / "configs").glob("*.toml")):
        config = load_config(path)
        assert config.trajectories_expected() > 0


def test_typo_names_the_key_and_the_file(tmp_path: Path):
    path = write_tiny_config(tmp_path / "typo.toml")
    path.write_text(path.read_text().replace("tasks_per_step", "task_per_step"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "typo.toml" in str(err.value) and "task_per_step" in str(err.value)


def test_unknown_section_is_an_error(tmp_path: Path):
    path = write_tiny_config(tmp_path / "c.toml")
    path.write_text(path.read_text() + "\n[engnies]\ncount = 3\n")
    with pytest.raises(ConfigError, match="engnies"):
        load_config(path)


@pytest.mark.parametrize(
    "old, new, says",
    [
        ("mix = { swe = 0.5, math = 0.5 }", "mix = { swe = 0.5, maths = 0.5 }", "maths"),
        ("count = 2\nprefill", "count = 0\nprefill", "engines.count"),
        ("time_scale = 50.0", "time_scale = -1.0", "time_scale"),
        ("time_scale = 50.0", 'time_scale = "fast"', "time_scale"),
    ],
)
def test_bad_values_are_named(tmp_path: Path, old, new, says):
    path = write_tiny_config(tmp_path / "c.toml")
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))
    with pytest.raises(ConfigError, match=says):
        load_config(path)


def test_static_split_needs_a_decode_engine(tiny_config):
    config = with_policy(tiny_config, "static")
    assert initial_roles(config) == {"e0": Role.PREFILL, "e1": Role.DECODE}
    import msgspec

    no_decode = msgspec.structs.replace(config, engines=msgspec.structs.replace(config.engines, prefill_engines=2))
    with pytest.raises(ConfigError, match="leaves no decode engine"):
        initial_roles(no_decode)


def test_colocated_roles(tiny_config):
    assert set(initial_roles(tiny_config).values()) == {Role.COLOCATED}


def _starting(config, n_prefill: int):
    import msgspec

    return msgspec.structs.replace(config, allocator=msgspec.structs.replace(config.allocator, start_prefill_engines=n_prefill))


@pytest.mark.parametrize("policy", ["reactive", "prorsa"])
def test_a_dynamic_fleet_starts_colocated_or_in_the_split_it_is_given(tiny_config, policy):
    config = with_policy(tiny_config, policy)
    assert set(initial_roles(config).values()) == {Role.COLOCATED}  # the default
    assert initial_roles(_starting(config, 1)) == {"e0": Role.PREFILL, "e1": Role.DECODE}
    with pytest.raises(ConfigError, match="start_prefill_engines = 2 leaves no decode engine out of engines.count = 2"):
        initial_roles(_starting(config, 2))


def test_the_start_split_is_the_dynamic_policies_alone(tiny_config):
    assert set(initial_roles(_starting(with_policy(tiny_config, "colocated-sticky"), 1)).values()) == {Role.COLOCATED}
    static = with_policy(tiny_config, "static")
    assert initial_roles(_starting(static, 1)) == initial_roles(static)


def test_a_negative_start_split_is_named(tmp_path: Path):
    path = write_tiny_config(tmp_path / "c.toml")
    path.write_text(path.read_text() + "\n[allocator]\nstart_prefill_engines = -1\n")
    with pytest.raises(ConfigError, match="allocator.start_prefill_engines = -1 must be >= 0"):
        load_config(path)


def test_launcher_rejects_a_typo_before_starting_anything(tmp_path: Path):
    path = write_tiny_config(tmp_path / "typo.toml")
    path.write_text(path.read_text().replace("samples_per_task", "samples_per_tsak"))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "ops.launch", str(path), "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2
    assert "samples_per_tsak" in proc.stderr and "typo.toml" in proc.stderr
    assert not out.exists()  # nothing started, nothing written


def test_workload_phases_shift_the_mix(tmp_path: Path):
    path = write_tiny_config(tmp_path / "c.toml")
    path.write_text(
        path.read_text()
        + """
[[workload.phases]]
from_step = 2
mix = { search = 1.0 }
"""
    )
    workload = load_config(path).workload
    assert workload.mix_at(0) == workload.mix_at(1) == {"swe": 0.5, "math": 0.5}
    assert workload.mix_at(2) == workload.mix_at(9) == {"search": 1.0}
    path.write_text(path.read_text().replace("from_step = 2", "from_step = 0"))
    with pytest.raises(ConfigError, match="from_step"):
        load_config(path)


def test_heartbeats_default_to_one_per_model_second(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text("[run]\ntime_scale = 20.0\n")
    assert load_config(path).run.heartbeat_wall_s == pytest.approx(0.05)
    path.write_text("[run]\ntime_scale = 20.0\nheartbeat_wall_s = 0.5\n")
    assert load_config(path).run.heartbeat_wall_s == 0.5


def test_the_registry_checks_are_added_to_the_schema_by_actors_config(tmp_path: Path):
    """actors.config_schema reads the shape alone; actors.config adds the checks that need the
    cost model, the workload profiles and the forecasting registry, and keeps them through
    with_policy."""
    from actors import config_schema
    from actors.config import Config, EngineSection

    path = write_tiny_config(tmp_path / "c.toml")
    good = load_config(path)
    assert type(good) is Config and type(good.engines) is EngineSection
    assert type(with_policy(good, "static-1:1").engines) is EngineSection
    assert good.engines.cost_preset(Role.DECODE).dp_ranks == 1
    for old, new, says in [
        ("prefill_engines = 1", 'prefill_engines = 1\npreset = "h100-nope"', "unknown engines.preset 'h100-nope'"),
        ("math = 0.5 }", "maths = 0.5 }", "unknown task family 'maths'"),
        ("[trainer]", '[forecaster]\nmodel = "prophet"\n\n[trainer]', "unknown forecaster.model 'prophet'"),
    ]:
        bad = tmp_path / "bad.toml"
        assert old in path.read_text()
        bad.write_text(path.read_text().replace(old, new))
        with pytest.raises(ConfigError, match=says):
            load_config(bad)
        shape = config_schema.parse_config(bad, config_schema.Config)  # the schema alone takes it
        assert type(shape) is config_schema.Config and not hasattr(shape.engines, "cost_preset")


def test_a_prior_log_is_found_before_the_run_starts(tmp_path: Path):
    """`forecaster.prior_log`: a run's folder stands for its events.parquet, and a path with
    no log there is named when the config loads."""
    run_dir = tmp_path / "earlier"
    run_dir.mkdir()
    (run_dir / "events.parquet").write_bytes(b"")
    path = write_tiny_config(tmp_path / "c.toml")
    text = path.read_text()
    path.write_text(text + f'\n[forecaster]\nprior_log = "{run_dir}"\n')
    assert load_config(path).forecaster.prior_log == str(run_dir / "events.parquet")
    path.write_text(text + f'\n[forecaster]\nprior_log = "{tmp_path / "missing"}"\n')
    with pytest.raises(ConfigError, match="forecaster.prior_log"):
        load_config(path)
