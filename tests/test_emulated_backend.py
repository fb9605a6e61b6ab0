"""The emulated backend waits a step's modelled time, and new work cuts a multi-iteration
step short at the end of the iteration in progress."""

from __future__ import annotations

import asyncio

import pytest

from actors.base.flag import Flag
from actors.base.virtual import LoopClock, VirtualTimeLoop
from actors.engine.core import Batch
from actors.engine.emulated.backend import EmulatedBackend


def run_step(batch: Batch, interrupt_at_s: float | None) -> tuple[float, float]:
    """(what run() returned, loop time after it), the step starting at model time 0."""

    async def main() -> tuple[float, float]:
        wake = Flag()
        backend = EmulatedBackend(LoopClock(), wake)
        if interrupt_at_s is not None:
            asyncio.get_running_loop().call_later(interrupt_at_s, wake.set)
        end_s = await backend.run(batch, 0.0)
        return end_s, asyncio.get_running_loop().time()

    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def test_an_uninterrupted_step_takes_its_modelled_time():
    batch = Batch([], [], 3, 0.45, ends_s=[0.1, 0.25, 0.45])
    assert run_step(batch, None) == (pytest.approx(0.45), pytest.approx(0.45))
    assert batch.iterations == 3


def test_new_work_ends_a_repeated_prefill_step_after_the_iteration_in_progress():
    batch = Batch([], [], 3, 0.45, ends_s=[0.1, 0.25, 0.45])
    end_s, now_s = run_step(batch, interrupt_at_s=0.12)  # during the second iteration
    assert batch.iterations == 2 and batch.duration_s == pytest.approx(0.25)
    assert end_s == pytest.approx(0.25) and now_s == pytest.approx(0.25)


def test_new_work_ends_a_decode_run_after_the_iteration_in_progress():
    batch = Batch([], [], 10, 1.0)  # ten iterations of about 0.1 s
    end_s, _ = run_step(batch, interrupt_at_s=0.33)
    assert batch.iterations == 4 and end_s == pytest.approx(0.4)
