"""Turn-level work: prefill work, decode work with its KV handle, KV fetches, turn results.

All times are model seconds (see `actors.base.clock`); token counts are tokens.
"""

from __future__ import annotations

import msgspec


def make_work_id(trajectory_id: str, rollout_nonce: str, turn: int, attempt: int) -> str:
    """Unique per submission; the nonce separates reruns of a redelivered trajectory."""
    return f"{trajectory_id}/{rollout_nonce}/t{turn}/a{attempt}"


def retry_work_id(work_id: str, attempt: int) -> str:
    """The work id of a re-prefill of the same turn."""
    return f"{work_id.rsplit('/a', 1)[0]}/a{attempt}"


class PrefillWork(msgspec.Struct, frozen=True, kw_only=True):
    """One turn of one trajectory, ready to be prefilled."""

    work_id: str  # unique per submission of a turn (make_work_id)
    trajectory_id: str  # the trajectory this turn belongs to
    turn: int  # 0-based turn index inside the trajectory
    attempt: int = 0  # 0 for the first submission; +1 for each re-prefill of the same turn
    env_id: str  # environment that owns the trajectory; results go to result.<env_id>
    task_family: str  # workload profile name, e.g. "swe" or "math"
    policy_version: int  # sync: the policy the turn runs on; async: the oldest it may run on (an engine
    # at a newer version restamps the turn with its own version when it admits it)
    context_tokens: int  # tokens of history before this turn (what a prefix cache may hold)
    new_tokens: int  # tokens appended by this turn (the prompt, or the tool observation)
    max_output_tokens: int  # generation cap for this turn
    target_output_tokens: int = 0  # emulated backend only: where the modelled policy stops
    queued_at_s: float  # when the environment submitted the turn
    token_ids: list[int] = []  # real backends: the new tokens themselves (empty when emulated)
    # real backends: the trajectory's whole history before this turn (len == context_tokens), so an
    # engine whose prefix cache misses recomputes it; the full sequence is context_token_ids + token_ids
    context_token_ids: list[int] = []
    # turn 0 with shared prompts (workload.share_prompts): the task's prompt identity — a prefix
    # cache may serve the prompt's KV from a sibling's; empty otherwise
    prompt_key: str = ""
    # a short append sent to the decode engine holding the trajectory's KV: the prefill-side
    # engine holding its prefix, where that engine writes the turn's KV back (engines.kv_writeback
    # = "to-prefill"), as a decode engine does to the engine that prefilled its turn; empty otherwise
    writeback_engine_id: str = ""


class KvHandle(msgspec.Struct, frozen=True, kw_only=True):
    """Where a prefilled turn's KV lives until a decode engine fetches it."""

    engine_id: str  # engine that holds the KV; fetch from subjects.kv(engine_id)
    handle_id: str  # key of the KV on that engine
    tokens: int  # tokens of KV behind the handle (context + new tokens)
    kv_bytes: int  # bytes the transfer moves
    expires_at_s: float  # the holder may drop the KV after this time


class DecodeWork(msgspec.Struct, frozen=True, kw_only=True):
    """A prefilled turn waiting for decode."""

    prefill: PrefillWork  # the turn as submitted
    kv: KvHandle  # where to fetch its KV
    first_token_id: int = -1  # token sampled at the end of prefill (-1 when emulated)
    first_logprob: float = 0.0  # its log-probability under the (tempered) policy
    cached_prefix_tokens: int = 0  # context tokens the prefill engine found in its cache
    prefilled_at_s: float  # when prefill finished
    # > 1: a decode migrated mid-turn (a role switch's hand-off); the tokens generated so far,
    # the last of them sampled but not yet in the KV (emulated backend only)
    generated_tokens: int = 1
    migrated_from: str = ""  # the engine that handed this decode over, empty for a fresh turn
    # a migrated turn that a weight update interrupted: the version of its first tokens (-1: none)
    oldest_policy_version: int = -1


class KvFetch(msgspec.Struct, frozen=True, kw_only=True):
    """Request for one chunk of the KV behind a handle (request/reply on subjects.kv)."""

    handle_id: str
    chunk: int = 0  # 0-based chunk index
    requester_id: str  # engine asking, for logs and counters
    # KV tokens the requester already holds for this trajectory and version (the first have_tokens of
    # context_token_ids + token_ids): the holder sends only positions have_tokens.. (real backends)
    have_tokens: int = 0


class KvChunk(msgspec.Struct, frozen=True, kw_only=True):
    """Reply to a KvFetch: one chunk, or why there is none."""

    handle_id: str
    ok: bool  # False: unknown or expired handle; the decode side must ask for a re-prefill
    error: str = ""  # why ok is False
    chunk: int = 0
    n_chunks: int = 1  # chunks in the whole transfer
    tokens: int = 0  # tokens of KV in the whole transfer
    kv_bytes: int = 0  # bytes of the whole transfer (emulated: what the modelled wait moves)
    checksum: str = ""  # digest of the whole KV, checked after the last chunk (real backends)
    data: bytes = b""  # the chunk's payload (empty when emulated)
    start_tokens: int = 0  # first token position the transfer covers (== the request's have_tokens)


class KvWriteback(msgspec.Struct, frozen=True, kw_only=True):
    """A decode engine's notice (request/reply on subjects.kv_writeback(prefill engine)): the KV
    of a trajectory's finished turn is held under `kv` until the prefill engine fetches it on
    subjects.kv(kv.engine_id), asking only for the positions it lacks (KvFetch.have_tokens)."""

    trajectory_id: str
    turn: int  # the turn whose decode just finished
    policy_version: int  # the KV was computed under this policy; never reused under another
    kv: KvHandle  # tokens: KV positions 0..tokens of the trajectory (context + new + generated - 1)
    prefix_tokens: int = 0  # what the prefill engine most likely holds (the turn's prompt): the expected have_tokens
    token_ids: list[int] = []  # real backends: the ids of those positions (len == kv.tokens)
    finished_at_s: float = 0.0  # when the decode finished


class KvWritebackAck(msgspec.Struct, frozen=True, kw_only=True):
    """Reply to a KvWriteback: the prefill engine will fetch (ok) or not (why)."""

    ok: bool
    error: str = ""


class KvStorePut(msgspec.Struct, frozen=True, kw_only=True):
    """The shared KV store tier (emulated) now holds `tokens` KV positions of a trajectory at a
    policy version (published on subjects.kv_store_put() once the modelled write is done)."""

    trajectory_id: str
    policy_version: int
    tokens: int
    kv_bytes: int  # bytes this write moved into the store
    writer_id: str
    at_s: float


class TurnResult(msgspec.Struct, frozen=True, kw_only=True):
    """A finished turn, returned to the environment that owns the trajectory."""

    work_id: str  # the PrefillWork.work_id this answers
    trajectory_id: str
    turn: int
    policy_version: int  # policy the tokens were generated with (the newest, if a weight update interrupted the turn)
    prefill_engine_id: str
    decode_engine_id: str
    output_tokens: int  # tokens generated in this turn
    cached_prefix_tokens: int = 0  # context tokens served from a prefix cache
    token_ids: list[int] = []  # real backends: the generated tokens
    logprobs: list[float] = []  # real backends: their log-probabilities under the policy
    finished_at_s: float
    # a weight update interrupted the turn and it resumed on `policy_version` with its tokens so
    # far (engines.inflight_on_update = "interrupt"): the version of its first tokens; -1: not interrupted
    oldest_policy_version: int = -1
