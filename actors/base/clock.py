"""The injected clock: the only place actors get time, deadlines and the model↔wall scale.

Everything in messages, logs and summaries is in *model* seconds. Two kinds of duration
meet in an actor:

* model durations (an engine iteration, a tool call, a drain deadline): `now_s`, `sleep`,
  `sleep_until`, and `to_wall_s` for the event-loop seconds one lasts;
* wall periods of a live run (a work-queue pull, a heartbeat, a keep-alive, a retry):
  `loop_s` gives the event-loop seconds one spans, `sleep_wall` waits one out.

``ScaledClock`` (live runs) runs model time at ``time_scale`` × wall speed from a shared
origin, so a demo can compress a 10-minute rollout into 30 s and still report model seconds
that compare directly with an uncompressed run; loop seconds are wall seconds.
``actors.base.virtual.LoopClock`` (simulation) makes loop seconds model seconds and
stretches wall periods by the same ``time_scale``, so a simulated actor sees equally fresh
(or stale) information as a live one at that scale.

Nothing outside this module and ``virtual.py`` reads the wall clock or sleeps
(``tests/test_clock_discipline.py`` holds every actor to it).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    origin_wall_s: float  # the run's model time 0; also tags the run's message ids
    time_scale: float  # model seconds per wall second of a live run (run.time_scale)

    def now_s(self) -> float:
        """Model seconds since the run's origin."""
        ...

    def to_wall_s(self, model_s: float) -> float:
        """Event-loop seconds a model duration lasts (wall seconds live)."""
        ...

    def loop_s(self, wall_s: float) -> float:
        """Event-loop seconds that span `wall_s` of a live run (a pull, a heartbeat period)."""
        ...

    async def sleep_until(self, at_s: float) -> None: ...

    async def sleep(self, duration_s: float) -> None: ...

    async def sleep_wall(self, wall_s: float) -> None: ...


def wall_now_s() -> float:
    """Wall seconds since the epoch: only for setting a run's origin."""
    return time.time()


PROBE_WALL_S = 0.02  # the loop probe's period (watch_loop)
STALL_WALL_S = 0.02  # a probe woken this much late: the process lost a scheduler slice or more (an unloaded run stays under 10 ms)


class ScaledClock:
    def __init__(self, time_scale: float, origin_wall_s: float | None = None) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self.origin_wall_s = wall_now_s() if origin_wall_s is None else origin_wall_s
        # the machine keeping up: timed waits that woke after their model time, and by how much
        # in total (model seconds). A busy CPU shows here first; real-time tests read it.
        self.late_wakeups = 0
        self.late_s = 0.0
        # and the event loop itself: how often, and for how long (model seconds), it could not
        # run for more than STALL_WALL_S past a probe's wake-up (a starved or blocked process).
        # A message that waits in a stalled receiver is late without any timed wait being late.
        self.loop_stalls = 0
        self.loop_stall_s = 0.0

    def now_s(self) -> float:
        return (time.time() - self.origin_wall_s) * self.time_scale

    def to_wall_s(self, model_s: float) -> float:
        return model_s / self.time_scale

    def loop_s(self, wall_s: float) -> float:
        return wall_s

    async def sleep_until(self, at_s: float) -> None:
        delay_wall_s = (at_s - self.now_s()) / self.time_scale
        if delay_wall_s > 0:
            await asyncio.sleep(delay_wall_s)
            late_s = self.now_s() - at_s
            if late_s > 0:
                self.late_wakeups += 1
                self.late_s += late_s

    async def sleep(self, duration_s: float) -> None:
        await self.sleep_until(self.now_s() + duration_s)

    async def sleep_wall(self, wall_s: float) -> None:
        await asyncio.sleep(wall_s)

    async def watch_loop(self) -> None:
        """Run for the actor's life: count the event loop's stalls (`loop_stalls`, `loop_stall_s`)."""
        while True:
            woke_s = time.monotonic() + PROBE_WALL_S
            await asyncio.sleep(PROBE_WALL_S)
            stall_wall_s = time.monotonic() - woke_s
            if stall_wall_s > STALL_WALL_S:
                self.loop_stalls += 1
                self.loop_stall_s += stall_wall_s * self.time_scale
