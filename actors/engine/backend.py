"""What runs a planned scheduler step: the backend interface.

The scheduler core (`core.py`) decides *which* sequences prefill and decode in a step; a
backend *runs* that step and says when it ended, in model seconds:

    cursor_s = await backend.run(batch, cursor_s)

* `emulated` (`emulated/backend.py`) waits the step's modelled duration (`batch.duration_s`, from the cost model).
* `torch` (`torch/backend.py`) runs the batch for real in a worker thread, writes the
  measured duration into `batch.duration_s`, the sampled tokens into its own per-sequence
  state, and stops sequences at EOS by lowering their `target_tokens`.
"""

from __future__ import annotations

from typing import Protocol

from actors.engine.core import Batch


class Backend(Protocol):
    name: str
    repeats_prefill: bool  # runs steps whose prefill chunks repeat over several iterations

    async def run(self, batch: Batch, cursor_s: float) -> float:
        """Run one planned step that starts at model time `cursor_s`; return when it ended."""
        ...
