"""What runs a planned scheduler step: the backend interface and the emulated backend.

The scheduler core (`core.py`) decides *which* sequences prefill and decode in a step; a
backend *runs* that step and says when it ended, in model seconds:

    cursor_s = await backend.run(batch, cursor_s)

* `emulated` waits the step's modelled duration (`batch.duration_s`, from the cost model).
* `torch` (`torch_backend.py`) runs the batch for real in a worker thread, writes the
  measured duration into `batch.duration_s`, the sampled tokens into its own per-sequence
  state, and stops sequences at EOS by lowering their `target_tokens`.
"""

from __future__ import annotations

from typing import Protocol

from actors.base.clock import Clock
from actors.base.flag import Flag
from actors.engine.core import Batch


class Backend(Protocol):
    name: str
    repeats_prefill: bool  # runs steps whose prefill chunks repeat over several iterations

    async def run(self, batch: Batch, cursor_s: float) -> float:
        """Run one planned step that starts at model time `cursor_s`; return when it ended."""
        ...


class EmulatedBackend:
    """Waits the modelled duration. A step spanning several iterations ends early when
    `interrupt` is set (new work arrived): the iteration in progress completes, the batch is
    shortened to the iterations done, and the scheduler replans with the newcomer, as
    continuous batching would at the next iteration boundary."""

    name = "emulated"
    repeats_prefill = True

    def __init__(self, clock: Clock, interrupt: Flag | None = None) -> None:
        self.clock = clock
        self.interrupt = interrupt

    async def run(self, batch: Batch, cursor_s: float) -> float:
        end_s = cursor_s + batch.duration_s
        if batch.iterations <= 1 or self.interrupt is None:
            await self.clock.sleep_until(end_s)
            return end_s
        if not await self.interrupt.wait(self.clock.to_wall_s(end_s - self.clock.now_s())):
            await self.clock.sleep_until(end_s)  # timed out: at end_s, give or take rounding
            return end_s
        elapsed_s = self.clock.now_s() - cursor_s
        if batch.ends_s is not None:  # iterations of their own lengths
            done = min(batch.iterations, 1 + sum(1 for e in batch.ends_s if e <= elapsed_s))
            batch.duration_s = batch.ends_s[done - 1]
        else:  # a decode-only run: iterations of about equal length
            per_iteration_s = batch.duration_s / batch.iterations
            done = min(batch.iterations, int(elapsed_s / per_iteration_s) + 1)
            batch.duration_s = done * per_iteration_s
        batch.iterations = done
        end_s = cursor_s + batch.duration_s
        await self.clock.sleep_until(end_s)
        return end_s
