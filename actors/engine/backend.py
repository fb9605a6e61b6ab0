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
from actors.engine.core import Batch


class Backend(Protocol):
    name: str

    async def run(self, batch: Batch, cursor_s: float) -> float:
        """Run one planned step that starts at model time `cursor_s`; return when it ended."""
        ...


class EmulatedBackend:
    name = "emulated"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock

    async def run(self, batch: Batch, cursor_s: float) -> float:
        cursor_s += batch.duration_s
        await self.clock.sleep_until(cursor_s)
        return cursor_s
