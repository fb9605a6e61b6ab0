"""A child's stdout read with a deadline: a child that hangs fails its test within the
deadline, with what it printed, instead of at pytest's timeout with nothing."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable

_END = None  # the pump's last item: the stream ended, or it stopped after the wanted line
REAP_WALL_S = 10.0


def read_until(proc: subprocess.Popen, done: Callable[[list[str]], bool], deadline_s: float) -> list[str]:
    """The lines of `proc`'s stdout up to the first after which `done(lines)` holds. The pump
    stops there and reads nothing past it, so the rest of the stream is the caller's
    (`communicate`). If the child ends first, or nothing satisfies `done` within
    `deadline_s` (the child is then killed, with its process group where it leads one: a
    launcher's actors and servers), an AssertionError carries every line it printed."""
    lines: queue.Queue[str | BaseException | None] = queue.Queue()
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
        except BaseException as err:  # a failing `done`, say: the caller's error, not a child that ended
            lines.put(err)
        finally:
            lines.put(_END)

    thread = threading.Thread(target=pump, name="read_until", daemon=True)
    thread.start()
    seen: list[str] = []
    until = time.monotonic() + deadline_s
    while True:
        try:
            item = lines.get(timeout=max(0.0, until - time.monotonic()))
        except queue.Empty:
            kill(proc)  # its stdout closes, so the pump ends
            thread.join(timeout=REAP_WALL_S)
            seen += [x for x in _drain(lines) if isinstance(x, str)]
            raise AssertionError(f"no expected output within {deadline_s:.0f} s (child killed); it printed:\n" + "".join(seen)) from None
        if isinstance(item, BaseException):
            raise item
        if item is _END:
            if found.is_set():
                return seen
            raise AssertionError(f"child ended (exit {_exit_code(proc)}) before the expected output; it printed:\n" + "".join(seen))
        seen.append(item)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child, and its process group where it leads one (never the caller's), and
    reap it."""
    try:
        if os.getpgid(proc.pid) == proc.pid != os.getpgid(0):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:
        pass  # gone already
    _exit_code(proc)


def _exit_code(proc: subprocess.Popen) -> int | None:
    """The child's exit status once it has exited (its stdout can close a moment before)."""
    try:
        return proc.wait(timeout=REAP_WALL_S)
    except subprocess.TimeoutExpired:
        return None


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
