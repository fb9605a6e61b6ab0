"""Engine commands (a tagged union, dispatched explicitly) and their acks."""

from __future__ import annotations

import enum

import msgspec

from bus_schemas import subjects


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


class SetRole(msgspec.Struct, frozen=True, kw_only=True, tag="set_role"):
    """Switch role. Idempotent for the same epoch; an epoch below the engine's is refused."""

    role: Role
    epoch: int  # allocator's decision counter; strictly increasing per engine
    drain_deadline_s: float = 30.0  # model seconds allowed to finish in-flight work
    reason: str = ""  # why the allocator switched it (its decision, for the log: role_switched's detail)


class LoadPolicy(msgspec.Struct, frozen=True, kw_only=True, tag="load_policy"):
    """Load a policy version before serving work that needs it."""

    version: int


class Drain(msgspec.Struct, frozen=True, kw_only=True, tag="drain"):
    """Stop pulling work; finish what is in flight; keep running."""

    reason: str = ""


class Shutdown(msgspec.Struct, frozen=True, kw_only=True, tag="shutdown"):
    """Drain, then exit."""

    reason: str = ""


Command = SetRole | LoadPolicy | Drain | Shutdown


def command_subject(engine_id: str, command: Command) -> str:
    """The subject an engine takes `command` on: policy loads apart from role commands."""
    return subjects.ctl_policy(engine_id) if isinstance(command, LoadPolicy) else subjects.ctl_engine(engine_id)


class CommandAck(msgspec.Struct, frozen=True, kw_only=True):
    """Reply to every command."""

    engine_id: str
    command: str  # the command's tag
    ok: bool
    error: str = ""  # why ok is False, in one line
    role: Role  # role after the command
    epoch: int  # epoch after the command
    policy_version: int  # policy loaded after the command
    drain_s: float = 0.0  # model seconds spent finishing in-flight work (the switch's cost)


class AllocationDecision(msgspec.Struct, frozen=True, kw_only=True):
    """One allocator tick (`subjects.allocation()`): what it saw, what it did, why. The demand
    fields are the policy's estimate (`actors/allocator/policy.py` Demand); with no estimate
    yet, `demand_source` is empty and they are 0."""

    at_s: float  # model time of the tick
    policy: str
    epoch: int  # the fleet epoch after this tick's changes
    roles: dict[str, str]  # engine id -> role it reported (or was last told)
    changes: dict[str, str] = {}  # engine id -> role it is told now (empty: no change)
    reason: str = ""  # the policy's last_reason: why this (or why nothing)
    demand_source: str = ""  # "queues", "forecast@<as_of>s", "oracle"; "" : no estimate
    prefill_tokens_per_s: float = 0.0  # cache-missed prefill tokens, backlog of now included
    prefill_new_tokens_per_s: float = 0.0
    decode_seqs: float = 0.0
    decode_context_tokens: float = 0.0
    kv_working_set_tokens: float = 0.0
    live_trajectories: float = 0.0
    live_context_tokens: float = 0.0
    remote_share: float = 1.0
    prefill_attention_tokens: float = 0.0  # context a missed prefill token attends over (0: unknown)
    prefill_backlog_tokens_per_s: float = 0.0  # the part of prefill_tokens_per_s queued now
    remaining_s: float = 0.0  # the live trajectories' mean model seconds of work left (0: not known)
    # the capacities the policy priced this tick with (allocator.capacity = "measured": the cost
    # model's figures times the engines' measured over prior step times, actors/allocator/measured.py):
    # those factors, and at the demand's decode context a prefill engine's seconds per prefill
    # token, a colocated engine's, and a decode engine's step of its KV-bound batch (0: no estimate)
    capacity_prefill_scale: float = 1.0
    capacity_decode_scale: float = 1.0
    capacity_mixed_scale: float = 1.0
    capacity_kv_scale: float = 1.0
    prefill_s_per_token: float = 0.0
    colocated_prefill_s_per_token: float = 0.0
    decode_kv_step_s: float = 0.0
