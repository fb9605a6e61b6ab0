"""Virtual time: an asyncio event loop whose clock jumps to the next timer whenever every
task is waiting, and the clock actors read from it.

    loop = VirtualTimeLoop()
    loop.run_until_complete(main())      # asyncio.sleep(3600) returns at once, loop.time() == 3600

The loop never blocks: when asyncio would sleep until its next timer, the virtual clock
jumps onto that timer instead. Real file descriptors (the loop's self-pipe) are still
polled, without waiting. If nothing is scheduled at all while tasks still wait, the
simulation can never progress: the loop raises instead of hanging.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

_MIN_TIMERS_TO_PURGE = 100  # rebuild the heap when more than half of at least this many are cancelled


class SimulationDeadlock(RuntimeError):
    """Every task waits on something no timer and no message will ever set."""


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """asyncio's selector loop with its own scheduler turn (`_run_once`): timers sit in a heap
    of (when, order, handle) tuples, compared in C and fired in the order they were set when
    due together; with nothing ready, the clock jumps onto the earliest timer."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._virtual_now_s = start_s
        self._timer_order = itertools.count()
        super().__init__()

    def time(self) -> float:
        return self._virtual_now_s

    def call_at(self, when, callback, *args, context=None):
        self._check_closed()
        timer = asyncio.TimerHandle(when, callback, args, self, context)
        heapq.heappush(self._scheduled, (when, next(self._timer_order), timer))
        timer._scheduled = True
        return timer

    def _run_once(self) -> None:
        heap, ready = self._scheduled, self._ready
        if len(heap) > _MIN_TIMERS_TO_PURGE and 2 * self._timer_cancelled_count > len(heap):
            live = []
            for entry in heap:
                if entry[2]._cancelled:
                    entry[2]._scheduled = False
                else:
                    live.append(entry)
            heapq.heapify(live)
            self._scheduled = heap = live
            self._timer_cancelled_count = 0
        if not ready and not self._stopping:
            events = self._selector.select(0)  # real file descriptors (the self-pipe): never wait
            if events:
                self._process_events(events)
            else:
                while heap and heap[0][2]._cancelled:  # a cancelled timer must not move the clock
                    heapq.heappop(heap)[2]._scheduled = False
                    self._timer_cancelled_count -= 1
                if not heap:
                    raise SimulationDeadlock("simulation deadlock: tasks wait, but no timer is scheduled")
                self._virtual_now_s = max(self._virtual_now_s, heap[0][0])
        now_s = self._virtual_now_s
        while heap and heap[0][0] <= now_s:
            timer = heapq.heappop(heap)[2]
            timer._scheduled = False
            if timer._cancelled:
                self._timer_cancelled_count -= 1
            else:
                ready.append(timer)
        for _ in range(len(ready)):  # not those the callbacks add: they run next turn
            handle = ready.popleft()
            if not handle._cancelled:
                handle._run()


class LoopClock:
    """The actors' Clock on the running loop's time (virtual under VirtualTimeLoop): model
    seconds are loop seconds; a wall period of a live run at `time_scale` spans
    `time_scale` × its length, as it does in model time live."""

    def __init__(self, time_scale: float = 1.0, origin_wall_s: float = 0.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.origin_wall_s = origin_wall_s
        self.time_scale = time_scale

    def now_s(self) -> float:
        return asyncio.get_running_loop().time() - self.origin_wall_s

    def to_wall_s(self, model_s: float) -> float:
        return model_s

    def loop_s(self, wall_s: float) -> float:
        return wall_s * self.time_scale

    async def sleep_until(self, at_s: float) -> None:
        delay_s = at_s - self.now_s()
        if delay_s > 0:
            await asyncio.sleep(delay_s)

    async def sleep(self, duration_s: float) -> None:
        await self.sleep_until(self.now_s() + duration_s)

    async def sleep_wall(self, wall_s: float) -> None:
        await asyncio.sleep(self.loop_s(wall_s))
