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

    async def run(self, batch: Batch, cursor_s: float) -> float:
        """Run one planned step that starts at model time `cursor_s`; return when it ended."""
        ...


class EmulatedBackend:
    """Waits the modelled duration. A decode-only step spanning several iterations ends early
    when `interrupt` is set (new work arrived): the iteration in progress completes, the
    batch is shortened to the iterations done, and the scheduler replans with the newcomer,
    as continuous batching would at the next iteration boundary."""

    name = "emulated"

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
        per_iteration_s = batch.duration_s / batch.iterations
        done = min(batch.iterations, int((self.clock.now_s() - cursor_s) / per_iteration_s) + 1)
        batch.iterations = done
        batch.duration_s = done * per_iteration_s
        end_s = cursor_s + batch.duration_s
        await self.clock.sleep_until(end_s)
        return end_s
