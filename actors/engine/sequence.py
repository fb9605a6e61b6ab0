"""What the scheduler core schedules (actors/engine/core.py): a turn's sequence, one planned
step, and a prefilled turn held for a decode engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from bus_schemas.work import PrefillWork

# where a sequence is in its engine core (`Seq.place`, kept by actors/engine/kv_ledger.py)
OUT, WAITING, RUNNING, HELD = 0, 1, 2, 3


@dataclass(slots=True, eq=False)
class Seq:
    work: PrefillWork
    target_tokens: int  # tokens this turn generates (emulated: from the work item)
    cached_prefix_tokens: int  # history found in the prefix cache
    prefill_tokens: int  # tokens to compute: uncached history + the turn's new tokens
    handoff: bool  # prefill role: stop after prefill and hand the KV over
    prefill_done_tokens: int = 0
    generated: int = 0
    generated_before_prefill: int = 0  # > 0 after a preemption: those tokens are recomputed as prompt
    rank: int = 0  # DP-attention rank the sequence lives on
    preempted: bool = False  # lost its KV to a preemption; waits until a full recompute fits
    prefill_started: bool = False
    decode_started: bool = False
    prefill_engine_id: str = ""
    oldest_version: int = -1  # a weight update interrupted the turn: the version of its first tokens
    place: int = OUT  # OUT, WAITING, RUNNING or HELD in its engine core (the core's ledger sets it)

    @property
    def key(self) -> str:
        return self.work.work_id

    @property
    def kv_tokens(self) -> int:
        """KV resident for this sequence now."""
        return self.cached_prefix_tokens + self.prefill_done_tokens + self.generated - self.generated_before_prefill

    @property
    def kv_reserved_tokens(self) -> int:
        """KV this sequence occupies once its prefill is through (admission reserves it)."""
        return self.cached_prefix_tokens + self.prefill_tokens + self.generated - self.generated_before_prefill

    @property
    def max_new_tokens(self) -> int:
        """The turn's output cap (admission reserves growth up to it)."""
        return self.work.max_output_tokens or self.target_tokens

    @property
    def prefill_left(self) -> int:
        return self.prefill_tokens - self.prefill_done_tokens

    @property
    def decode_left(self) -> int:
        return self.target_tokens - self.generated


@dataclass(slots=True)
class Batch:
    prefill: list[tuple[Seq, int]]  # (sequence, chunk tokens)
    decode: list[Seq]
    iterations: int  # iterations this step covers: each decodes a token and prefills each chunk's tokens again
    duration_s: float  # modelled time of the step
    started: list[tuple[str, Seq]] = field(default_factory=list)  # ("prefill_started" | "decode_started", seq)
    ends_s: list[float] | None = None  # when each iteration ends, from the step's start (multi-iteration prefill)
    host_copy_s: float = 0.0  # KV moved to or from host memory before the step (in duration_s and ends_s)
    # the engine's prior cost model's time for the planned iterations, where the step runs
    # otherwise (an emulated engine's `EngineCore.prior`, a torch engine's real forward);
    # None: the step takes the time the prior gives it
    prior_s: float | None = None
    planned_iterations: int = 0  # iterations as planned (a backend may end the step sooner)
    kv_full: bool = False  # the engine's KV pool was at least half full when the step was planned

    def __post_init__(self) -> None:
        self.planned_iterations = self.iterations

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill) * self.iterations

    @property
    def decode_tokens(self) -> int:
        return len(self.decode) * self.iterations


@dataclass(slots=True)
class Held:
    seq: Seq
    expires_at_s: float
