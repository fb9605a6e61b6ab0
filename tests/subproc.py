"""A child's stdout read with a deadline: a child that hangs fails its test within the
deadline, with what it printed, instead of at pytest's timeout with nothing."""

from __future__ import annotations

import os
import queue
import subprocess
import threading
import time
from collections.abc import Callable

_END = None  # the pump's last item: the stream ended, or it stopped after the wanted line


def read_until(proc: subprocess.Popen, done: Callable[[list[str]], bool], deadline_s: float) -> list[str]:
    """The lines of `proc`'s stdout up to the first after which `done(lines)` holds. The
    pump stops there and reads nothing past it, so the rest of the stream is the caller's
    (`communicate`). If the child
    ends first, or nothing satisfies `done` within `deadline_s` (the child is then killed),
    an AssertionError carries every line it printed."""
    lines: queue.Queue[str | None] = queue.Queue()
    found = threading.Event()

    def pump() -> None:
        seen: list[str] = []
        try:
            for line in _unbuffered_lines(proc.stdout.fileno()):
                seen.append(line)
                lines.put(line)
                if done(seen):
                    found.set()
                    return
        finally:
            lines.put(_END)

    thread = threading.Thread(target=pump, name="read_until", daemon=True)
    thread.start()
    seen: list[str] = []
    until = time.monotonic() + deadline_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            proc.kill()  # its stdout closes, so the pump ends
            thread.join(timeout=10)
            seen += [x for x in _drain(lines) if x is not _END]
            raise AssertionError(f"no expected output within {deadline_s:.0f} s (child killed); it printed:\n" + "".join(seen)) from None
        if line is _END:
            if found.is_set():
                return seen
            raise AssertionError(f"child ended (exit {proc.poll()}) before the expected output; it printed:\n" + "".join(seen))
        seen.append(line)


def _unbuffered_lines(fd: int):
    """Lines read from `fd` a byte at a time: nothing past the line taken is read, so it is
    left to `Popen.communicate` (which reads the pipe's descriptor, not the file's buffer)."""
    line = bytearray()
    while byte := os.read(fd, 1):
        line += byte
        if byte == b"\n":
            yield line.decode(errors="replace")
            line.clear()
    if line:
        yield line.decode(errors="replace")


def _drain(q: queue.Queue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out
