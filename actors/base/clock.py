"""The injected clock. Everything in messages, logs and summaries is in *model* seconds.

``ScaledClock`` runs model time at ``time_scale`` × wall speed from a shared origin, so a
demo can compress a 10-minute rollout into 30 s and still report model seconds that compare
directly with an uncompressed run. Policy code receives a Clock; it never reads the wall.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    origin_wall_s: float  # the run's model time 0; also tags the run's message ids

    def now_s(self) -> float: ...

    async def sleep_until(self, at_s: float) -> None: ...

    async def sleep(self, duration_s: float) -> None: ...


class ScaledClock:
    def __init__(self, time_scale: float, origin_wall_s: float) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        self.time_scale = time_scale
        self.origin_wall_s = origin_wall_s

    def now_s(self) -> float:
        return (time.time() - self.origin_wall_s) * self.time_scale

    def to_wall_s(self, model_s: float) -> float:
        return model_s / self.time_scale

    async def sleep_until(self, at_s: float) -> None:
        delay_wall_s = (at_s - self.now_s()) / self.time_scale
        if delay_wall_s > 0:
            await asyncio.sleep(delay_wall_s)

    async def sleep(self, duration_s: float) -> None:
        await self.sleep_until(self.now_s() + duration_s)
