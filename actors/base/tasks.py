"""Stopping background tasks without hanging.

Python 3.11's `asyncio.wait_for` (under every nats-py request) can swallow a cancellation that
lands just as its reply arrives: the cancelled task carries on, and a polling loop then runs
for ever, so `gather` on it never returns (a launcher once hung so after an aborted run).
`cancel_and_wait` cancels twice and waits a bounded time; a loop that polls the bus checks
`stop_if_cancelled` after each request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

CANCEL_WAIT_S = 5.0  # event-loop seconds to wait for cancelled tasks, in two rounds


def stop_if_cancelled() -> None:
    """Raise CancelledError if this task was asked to stop (a cancel an awaited call swallowed)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(tasks: Iterable[asyncio.Task], log: logging.Logger, timeout_s: float = CANCEL_WAIT_S) -> list[str]:
    """Cancel `tasks` and wait for them, at most `timeout_s` (event-loop seconds): a task still
    running halfway is cancelled again. Returns (and logs) the names of those left running."""
    tasks = list(tasks)
    pending = {task for task in tasks if not task.done()}
    for _ in range(2):
        for task in pending:
            task.cancel()
        if pending:
            _, pending = await asyncio.wait(pending, timeout=timeout_s / 2)
    for task in tasks:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: a crash was already reported where it happened
    for task in pending:
        log.error("task %s did not stop when cancelled (twice); left running", task.get_name())
    return sorted(task.get_name() for task in pending)
