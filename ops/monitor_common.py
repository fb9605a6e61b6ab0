"""Small helpers the monitor's state modules share: rounding for the snapshot, trimming windows."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable


def rounded(x: float | None, nd: int = 3) -> float | None:
    """`x` rounded for the JSON snapshot; None for a missing or non-finite number."""
    if x is None or not math.isfinite(x):
        return None
    return round(float(x), nd)


def drop_before(q: deque, cutoff: float, key: Callable = lambda x: x) -> None:
    """Drop the oldest items of a time-ordered deque while `key(item) < cutoff`."""
    while q and key(q[0]) < cutoff:
        q.popleft()
