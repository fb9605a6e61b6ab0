"""tests/subproc.py: a child's output read with a deadline."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.subproc import read_until


def child(code: str, **popen) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-u", "-c", code], stdout=subprocess.PIPE, text=True, **popen)


def test_it_returns_the_lines_up_to_the_wanted_one_and_leaves_the_rest_to_the_caller():
    proc = child("for i in range(5): print(f'line {i}')")
    lines = read_until(proc, lambda seen: seen[-1] == "line 2\n", 30.0)
    assert lines == ["line 0\n", "line 1\n", "line 2\n"]
    rest, _ = proc.communicate(timeout=30)
    assert rest == "line 3\nline 4\n" and proc.returncode == 0


def test_a_child_that_hangs_is_killed_at_the_deadline_with_its_group_and_its_output_reported():
    """A launcher leads its own process group (its actors and servers in it): at the deadline
    the whole group goes, and the launcher is reaped."""
    code = (
        "import subprocess, sys, time\n"
        "helper = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"  # barrier-ok: a group member that hangs
        "print(f'helper pid {helper.pid}', flush=True)\n"
        "time.sleep(600)\n"  # barrier-ok: the stimulus, a child that hangs
    )
    proc = child(code, start_new_session=True)
    with pytest.raises(AssertionError, match=r"(?s)within 2 s \(child killed\).*helper pid") as err:
        read_until(proc, lambda seen: "ready" in seen[-1], 2.0)
    assert proc.returncode is not None and proc.returncode < 0  # killed and reaped
    helper = int(str(err.value).split("helper pid ")[1].split()[0])
    until = time.monotonic() + 10
    while _alive(helper) and time.monotonic() < until:  # SIGKILL is asynchronous: wait for init to reap it
        time.sleep(0.05)  # barrier-ok: polling the process table, no event to wait on
    assert not _alive(helper)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_child_that_ends_first_fails_with_its_exit_status_and_output():
    proc = child("print('bind: port taken')\nraise SystemExit(3)")
    with pytest.raises(AssertionError, match=r"(?s)exit 3\) before the expected output.*port taken"):
        read_until(proc, lambda seen: "ready" in seen[-1], 30.0)


def test_an_error_in_the_callers_test_is_raised_as_itself():
    proc = child("print('x')")
    with pytest.raises(ZeroDivisionError):
        read_until(proc, lambda seen: 1 / 0, 30.0)
    proc.wait(timeout=30)
