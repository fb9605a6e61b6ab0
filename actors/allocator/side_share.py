"""The share of prefill tokens a PD split's prefill side computes (pure), for the evaluator.

A split's decode engines prefill the appends that stay where their KV is; the rest go to the
prefill side. The router's own count (`Demand.remote_share`: appends long enough to send
away, by length alone) is no reading of a split while the fleet is colocated: no decode side
turns an append away then, so it falls towards 0, and a split's decode engines would be
priced as prefilling every append. What a split's engines compute is read here instead, from
their cumulative `prefilled_tokens_total` by role, over the stretches the fleet runs split
and settled (decayed sums, as `throughput.RatioMeter`'s).

Before any split has been read: every token on the prefill side where the decode engines run
DP-attention lockstep (SGLang's router turns an append away from a busy lockstep decode side
while prefill engines hold turns it has not fetched; the fixed splits' prefill sides compute
66-100% of the new tokens on the paper suite's DeepSeek fleet), the router's count elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.allocator.state import EngineState
from actors.allocator.throughput import RATIO_DECAY
from bus_schemas.control import Role


@dataclass(slots=True)
class SideShare:
    last: dict[str, int] = field(default_factory=dict)  # engine id -> prefilled_tokens_total last seen
    sums: list[float] = field(default_factory=lambda: [0.0, 0.0])  # decayed [prefill side, every engine]

    def observe(self, engines: list[EngineState], split_settled: bool) -> None:
        """Count the tokens each engine prefilled since the last call, by its role, where the
        fleet ran split and settled (an engine restart, which resets its counter, is skipped)."""
        side = total = 0
        for e in engines:
            before = self.last.get(e.engine_id)
            self.last[e.engine_id] = e.prefilled_tokens_total
            if before is None or e.prefilled_tokens_total < before:
                continue
            side += (e.prefilled_tokens_total - before) * (e.role is Role.PREFILL)
            total += e.prefilled_tokens_total - before
        if split_settled and total > 0:
            self.sums = [RATIO_DECAY * self.sums[0] + side, RATIO_DECAY * self.sums[1] + total]

    def share(self, lockstep_decode: bool, router_share: float) -> float:
        """The prefill side's share of a split's prefill tokens (module docstring)."""
        if self.sums[1] > 0:
            return self.sums[0] / self.sums[1]
        return 1.0 if lockstep_decode else router_share
