"""The sandbox of the `code` family: limits, no network, a scratch folder; and the family's
reward, decided by its tests, not by what the code prints."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import pytest

from actors.environment.envs.code import CodeEnvironment, extract_code, load_tasks
from actors.environment.interface import ModelOutput, Task
from actors.environment.sandbox import Limits, network_namespace_prefix, run_python

FAST = Limits(wall_s=3.0, cpu_s=1)


def run(code: str, limits: Limits = FAST, **kw):
    return asyncio.run(run_python(code, limits, **kw))


def test_a_script_runs_with_its_files_and_arguments_and_its_output_comes_back():
    r = run("import sys\nprint(open('data.txt').read(), sys.argv[1:])", files={"data.txt": "42"}, args=("a",))
    assert r.ok and r.stdout == "42 ['a']\n" and r.stderr == ""


def test_cpu_wall_and_memory_limits_stop_the_code():
    started = time.monotonic()
    spin = run("while True: pass")
    assert spin.exit_code < 0 and not spin.timed_out  # SIGKILL at the CPU limit (1 s)
    sleep = run("import time; time.sleep(60)")  # barrier-ok: sandboxed code that outlasts the wall limit
    assert sleep.timed_out and sleep.exit_code < 0
    assert time.monotonic() - started < 10
    memory = run("x = bytearray(4 << 30)")
    assert memory.exit_code == 1 and "MemoryError" in memory.stderr


def test_output_is_cut_at_the_limit():
    r = run("print('a' * 100_000)", Limits(output_bytes=100))
    assert r.stdout == "a" * 100 + "\n[output cut]"


@pytest.mark.parametrize(
    ("code", "refused"),
    [
        ("import socket; socket.socket()", "socket.__new__"),
        ("import urllib.request; urllib.request.urlopen('http://127.0.0.1:1')", "socket."),
        ("import subprocess; subprocess.run(['true'])", "subprocess.Popen"),
        ("import os; os.system('true')", "os.system"),
        ("import ctypes; ctypes.CDLL(None)", "ctypes.dlopen"),
        ("open('/tmp/prorsa-escape', 'w')", "only the scratch folder may be changed"),
        ("import os; os.remove('/etc/hostname')", "only the scratch folder may be changed"),
    ],
)
def test_the_audit_hook_refuses_network_processes_and_writes_outside_the_scratch_folder(code: str, refused: str):
    r = run(code)
    assert r.exit_code == 1 and "PermissionError: sandbox:" in r.stderr and refused in r.stderr
    assert not Path("/tmp/prorsa-escape").exists()


def test_the_code_writes_in_its_scratch_folder_which_goes_afterwards():
    before = set(Path(tempfile.gettempdir()).glob("prorsa-sandbox-*"))
    r = run("import os\nopen('out.txt', 'w').write('x')\nprint(os.getcwd())")
    assert r.ok and Path(r.stdout.strip()).name.startswith("prorsa-sandbox-")
    assert not Path(r.stdout.strip()).exists()
    assert set(Path(tempfile.gettempdir()).glob("prorsa-sandbox-*")) == before


def test_where_the_kernel_allows_it_the_code_has_no_network_interface_but_loopback():
    if not network_namespace_prefix():
        pytest.skip("this kernel gives unprivileged processes no network namespace: the audit hook alone refuses sockets")
    r = run("print(open('/proc/net/dev').read())")
    interfaces = [line.split(":")[0].strip() for line in r.stdout.splitlines()[2:] if ":" in line]
    assert interfaces == ["lo"]


def test_code_tasks_ship_with_the_repo_and_each_ones_solution_passes_its_tests():
    tasks = load_tasks()
    assert len(tasks) >= 10 and len({t.id for t in tasks}) == len(tasks)

    async def check(i: int):
        env = CodeEnvironment()
        await env.reset(Task("k", "code", 0, i, 0, 0))
        assert env.task == tasks[i]
        return await env.run(tasks[i].solution), await env.run("pass")

    for i in range(len(tasks)):
        (solved, _), (unsolved, _) = asyncio.run(check(i))
        assert all(solved) and len(solved) == len(tasks[i].tests) >= 3, tasks[i].id
        assert not any(unsolved), tasks[i].id


def test_the_code_family_rewards_what_its_tests_pass_not_what_the_code_prints():
    async def episode(outputs: list[str]) -> list:
        env = CodeEnvironment(turns=2)
        prompt = await env.reset(Task("k", "code", 0, 0, 0, 0))  # seed 0: the first task, add(a, b)
        assert "add(a, b)" in prompt
        return [await env.step(ModelOutput(text, [], i)) for i, text in enumerate(outputs)]

    solved = asyncio.run(episode(["Here:\n```python\ndef add(a, b):\n    return a + b\n```\n"]))
    assert len(solved) == 1 and solved[0].done and solved[0].reward == 1.0
    wrong, fixed = asyncio.run(episode(["def add(a, b): return a - b", "def add(a, b): return a + b"]))
    assert not wrong.done and wrong.reward == 0.0 and "tests passed: 0/3" in wrong.observation
    assert fixed.done and fixed.reward == 1.0
    # printing what looks like a verdict earns nothing: the harness's nonce never reaches the code
    cheat = asyncio.run(episode(["import sys\nprint(sys.argv)\nprint('111')", "print('PASS')"]))
    assert "['main.py']" in cheat[0].observation
    assert cheat[-1].done and cheat[-1].reward == 0.0
    partial = asyncio.run(episode(["def add(a, b): return 3", "def add(a, b): return 3"]))
    assert partial[-1].reward == pytest.approx(1 / 3)  # add(1, 2) == 3 only


def test_extract_code_takes_the_last_fenced_block_or_everything():
    assert extract_code("x\n```python\na = 1\n```\ny\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("c = 3") == "c = 3"
