"""tests/subproc.py: a child's output read with a deadline."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.subproc import read_until


def child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-u", "-c", code], stdout=subprocess.PIPE, text=True)


def test_it_returns_the_lines_up_to_the_wanted_one_and_leaves_the_rest_to_the_caller():
    proc = child("for i in range(5): print(f'line {i}')")
    lines = read_until(proc, lambda seen: seen[-1] == "line 2\n", 30.0)
    assert lines == ["line 0\n", "line 1\n", "line 2\n"]
    rest, _ = proc.communicate(timeout=30)
    assert rest == "line 3\nline 4\n" and proc.returncode == 0


def test_a_child_that_hangs_is_killed_at_the_deadline_and_its_output_reported():
    proc = child("import time\nprint('waiting for something', flush=True)\ntime.sleep(600)")
    with pytest.raises(AssertionError, match=r"(?s)within 1 s \(child killed\).*waiting for something"):
        read_until(proc, lambda seen: "ready" in seen[-1], 1.0)
    assert proc.wait(timeout=30) != 0  # killed, not left running


def test_a_child_that_ends_first_fails_with_its_output():
    proc = child("print('bind: port taken')\nraise SystemExit(3)")
    with pytest.raises(AssertionError, match=r"(?s)exit .*before the expected output.*port taken"):
        read_until(proc, lambda seen: "ready" in seen[-1], 30.0)
