"""Child-process helpers: children die with their parent, so no run leaves orphans."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """preexec_fn: the kernel sends SIGTERM to this child when its parent dies (Linux)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # not Linux: the launcher's own cleanup still stops children
        return
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
