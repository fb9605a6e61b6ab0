"""Test tiers: pure unit tests (no marker), `bus` tests against the real nats-server this
session starts, and `e2e` tests that run `ops.launch` with several processes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from actors.base.connection import close, connect, publish_origin
from actors.config import Config, load_config
from bus_schemas import streams
from ops.natsserver import EmbeddedNats

REPO = Path(__file__).resolve().parent.parent
TINY_CONFIG = """
[run]
name = "tiny"
seed = 3
time_scale = {time_scale}
policy = "{policy}"
heartbeat_wall_s = 0.2
ack_wait_wall_s = {ack_wait}

[engines]
count = 2
prefill_engines = 1
local_prefill_max_tokens = 0  # under a split every turn crosses engines: the hand-off paths these tests check

[environments]
count = 1

[trainer]
steps = {steps}
tasks_per_step = 2
samples_per_task = 2
train_s = 2.0

[workload]
mix = {{ swe = 0.5, math = 0.5 }}

[workload.overrides.swe]
turns_max = 3
tool_latency_scale = 0.2

[workload.overrides.math]
turns_max = 3
gen_scale = 0.3
"""


def write_tiny_config(path: Path, policy: str = "colocated", time_scale: float = 50.0, steps: int = 1, ack_wait: float = 5.0) -> Path:
    path.write_text(TINY_CONFIG.format(policy=policy, time_scale=time_scale, steps=steps, ack_wait=ack_wait))
    return path


@pytest.fixture
def tiny_config(tmp_path: Path) -> Config:
    return load_config(write_tiny_config(tmp_path / "tiny.toml"))


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    server = EmbeddedNats(tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


async def clean_bus(nc) -> None:
    """Every stream exists and is empty, no consumers left over (NATS or the in-process bus)."""
    js = nc.jetstream()
    await streams.ensure_streams(js)
    for stream in streams.ALL_STREAMS:
        for consumer in await js.consumers_info(stream.name):
            await js.delete_consumer(stream.name, consumer.name)
        await js.purge_stream(stream.name)


@pytest.fixture
async def bus(nats_server):
    """A connection to a clean bus on the real nats-server."""
    nc = await connect(nats_server.url, "test", logging.getLogger("test"))
    await clean_bus(nc)
    await publish_origin(nc.jetstream(), "test")
    yield nc
    await close(nc)


def pytest_collection_modifyitems(config, items):
    """The soak (tests/test_faults_soak.py) runs only when asked for: `pytest -m soak`."""
    if "soak" in (config.getoption("markexpr") or ""):
        return
    soak = [item for item in items if "soak" in item.keywords]
    if soak:
        config.hook.pytest_deselected(items=soak)
        items[:] = [item for item in items if "soak" not in item.keywords]
