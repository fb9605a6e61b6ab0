"""What an engine measures of its own steps (pure): iteration times by kind, for the allocator.

Every scheduler step an engine completes is counted under its kind:

* `prefill`: prefill chunks and no decode (a prefill engine's steps; a colocated engine's
  when none of its ranks decodes);
* `decode`: decodes and no prefill;
* `mixed`: both in one step (colocated engines, and decode engines prefilling short appends);

and `prefill` and `mixed` steps whose chunks fill less than FULL_CHUNK_SHARE of the budget of
the ranks that prefill apart, as `prefill_short` and `mixed_short`: a short chunk's step is
bound by reading the weights, not by the prefill compute, and the capacities the allocator
prices are those of full chunks (`actors.allocator.capacity`); so are `decode` steps of an
engine whose KV pool is less than FULL_KV_SHARE full, as `decode_short`: the allocator
prices decode steps at the batch a full pool holds, where a step's fixed costs weigh less;

with its measured seconds (torch: the wall clock of the forward; vLLM: its engine core's
clock, `actors.engine.vllm.steps`; emulated: the cost model the engine runs,
`engines.truth`), the seconds the engine's prior cost model (`engines.preset`) gives the
same step, and the prefill and decode tokens it computed. The sums are cumulative
since the engine started; the allocator reads them as a sliding window
(`actors.allocator.measured`), and their ratio of measured to prior time is what the engines
tell it about their own speed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.engine.sequence import Batch
from bus_schemas.status import EngineTiming, IterationTimes

KINDS = ("prefill", "prefill_short", "decode", "decode_short", "mixed", "mixed_short")
FULL_CHUNK_SHARE = 0.5  # a step's chunks fill at least this share of its prefilling ranks' budget
FULL_KV_SHARE = 0.5  # a decode step's engine holds at least this share of its KV pool


def kind_of(batch: Batch, rank_chunk_tokens: int) -> str:
    if not batch.prefill:
        return "decode" if batch.kv_full else "decode_short"
    kind = "mixed" if batch.decode else "prefill"
    ranks = len({seq.rank for seq, _ in batch.prefill})
    full = sum(n for _, n in batch.prefill) >= FULL_CHUNK_SHARE * rank_chunk_tokens * ranks
    return kind if full else f"{kind}_short"


@dataclass(slots=True)
class IterationMeter:
    """Cumulative [iterations, measured s, prior s, prefill tokens, decode tokens] per kind."""

    sums: dict[str, list[float]] = field(default_factory=lambda: {k: [0, 0.0, 0.0, 0, 0] for k in KINDS})

    def count(self, batch: Batch, rank_chunk_tokens: int) -> None:
        """Count a completed step (`rank_chunk_tokens`: each rank's prefill budget). A step the
        backend ended early (fewer iterations than planned) is charged its prior time pro rata."""
        measured_s = batch.duration_s
        if batch.prior_s is None:  # the engine runs its prior model: the same time
            prior_s = measured_s
        else:
            prior_s = batch.prior_s * batch.iterations / max(1, batch.planned_iterations)
        self.add(kind_of(batch, rank_chunk_tokens), batch.iterations, measured_s, prior_s, batch.prefill_tokens, batch.decode_tokens)

    def add(self, kind: str, iterations: int, measured_s: float, prior_s: float, prefill_tokens: int, decode_tokens: int) -> None:
        """Count steps of `kind` an engine timed itself (a vLLM engine's, `actors.engine.vllm.steps`)."""
        row = self.sums[kind]
        row[0] += iterations
        row[1] += measured_s
        row[2] += prior_s
        row[3] += prefill_tokens
        row[4] += decode_tokens

    def report(self) -> EngineTiming:
        def times(kind: str) -> IterationTimes:
            iterations, busy_s, prior_s, prefill, decode = self.sums[kind]
            return IterationTimes(
                iterations=int(iterations), busy_s=busy_s, prior_s=prior_s, prefill_tokens=int(prefill), decode_tokens=int(decode)
            )

        return EngineTiming(**{kind: times(kind) for kind in KINDS})
