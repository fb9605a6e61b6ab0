"""Child-process helpers: children die with their parent, so no run leaves orphans; what to do
when one dies (`Supervision`)."""

from __future__ import annotations

import asyncio
import ctypes
import signal
import subprocess
from collections import Counter
from dataclasses import dataclass, field

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to this child when its parent dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not Linux: the launcher's own cleanup still stops children
        return
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


EXIT_POLL_WALL_S = 0.2


async def exited(proc: subprocess.Popen) -> int:
    """`proc`'s exit code, once it has exited. Polled, not `asyncio.to_thread(proc.wait)`: a
    thread blocked in `wait()` outlives a cancelled task, and `asyncio.run` waits for it at
    exit, so a launcher would hang on a server that something else stopped or restarted."""
    while (code := proc.poll()) is None:
        await asyncio.sleep(EXIT_POLL_WALL_S)
    return code


@dataclass(slots=True)
class Supervision:
    """What the launcher does when an actor process dies (pure: the launcher does the I/O).

    `on_actor_death = "restart"`: the actor is started again after `backoff_wall_s`, doubled at
    each of its restarts, at most `max_restarts` times; then, or under "abort", the run fails.
    The trainer is never restarted: it holds the step under way (which trajectories it still
    waits for) in memory, so a new one would wait for trajectories already collected.
    """

    mode: str  # "restart" | "abort"
    max_restarts: int
    backoff_wall_s: float
    restarts: Counter[str] = field(default_factory=Counter)  # actor name -> restarts so far
    deaths: list[dict] = field(default_factory=list)  # every death, in order, for the summary

    def on_death(self, name: str, kind: str, exit_code: int | None, at_wall_s: float) -> tuple[float | None, str]:
        """(seconds to wait before the restart, or None: the run fails; why)."""
        n = self.restarts[name]
        if self.mode == "abort":
            delay, why = None, "run.on_actor_death = 'abort'"
        elif kind == "trainer":
            delay, why = None, "the trainer is not restarted (it holds the step under way)"
        elif n >= self.max_restarts:
            delay, why = None, f"restarted {n} times already (run.max_restarts = {self.max_restarts})"
        else:
            delay = self.backoff_wall_s * 2**n
            self.restarts[name] += 1
            why = f"restart {n + 1}/{self.max_restarts} in {delay:g} s"
        self.deaths.append({"actor": name, "exit_code": exit_code, "at_wall_s": round(at_wall_s, 3), "restarted": delay is not None})
        return delay, why
