"""Heartbeats and final reports of actors."""

from __future__ import annotations

import msgspec

from bus_schemas.control import Role


class IterationTimes(msgspec.Struct, frozen=True, kw_only=True):
    """One kind of scheduler step an engine ran since it started (cumulative;
    actors/engine/timing.py)."""

    iterations: int = 0
    busy_s: float = 0.0  # measured (torch: wall clock; emulated: the model the engine runs)
    prior_s: float = 0.0  # what the engine's prior cost model (engines.preset) gives the same steps
    prefill_tokens: int = 0
    decode_tokens: int = 0


class EngineTiming(msgspec.Struct, frozen=True, kw_only=True):
    """An engine's steps by kind: prefill only, decode only, and both in one step; a step whose
    chunks fill less than half its prefilling ranks' budget, or a decode step with the KV pool
    less than half full, counts as `_short`."""

    prefill: IterationTimes = msgspec.field(default_factory=IterationTimes)
    prefill_short: IterationTimes = msgspec.field(default_factory=IterationTimes)
    decode: IterationTimes = msgspec.field(default_factory=IterationTimes)
    decode_short: IterationTimes = msgspec.field(default_factory=IterationTimes)  # the KV pool less than half full
    mixed: IterationTimes = msgspec.field(default_factory=IterationTimes)
    mixed_short: IterationTimes = msgspec.field(default_factory=IterationTimes)


class EngineStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Published on subjects.status("engine", id) every heartbeat."""

    engine_id: str
    at_s: float  # model time of the heartbeat
    role: Role
    epoch: int
    policy_version: int
    backend: str  # "emulated", "torch", "vllm"
    waiting_prefill: int  # sequences admitted but not yet fully prefilled
    running_decode: int  # sequences decoding (with those retracted to host memory, waiting for room)
    kv_used_tokens: int  # tokens of KV resident (running + held for hand-off)
    kv_capacity_tokens: int
    held_kv_handles: int  # prefilled KV waiting for a decode engine to fetch it
    busy_fraction: float  # share of model time since the last heartbeat spent in iterations
    waiting_prefill_tokens: int = 0  # prefill tokens still to compute for the waiting sequences
    decode_context_tokens: int = (
        0  # KV tokens of the decoding sequences, retracted ones included (their mean context = this / running_decode)
    )
    switching: bool = False  # a SetRole is being carried out (draining or reconfiguring)
    role_since_s: float = 0.0  # model time the current role began
    prefilled_tokens_total: int = 0  # prefill tokens computed since the engine started (cumulative)
    decoded_tokens_total: int = 0  # tokens its decodes generated since the engine started (cumulative)
    cached_prefix_tokens: int = 0  # KV of finished turns kept in the prefix cache (trajectories between turns)
    # this engine's registration: new at every start, and after a pause longer than its lease
    # (run.lease_wall_s), so observers tell a restarted or resumed engine from a live one
    incarnation: str = ""
    timing: EngineTiming | None = None  # None: the backend does not measure its steps (vLLM)


class ActorStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Heartbeat of a non-engine actor (environment, trainer)."""

    actor_id: str
    kind: str
    at_s: float
    live_trajectories: int = 0
    counters: dict[str, int] = {}


class ActorReport(msgspec.Struct, frozen=True, kw_only=True):
    """Published on subjects.report(id) (JetStream): an actor's counters since its process
    started, as checkpoints while it runs (final False) and once when it stops (final True).
    A restarted actor is a new incarnation; a run's counters add up each incarnation's last
    report, so an actor killed outright loses at most one checkpoint period of counts."""

    actor_id: str
    kind: str
    at_s: float
    counters: dict[str, int]  # e.g. invalid_messages, reprefills, redelivered
    incarnation: str = ""  # one per process start ("": one incarnation only)
    final: bool = True  # False: a checkpoint of a running actor
