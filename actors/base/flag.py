"""`Flag`: an `asyncio.Event` whose wait takes a timeout at the cost of one future and one
timer.

    woke = await flag.wait(timeout_s=0.5)   # True: set; False: timed out

`asyncio.wait_for(event.wait(), t)` wraps the wait in a task and a second future on every
call; the engines wait like this hundreds of times per model second in a large simulated
fleet, so the wrapper dominated a simulation's CPU time. `wait()` with no timeout awaits
like `Event.wait()`, so a Flag also goes wherever an `asyncio.Event` is awaited.
"""

from __future__ import annotations

import asyncio


def resolve_if_pending(future: asyncio.Future, value: object) -> None:
    """A timer's callback: end a wait with `value` unless something ended it first."""
    if not future.done():
        future.set_result(value)


class Flag:
    __slots__ = ("_is_set", "_waiters")

    def __init__(self) -> None:
        self._is_set = False
        self._waiters: list[asyncio.Future] = []

    def is_set(self) -> bool:
        return self._is_set

    def set(self) -> None:
        if self._is_set:
            return
        self._is_set = True
        waiters, self._waiters = self._waiters, []
        for future in waiters:  # in the order they began to wait, as asyncio.Event
            if not future.done():
                future.set_result(True)

    def clear(self) -> None:
        self._is_set = False

    async def wait(self, timeout_s: float | None = None) -> bool:
        """Return True once set (at once if it is), False after `timeout_s` (None: never)."""
        if self._is_set:
            return True
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiters.append(future)
        timer = None if timeout_s is None else loop.call_later(max(0.0, timeout_s), resolve_if_pending, future, False)
        try:
            return await future
        finally:
            if timer is not None:
                timer.cancel()
            try:  # timed out or cancelled: no longer waiting (once set, the list was emptied)
                self._waiters.remove(future)
            except ValueError:
                pass
