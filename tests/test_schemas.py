"""Round trips of every message family, the command union, and log compatibility."""

from __future__ import annotations

import msgspec
import pytest

from bus_schemas.codec import decode, encode
from bus_schemas.control import Command, CommandAck, Drain, LoadPolicy, Role, SetRole, Shutdown
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.status import ActorReport, ActorStatus, EngineStatus
from bus_schemas.train import FinishedTrajectory, PolicyVersion, StepReport, TaskAssignment
from bus_schemas.work import DecodeWork, KvChunk, KvFetch, KvHandle, PrefillWork, TurnResult, make_work_id, retry_work_id

PREFILL = PrefillWork(
    work_id=make_work_id("s0-k1-g2", "ab12", 3, 0),
    trajectory_id="s0-k1-g2",
    turn=3,
    env_id="env0",
    task_family="swe",
    policy_version=2,
    context_tokens=4100,
    new_tokens=380,
    max_output_tokens=4096,
    target_output_tokens=612,
    queued_at_s=12.5,
    token_ids=[1, 2, 3],
)
HANDLE = KvHandle(engine_id="e1", handle_id=PREFILL.work_id, tokens=4480, kv_bytes=4480 * 147456, expires_at_s=140.0)

EXAMPLES = [
    PREFILL,
    HANDLE,
    DecodeWork(prefill=PREFILL, kv=HANDLE, first_token_id=17, cached_prefix_tokens=4000, prefilled_at_s=13.0),
    KvFetch(handle_id="h", chunk=2, requester_id="e3"),
    KvChunk(handle_id="h", ok=True, chunk=1, n_chunks=4, tokens=100, kv_bytes=1000, checksum="ff", data=b"\x00\x01"),
    TurnResult(
        work_id="w",
        trajectory_id="t",
        turn=1,
        policy_version=0,
        prefill_engine_id="e0",
        decode_engine_id="e1",
        output_tokens=4,
        token_ids=[5, 6, 7, 8],
        logprobs=[-0.1, -0.2, -0.3, -0.4],
        finished_at_s=3.0,
    ),
    LifecycleEvent(
        event_id="x", kind=EventKind.DECODE_DONE, at_s=1.5, actor_id="e1", trajectory_id="t", turn=2, generated_tokens=40, reward=None
    ),
    LifecycleEvent(event_id="y", kind=EventKind.FINISHED, at_s=9.0, actor_id="env0", reward=1.0),
    SetRole(role=Role.DECODE, epoch=3, drain_deadline_s=5.0),
    LoadPolicy(version=4),
    Drain(reason="test"),
    Shutdown(),
    CommandAck(
        engine_id="e0", command="set_role", ok=False, error="stale epoch", role=Role.PREFILL, epoch=3, policy_version=1, drain_s=0.5
    ),
    EngineStatus(
        engine_id="e0",
        at_s=1.0,
        role=Role.COLOCATED,
        epoch=0,
        policy_version=0,
        backend="emulated",
        waiting_prefill=2,
        running_decode=7,
        kv_used_tokens=1000,
        kv_capacity_tokens=380000,
        held_kv_handles=0,
        busy_fraction=0.4,
    ),
    ActorStatus(actor_id="env0", kind="environment", at_s=2.0, live_trajectories=3, counters={"a": 1}),
    ActorReport(actor_id="e0", kind="engine", at_s=3.0, counters={"invalid_messages": 2}),
    TaskAssignment(
        trajectory_id="s0-k0-g0", task_id="s0-k0", task_family="math", sample_index=0, step=0, policy_version=0, seed=11, assigned_at_s=0.0
    ),
    FinishedTrajectory(
        trajectory_id="t",
        task_id="k",
        task_family="math",
        env_id="env0",
        step=0,
        policy_versions=[0, 0],
        turns=2,
        reward=1.0,
        prompt_tokens=200,
        generated_tokens=3000,
        observation_tokens=60,
        started_at_s=0.0,
        finished_at_s=30.0,
    ),
    PolicyVersion(version=1, published_at_s=40.0, train_s=20.0),
    StepReport(
        step=0, policy_version=0, started_at_s=0.0, rollout_done_at_s=30.0, rollout_s=30.0, train_s=20.0, trajectories=4, mean_reward=0.5
    ),
]


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    assert decode(type(message), encode(message)) == message


@pytest.mark.parametrize("command", [SetRole(role=Role.PREFILL, epoch=1), LoadPolicy(version=2), Drain(), Shutdown(reason="x")])
def test_command_union_decodes_to_the_right_struct(command):
    decoded = decode(Command, encode(command))
    assert type(decoded) is type(command) and decoded == command


def test_unknown_command_tag_is_rejected():
    data = msgspec.msgpack.encode({"type": "reboot_gpu", "epoch": 1})
    with pytest.raises(msgspec.ValidationError):
        decode(Command, data)


def test_wrong_field_type_is_rejected():
    data = msgspec.msgpack.encode({**msgspec.to_builtins(PREFILL), "turn": "three"})
    with pytest.raises(msgspec.ValidationError, match="turn"):
        decode(PrefillWork, data)


def test_old_lifecycle_event_without_newer_fields_still_loads():
    """The log is persisted: an event written before optional fields existed must decode."""
    old = msgspec.msgpack.encode({"event_id": "e", "kind": "tool_done", "at_s": 4.0, "actor_id": "env0"})
    event = decode(LifecycleEvent, old)
    assert event.kind is EventKind.TOOL_DONE and event.turn == -1 and event.reward is None


def test_lifecycle_events_keep_named_fields():
    encoded = msgspec.msgpack.decode(encode(EXAMPLES[6]))
    assert isinstance(encoded, dict) and encoded["kind"] == "decode_done"


def test_retry_work_id_keeps_the_turn_and_bumps_the_attempt():
    assert retry_work_id(PREFILL.work_id, 1) == "s0-k1-g2/ab12/t3/a1"
    assert retry_work_id(retry_work_id(PREFILL.work_id, 1), 2) == "s0-k1-g2/ab12/t3/a2"
