"""The emulated backend: a step takes the time the cost model gives it (`costmodel.py`)."""

from __future__ import annotations

from actors.base.clock import Clock
from actors.base.flag import Flag
from actors.engine.core import Batch


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
            per_iteration_s = (batch.duration_s - batch.host_copy_s) / batch.iterations
            done = min(batch.iterations, int(max(0.0, elapsed_s - batch.host_copy_s) / per_iteration_s) + 1)
            batch.duration_s = batch.host_copy_s + done * per_iteration_s
        batch.iterations = done
        end_s = cursor_s + batch.duration_s
        await self.clock.sleep_until(end_s)
        return end_s
