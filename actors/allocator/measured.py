"""What the allocator learns of the engines' speed from their own measurements (pure).

Every engine reports, with its heartbeat, how long its steps took by kind (prefill only,
decode only, both in one step; steps of short chunks and decode steps of a part-empty pool
apart) and how long its prior cost model (`engines.preset`) says the same steps take
(`actors/engine/timing.py`). The capacities are those of full prefill chunks and of the
batch a full pool holds, so the steps of short chunks (bound by the weight reads, not the
prefill compute) are reported but not learned from. The fleet's ratio of the two, per kind, is how
far the prior is off there; the allocator's capacities (`capacity.Capacity`) are the prior's
figures times those ratios (`allocator.capacity = "measured"`, `capacity.scaled_capacity`):

    factor(kind) = (N0 x prior factor + n x measured s / prior s) / (N0 + n)

over every engine's steps of that kind in a sliding window (decayed sums: each tick keeps
WINDOW_DECAY of them), n of them: a count-weighted blend in which the prior counts as N0 =
PRIOR_ITERATIONS steps at its own factor, so a few steps move it little and a window of busy
engines overrules it. The measured ratio is one of sums, not a mean of ratios, so long steps
weigh as long. A kind the fleet has not run yet keeps a prior informed by what it has run:
mixed steps start from the prefill factor, decode steps of a full pool from those of a
part-empty one (`decode_short`: a fleet whose pools never fill learns from what it runs), and
every kind from 1. The KV pool is read directly: each engine
reports its pool, and the factor is the reported pools over what the prior gives the same
engines in their roles.

Which capacity figure each factor scales:

* prefill: a prefill engine's seconds per prefill token (and its slope in the context), and
  a decode engine's own prefill cost;
* mixed: a colocated engine's seconds per prefill token (its prefill runs in mixed steps, so
  the ratio carries the lockstep stall beside the prefill compute);
* decode: every decode step time (fastest step, the KV-bound batch's, per-sequence slope);
* kv: every KV pool and the batch it holds.

With engines that run their prior exactly, every sum of measured seconds equals its prior's
to the bit, every factor is exactly 1.0 and the capacities are the prior's unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.allocator.capacity import Scales
from bus_schemas.status import EngineTiming, IterationTimes

# The prior's weight: as many steps at its own factor. An engine runs tens of steps a second;
# within the first seconds of a step the engines' own figures outweigh it [A]
PRIOR_ITERATIONS = 20.0
# Each allocator tick keeps this share of the decayed sums: a window of about 1 / (1 - decay)
# ticks (100 ticks of 2 s: a few minutes of a step) [A]
WINDOW_DECAY = 0.99
KINDS = ("prefill", "decode", "decode_short", "mixed")  # the kinds learned from (actors/engine/timing.py)


def _figures(t: IterationTimes) -> tuple[float, float, float]:
    return t.busy_s, t.prior_s, float(t.iterations)


@dataclass(slots=True)
class MeasuredSpeed:
    """The fleet's decayed sums of measured and prior step seconds per kind, from the engines'
    cumulative reports (a restarted engine, a new incarnation, starts its counters again),
    and the KV pools they report."""

    sums: dict[str, list[float]] = field(default_factory=lambda: {k: [0.0, 0.0, 0.0] for k in KINDS})  # [measured s, prior s, steps]
    last: dict[str, tuple[str, EngineTiming]] = field(default_factory=dict)  # engine -> (incarnation, last report)
    pools: dict[str, tuple[int, int]] = field(default_factory=dict)  # engine -> (reported, prior) KV tokens

    def observe(self, engine_id: str, incarnation: str, timing: EngineTiming | None, kv_tokens: int, prior_kv_tokens: int) -> None:
        """Count what `engine_id` ran since its last report."""
        if kv_tokens > 0 and prior_kv_tokens > 0:
            self.pools[engine_id] = (kv_tokens, prior_kv_tokens)
        if timing is None:
            return
        before = self.last.get(engine_id)
        self.last[engine_id] = (incarnation, timing)
        old = before[1] if before is not None and before[0] == incarnation else EngineTiming()
        for kind in KINDS:
            now, then = _figures(getattr(timing, kind)), _figures(getattr(old, kind))
            if all(a >= b for a, b in zip(now, then)):  # counters out of step (a reordered report): skipped
                row = self.sums[kind]
                for i, (a, b) in enumerate(zip(now, then)):
                    row[i] += a - b

    def tick(self) -> None:
        """One allocator tick: the window slides."""
        for row in self.sums.values():
            for i in range(len(row)):
                row[i] *= WINDOW_DECAY

    def factor(self, kind: str, prior_factor: float = 1.0) -> float:
        measured_s, prior_s, steps = self.sums[kind]
        if prior_s <= 0.0 or steps <= 0.0:
            return prior_factor
        return (PRIOR_ITERATIONS * prior_factor + steps * (measured_s / prior_s)) / (PRIOR_ITERATIONS + steps)

    def scales(self) -> Scales:
        prefill = self.factor("prefill")
        reported = sum(r for r, _ in self.pools.values())
        prior = sum(p for _, p in self.pools.values())
        return Scales(
            prefill=prefill,
            decode=self.factor("decode", self.factor("decode_short")),
            mixed=self.factor("mixed", prefill),
            kv=reported / prior if prior else 1.0,
        )
