"""Shared pieces of the torch-backend tests: a tiny checkpoint, configs, engines, work items."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import torch

from actors.base.clock import ScaledClock
from actors.config import Config, load_config
from bus_schemas.work import PrefillWork

TORCH_CONFIG = """
[run]
name = "tiny-torch"
seed = 5
time_scale = 1.0
policy = "{policy}"
heartbeat_wall_s = 0.2
ack_wait_wall_s = 30.0

[engines]
count = 2
backend = "torch"
prefill_engines = 1
local_prefill_max_tokens = 0  # under a split every turn crosses engines: the hand-off paths these tests check
kv_ttl_s = {kv_ttl_s}
kv_writeback = "{kv_writeback}"
admission = "{admission}"

[environments]
count = 1

[trainer]
steps = {steps}
tasks_per_step = 2
samples_per_task = 4

[workload]
mix = {{ calc = 1.0 }}

[model]
checkpoint = "{checkpoint}"
hidden_size = {hidden}
seed = 0
stop_at_eos = {stop_at_eos}
kv_chunk_bytes = {kv_chunk_bytes}
verify_trainer = {verify}
trainer_wait_wall_s = 20.0
learning_rate = 0.01
"""


def write_torch_config(
    path: Path,
    checkpoint: str = "",
    policy: str = "static",
    steps: int = 1,
    hidden: int = 64,
    stop_at_eos: bool = False,
    kv_chunk_bytes: int = 4096,
    verify: bool = False,
    kv_ttl_s: float = 60.0,
    kv_writeback: str = "none",
    admission: str = "sglang",
) -> Path:
    """The tiny torch run; hand-off tests keep write-back off (tests/test_torch_writeback.py turns it on)."""
    path.write_text(
        TORCH_CONFIG.format(
            policy=policy,
            steps=steps,
            checkpoint=checkpoint,
            hidden=hidden,
            stop_at_eos=str(stop_at_eos).lower(),
            kv_chunk_bytes=kv_chunk_bytes,
            verify=str(verify).lower(),
            kv_ttl_s=kv_ttl_s,
            kv_writeback=kv_writeback,
            admission=admission,
        )
    )
    return path


def torch_config(tmp_path: Path, checkpoint: Path, **kw) -> Config:
    return load_config(write_torch_config(tmp_path / "torch.toml", str(checkpoint), **kw))


def clock() -> ScaledClock:
    return ScaledClock(1.0, time.time())


def real_work(traj: str, prompt: list[int], turn: int = 0, context: list[int] | None = None, out: int = 8, version: int = 0) -> PrefillWork:
    context = context or []
    return PrefillWork(
        # a fresh nonce per item: the streams deduplicate message ids (work ids) for 120 s
        work_id=f"{traj}/{uuid.uuid4().hex[:8]}/t{turn}/a0",
        trajectory_id=traj,
        turn=turn,
        env_id="env0",
        task_family="calc",
        policy_version=version,
        context_tokens=len(context),
        new_tokens=len(prompt),
        max_output_tokens=out,
        queued_at_s=0.0,
        token_ids=prompt,
        context_token_ids=context,
    )


def prompt_ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()
