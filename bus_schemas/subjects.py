"""Every NATS subject Prorsa uses, built in one place.

Hierarchy: ``prorsa.<area>.<endpoint>[.<instance>]``. Nothing else in the code base writes
a subject string by hand; grep for a function here to find every producer and consumer.
"""

from __future__ import annotations

import re

PREFIX = "prorsa"
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def _token(value: str, what: str) -> str:
    """Refuse ids that would break the subject hierarchy (dots, wildcards, spaces)."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} is not a valid subject token (use letters, digits, _ or -)")
    return value


# --- work queues (JetStream, work-queue retention) -------------------------------------
def work_prefill(engine_id: str | None = None) -> str:
    """Turns waiting for prefill; with an engine id, the queue only that engine pulls."""
    base = f"{PREFIX}.work.prefill"
    return base if engine_id is None else f"{base}.{_token(engine_id, 'engine id')}"


def work_decode(engine_id: str | None = None) -> str:
    """Prefilled turns waiting for decode; with an engine id, that engine's own queue."""
    base = f"{PREFIX}.work.decode"
    return base if engine_id is None else f"{base}.{_token(engine_id, 'engine id')}"


# --- request/reply ----------------------------------------------------------------------
def kv(engine_id: str) -> str:
    """KV fetches served by the engine that holds the KV."""
    return f"{PREFIX}.kv.{_token(engine_id, 'engine id')}"


def kv_writeback(engine_id: str) -> str:
    """Request/reply: a decode engine tells the prefill engine that holds a trajectory's prefix
    that the KV of the turn it just decoded is ready to fetch (`engines.kv_writeback`)."""
    return f"{PREFIX}.kv.writeback.{_token(engine_id, 'engine id')}"


def kv_connector_stats(engine_id: str) -> str:
    """Request/reply: the counters of a vLLM engine's KV connector (KV held, served, fetched,
    failed), answered from inside vLLM's worker process (`engines.backend = "vllm"`)."""
    return f"{PREFIX}.kv.stats.{_token(engine_id, 'engine id')}"


def kv_store_put() -> str:
    """KV written to the shared store tier (`engines.kv_writeback = "store"`): every engine's
    view of the store follows these notices (core pub/sub, never stored)."""
    return f"{PREFIX}.kvstore.put"


def ctl_engine(engine_id: str) -> str:
    """Role commands (SetRole, Drain, Shutdown) for one engine: the allocator's."""
    return f"{PREFIX}.ctl.engine.{_token(engine_id, 'engine id')}"


def ctl_policy(engine_id: str) -> str:
    """Policy loads (LoadPolicy) for one engine: the trainer's. Apart from the role commands,
    so that each may be granted to one role only (ops/access.py)."""
    return f"{PREFIX}.ctl.policy.{_token(engine_id, 'engine id')}"


# --- results ----------------------------------------------------------------------------
def result(env_id: str) -> str:
    """Finished turns returned to the environment that owns the trajectory."""
    return f"{PREFIX}.result.{_token(env_id, 'environment id')}"


def result_all() -> str:
    return f"{PREFIX}.result.*"


# --- lifecycle log ----------------------------------------------------------------------
def lifecycle(kind: str) -> str:
    """One lifecycle event kind, e.g. ``prorsa.lc.prefill_done``."""
    return f"{PREFIX}.lc.{_token(kind, 'event kind')}"


def lifecycle_all() -> str:
    return f"{PREFIX}.lc.*"


def forecast() -> str:
    return f"{PREFIX}.forecast"


def allocation() -> str:
    """The allocator's decision at every tick (AllocationDecision): the demand it judged by,
    the roles it saw, what it changed and why. Not stored: watch it, or a simulation records it."""
    return f"{PREFIX}.allocation"


# --- status and reports -----------------------------------------------------------------
def status(actor_kind: str, actor_id: str) -> str:
    """Heartbeats of one actor, e.g. ``prorsa.status.engine.e3``."""
    return f"{PREFIX}.status.{_token(actor_kind, 'actor kind')}.{_token(actor_id, 'actor id')}"


def status_all() -> str:
    return f"{PREFIX}.status.>"


def status_of_kind(actor_kind: str) -> str:
    """Heartbeats of every actor of one kind, e.g. ``prorsa.status.environment.*``."""
    return f"{PREFIX}.status.{_token(actor_kind, 'actor kind')}.*"


def report(actor_id: str) -> str:
    """The final counters an actor publishes when it stops."""
    return f"{PREFIX}.report.{_token(actor_id, 'actor id')}"


def report_all() -> str:
    return f"{PREFIX}.report.*"


# --- dead letters -----------------------------------------------------------------------
def dead_letter(stream: str) -> str:
    """Work that `max_deliver` deliveries did not get acked (a poison message), moved out of
    stream `stream` with the reason in its headers; held in the DEAD stream."""
    return f"{PREFIX}.dead.{_token(stream, 'stream name')}"


def dead_letter_all() -> str:
    return f"{PREFIX}.dead.*"


def max_deliveries_advisory() -> str:
    """NATS's own advisory (not a Prorsa subject): a consumer gave up on a message after
    `max_deliver` deliveries. The launcher turns each into a dead letter."""
    return "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>"


# --- training ---------------------------------------------------------------------------
def train_tasks() -> str:
    """Trajectory assignments from the trainer to the environments (work queue)."""
    return f"{PREFIX}.train.tasks"


def train_finished() -> str:
    """Finished trajectories from the environments to the trainer."""
    return f"{PREFIX}.train.finished"


def train_policy() -> str:
    """Published policy versions."""
    return f"{PREFIX}.train.policy"


def train_step() -> str:
    """One report per finished RL step."""
    return f"{PREFIX}.train.step"


def train_model() -> str:
    """Request/reply: the trainer's model spec, which engines check theirs against at start."""
    return f"{PREFIX}.train.model"


def train_weights() -> str:
    """Request/reply: chunks of a policy version's weights, served by the trainer."""
    return f"{PREFIX}.train.weights"


def train_update() -> str:
    """Request/reply: a step's finished trajectories to an external trainer (`trainer.update =
    "external"`), the new policy's weights back."""
    return f"{PREFIX}.train.update"


def has_wildcard(subject: str) -> bool:
    """Does `subject` contain a `*` or `>` token (a pattern, not one subject)?"""
    return any(token in ("*", ">") for token in subject.split("."))


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, a final `>` is one or more tokens."""
    p, s = pattern.split("."), subject.split(".")
    if p[-1] == ">":
        return len(s) >= len(p) and all(a in ("*", b) for a, b in zip(p[:-1], s))
    return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s))
