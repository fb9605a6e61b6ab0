"""Lifecycle events: every transition of every trajectory, plus fleet and RL-step events.

This is a persisted message family: fields are named (no ``array_like``), new fields get
defaults, and no field ever changes type, so old logs still load. ``SCHEMA_VERSION`` goes
up when a field is added, and the exporter writes it into the Parquet log.
"""

from __future__ import annotations

import enum

import msgspec

SCHEMA_VERSION = 1


class EventKind(enum.StrEnum):
    # per turn, in order (colocated engines skip kv_transfer_done and decode_queued)
    PREFILL_QUEUED = "prefill_queued"
    PREFILL_STARTED = "prefill_started"
    PREFILL_DONE = "prefill_done"
    KV_TRANSFER_DONE = "kv_transfer_done"
    DECODE_QUEUED = "decode_queued"
    DECODE_STARTED = "decode_started"
    DECODE_DONE = "decode_done"
    TOOL_STARTED = "tool_started"
    TOOL_DONE = "tool_done"
    # per trajectory
    STARTED = "started"
    FINISHED = "finished"
    REPREFILL = "reprefill"  # a turn sent back to prefill (lost or invalid KV, dead engine)
    DECODE_MIGRATED = "decode_migrated"  # a decode moved mid-turn to another engine (a role switch's hand-off)
    ENV_ERROR = "env_error"  # the environment's code failed the trajectory (detail: reason: message); finished follows
    # KV write-back (engines.kv_writeback): a finished turn's KV landed on the prefill engine
    # that holds the trajectory's prefix, or in the shared store tier; kv_bytes, duration_s
    KV_WRITEBACK_DONE = "kv_writeback_done"
    KV_STORE_LOADED = "kv_store_loaded"  # a prefill loaded the trajectory's prefix from the store tier
    # fleet and RL
    ROLE_SWITCHED = "role_switched"  # detail: the allocator's reason (SetRole.reason)
    POLICY_LOADED = "policy_loaded"
    STEP_STARTED = "step_started"
    ROLLOUT_DONE = "rollout_done"  # detail: FINAL_STEP on the run's last step (no step follows)
    POLICY_PUBLISHED = "policy_published"
    # async RL (run.mode = "async", docs/async.md)
    POLICY_UPDATE_STARTED = "policy_update_started"  # an engine began taking a new version mid-rollout (policy_loaded ends it)
    TURN_INTERRUPTED = "turn_interrupted"  # a weight update cut a turn; it resumes on the new version (detail: old version)
    BATCH_READY = "batch_ready"  # the trainer took a batch (step: batch index; detail: staleness histogram)
    TRAJECTORY_DROPPED = "trajectory_dropped"  # finished, but too stale to train on (detail: the reason)


# What a complete disaggregated / colocated turn looks like in the log.
# rollout_done's detail on the run's last step: no step follows it (the forecaster then
# foresees no next step's starts)
FINAL_STEP = "final step"

TURN_KINDS_PD = (
    EventKind.PREFILL_QUEUED,
    EventKind.PREFILL_STARTED,
    EventKind.PREFILL_DONE,
    EventKind.DECODE_QUEUED,
    EventKind.KV_TRANSFER_DONE,
    EventKind.DECODE_STARTED,
    EventKind.DECODE_DONE,
)
TURN_KINDS_COLOCATED = (
    EventKind.PREFILL_QUEUED,
    EventKind.PREFILL_STARTED,
    EventKind.PREFILL_DONE,
    EventKind.DECODE_STARTED,
    EventKind.DECODE_DONE,
)
TOOL_KINDS = (EventKind.TOOL_STARTED, EventKind.TOOL_DONE)


class LifecycleEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One transition. Published to subjects.lifecycle(kind) with Nats-Msg-Id = event_id."""

    event_id: str  # unique; a retried publish reuses it, so the stream stores it once
    kind: EventKind
    at_s: float  # model seconds since the run's origin
    actor_id: str  # the actor that saw the transition
    trajectory_id: str = ""  # empty for fleet and step events
    turn: int = -1  # turn index, -1 where not about a turn
    attempt: int = 0  # submission attempt of the turn (re-prefills count up)
    task_family: str = ""
    policy_version: int = -1
    step: int = -1  # RL step (sync mode: equals the policy version the step runs)
    engine_id: str = ""  # engine that did the work, where relevant
    role: str = ""  # engine role at the time (role_switched: the new role)
    new_tokens: int = 0  # tokens the turn appends (prompt or observation)
    cached_prefix_tokens: int = 0  # context tokens found in a prefix cache at prefill
    context_tokens: int = 0  # history before the turn
    generated_tokens: int = 0  # tokens generated (decode_done, finished)
    kv_bytes: int = 0  # bytes moved (kv_transfer_done)
    duration_s: float = 0.0  # tool latency, transfer time, training time, drain time
    reward: float | None = None  # finished only
    detail: str = ""  # free text for odd cases (why a re-prefill happened)
