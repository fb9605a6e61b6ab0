"""Virtual time: an asyncio event loop whose clock jumps to the next timer whenever every
task is waiting, and the clock actors read from it.

    loop = VirtualTimeLoop()
    loop.run_until_complete(main())      # asyncio.sleep(3600) returns at once, loop.time() == 3600

The loop's selector never blocks on a timeout: when asyncio would sleep until its next
timer, the virtual clock advances by that timeout instead. Real file descriptors (the
loop's self-pipe) are still polled, without waiting. If nothing is scheduled at all while
tasks still wait, the simulation can never progress: the selector raises instead of
hanging.
"""

from __future__ import annotations

import asyncio
import selectors


class SimulationDeadlock(RuntimeError):
    """Every task waits on something no timer and no message will ever set."""


class _VirtualSelector(selectors.DefaultSelector):
    def __init__(self, advance) -> None:
        super().__init__()
        self._advance = advance

    def select(self, timeout: float | None = None):
        if timeout == 0:  # callbacks are ready: run them (the self-pipe is read at the next wait)
            return []
        ready = super().select(0)
        if ready:
            return ready
        if timeout is None:
            raise SimulationDeadlock("simulation deadlock: tasks wait, but no timer is scheduled")
        if timeout > 0:
            self._advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start_s: float = 0.0) -> None:
        self._virtual_now_s = start_s
        super().__init__(selector=_VirtualSelector(self._advance))

    def _advance(self, duration_s: float) -> None:
        # Jump exactly onto the next timer: adding a tiny timeout to a large time can round
        # to no change at all in floating point, and the loop would spin without progress.
        target_s = self._virtual_now_s + duration_s
        if self._scheduled:
            target_s = max(target_s, self._scheduled[0].when())
        self._virtual_now_s = target_s

    def time(self) -> float:
        return self._virtual_now_s


class LoopClock:
    """The actors' Clock on the running loop's time (virtual under VirtualTimeLoop): model
    seconds are loop seconds, no scaling."""

    def __init__(self, origin_wall_s: float = 0.0) -> None:
        self.origin_wall_s = origin_wall_s
        self.time_scale = 1.0

    def now_s(self) -> float:
        return asyncio.get_running_loop().time() - self.origin_wall_s

    def to_wall_s(self, model_s: float) -> float:
        return model_s

    async def sleep_until(self, at_s: float) -> None:
        delay_s = at_s - self.now_s()
        if delay_s > 0:
            await asyncio.sleep(delay_s)

    async def sleep(self, duration_s: float) -> None:
        await self.sleep_until(self.now_s() + duration_s)
