"""Virtual time: an asyncio event loop whose clock jumps to the next timer whenever every
task is waiting, and the clock actors read from it.

    loop = VirtualTimeLoop()
    loop.run_until_complete(main())      # asyncio.sleep(3600) returns at once, loop.time() == 3600

The loop never blocks: when asyncio would sleep until its next timer, the virtual clock
jumps onto that timer instead. Real file descriptors and signals, if any are registered,
are still polled, without waiting. If nothing is scheduled at all while tasks still wait, the
simulation can never progress: the loop raises instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
from collections.abc import Callable, Coroutine
from typing import Any

_MIN_TIMERS_TO_PURGE = 100  # rebuild the heap when more than half of at least this many are cancelled


class SimulationDeadlock(RuntimeError):
    """Every task waits on something no timer and no message will ever set."""


class _Handle(asyncio.Handle):
    """asyncio.Handle as it is outside debug mode, built without asking the loop whether it
    is in debug mode: a simulation builds a few million (every future's wake-up is one)."""

    __slots__ = ()

    def __init__(self, callback, args, loop, context=None) -> None:
        self._context = contextvars.copy_context() if context is None else context
        self._loop = loop
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._repr = None
        self._source_traceback = None


class _TimerHandle(asyncio.TimerHandle):
    """asyncio.TimerHandle as it is outside debug mode (see `_Handle`)."""

    __slots__ = ()

    def __init__(self, when, callback, args, loop, context=None) -> None:
        self._context = contextvars.copy_context() if context is None else context
        self._loop = loop
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._repr = None
        self._source_traceback = None
        self._when = when
        self._scheduled = False


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """asyncio's selector loop with its own scheduler turn (`_run_once`): timers sit in a heap
    of (when, order, handle) tuples, compared in C and fired in the order they were set when
    due together; with nothing ready, the clock jumps onto the earliest timer. Outside debug
    mode, `call_soon` and `call_at` build their handles directly (`_Handle`)."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._virtual_now_s = start_s
        self._timer_order = itertools.count()
        super().__init__()
        # the selector's own map of registered file descriptors, read every turn without
        # building a mapping view (`selectors` keeps it for the selector's lifetime)
        self._registered_fds = getattr(self._selector, "_fd_to_key", None) or self._selector.get_map()

    def time(self) -> float:
        return self._virtual_now_s

    def call_soon(self, callback, *args, context=None):
        if self._debug:
            return super().call_soon(callback, *args, context=context)
        self._check_closed()
        handle = _Handle(callback, args, self, context)
        self._ready.append(handle)
        return handle

    def call_at(self, when, callback, *args, context=None):
        self._check_closed()
        timer = (
            asyncio.TimerHandle(when, callback, args, self, context) if self._debug else _TimerHandle(when, callback, args, self, context)
        )
        heapq.heappush(self._scheduled, (when, next(self._timer_order), timer))
        timer._scheduled = True
        return timer

    def _polls_io(self) -> bool:
        """Is there real I/O to poll: a file descriptor besides the loop's self-pipe, or a
        signal handler (signals arrive through the self-pipe)? A simulation has neither, and
        a select() system call before every jump of the clock cost it a few percent.
        (Callbacks from other threads need no poll: `call_soon_threadsafe` queues them
        directly; its byte in the self-pipe only wakes a loop that blocks, which this never does.)"""
        return len(self._registered_fds) > 1 or bool(getattr(self, "_signal_handlers", None))

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
            events = self._selector.select(0) if self._polls_io() else None  # never wait
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
            if handle._cancelled:
                continue
            try:  # Handle._run, inlined: a frame less for each of the millions of callbacks
                handle._context.run(handle._callback, *handle._args)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:
                self._callback_failed(handle, exc)

    def _callback_failed(self, handle: asyncio.Handle, exc: BaseException) -> None:
        """What Handle._run does with a callback's exception: the loop's exception handler."""
        context = {"message": f"Exception in callback {handle!r}", "exception": exc, "handle": handle}
        if handle._source_traceback:
            context["source_traceback"] = handle._source_traceback
        self.call_exception_handler(context)


async def _return_at_once() -> None:
    """A sleep that is already over: returns without yielding to the loop."""


def _wake(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.set_result(None)


class LoopClock:
    """The actors' Clock on the running loop's time (virtual under VirtualTimeLoop): model
    seconds are loop seconds; a wall period of a live run at `time_scale` spans
    `time_scale` × its length, as it does in model time live.

    `loop`: the loop it reads and sleeps on (a simulation passes its own); None: whichever
    runs at each call. (`asyncio.get_running_loop` makes a getpid system call on every call,
    and a large simulation reads the clock millions of times.)"""

    def __init__(self, time_scale: float = 1.0, origin_wall_s: float = 0.0, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.origin_wall_s = origin_wall_s
        self.time_scale = time_scale
        self._loop = loop
        self._loop_time = None if loop is None else loop.time  # read millions of times: bound once

    def _running_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop or asyncio.get_running_loop()

    def now_s(self) -> float:
        loop_time = self._loop_time
        return (asyncio.get_running_loop().time() if loop_time is None else loop_time()) - self.origin_wall_s

    def to_wall_s(self, model_s: float) -> float:
        return model_s

    def loop_s(self, wall_s: float) -> float:
        return wall_s * self.time_scale

    # The sleeps return the coroutine that waits instead of being coroutines that await it:
    # one frame less to resume on every wake-up, and the awaiting caller sees no difference.
    def sleep_until(self, at_s: float) -> Coroutine[Any, Any, None]:
        delay_s = at_s - self.now_s()
        return self._sleep(delay_s) if delay_s > 0 else _return_at_once()

    def sleep(self, duration_s: float) -> Coroutine[Any, Any, None]:
        return self.sleep_until(self.now_s() + duration_s)

    def sleep_wall(self, wall_s: float) -> Coroutine[Any, Any, None]:
        return self._sleep(self.loop_s(wall_s))

    def call_later_wall(self, wall_s: float, callback: Callable[..., object], *args: object) -> asyncio.TimerHandle:
        """Call `callback(*args)` once a wall period of a live run has passed: the very timer
        `sleep_wall(wall_s)` sets, for a callback instead of a task."""
        loop = self._running_loop()
        return loop.call_at(loop.time() + self.loop_s(wall_s), callback, *args)

    async def _sleep(self, delay_s: float) -> None:
        """`asyncio.sleep(delay_s)` on this clock's loop, step for step: the same timer at the
        same loop time (now + delay), the same future and wake-up."""
        if delay_s <= 0:
            await asyncio.sleep(0)
            return
        loop = self._running_loop()
        future = loop.create_future()
        timer = loop.call_at(loop.time() + delay_s, _wake, future)
        try:
            await future
        finally:
            timer.cancel()
