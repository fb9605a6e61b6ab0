"""`code` — a miniature SWE task family: the agent writes Python, a sandbox runs it against
tests, the agent sees what it printed and which tests failed, and tries again.

Each task (`code_tasks.jsonl`, one JSON object a line: `id`, `prompt`, `tests`, each test a
Python expression that must be true, and a reference `solution` the tests check) asks for
one function. Every turn the model's code (the
last ```python block of its output, else all of it) runs in `sandbox.run_python`, followed
by a harness that evaluates each test in the code's namespace. The observation is the exit
status, what the code printed (cut to `observation_chars`) and the test summary. The
trajectory ends when every test passes or after `turns` turns; its reward is the share of
tests the last turn passed.

The harness prints its verdict behind a per-run nonce that the code is not given (it is
taken out of `sys.argv` before the code runs), so printing "passed" earns nothing. Code that
looks into the harness's frames could still find it: this is a training task, not a contest
judge.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from actors.environment.interface import ModelOutput, StepResult, Task
from actors.environment.sandbox import Limits, RunResult, run_python

TASKS_FILE = Path(__file__).with_name("code_tasks.jsonl")
FENCE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)

HARNESS = r"""
import sys
_nonce = sys.argv.pop(1)
_tests = {tests!r}
_ns = {{"__name__": "solution"}}
try:
    exec(compile(open("solution.py").read(), "solution.py", "exec"), _ns)
except BaseException as e:
    print(f"{{type(e).__name__}}: {{e}}", file=sys.stderr)
_passed = []
for _t in _tests:
    try:
        _passed.append(bool(eval(_t, _ns)))
    except BaseException:
        _passed.append(False)
print(_nonce, "".join("1" if p else "0" for p in _passed))
"""


@dataclass(frozen=True, slots=True)
class CodeTask:
    id: str
    prompt: str
    tests: tuple[str, ...]
    solution: str  # passes every test (tests/test_sandbox.py); never shown to the agent


@cache
def load_tasks(path: Path = TASKS_FILE) -> tuple[CodeTask, ...]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return tuple(CodeTask(d["id"], d["prompt"], tuple(d["tests"]), d["solution"]) for d in lines)


def extract_code(text: str) -> str:
    """The last fenced Python block of the model's output, else the whole output."""
    blocks = FENCE.findall(text)
    return blocks[-1] if blocks else text


def verdict(result: RunResult, nonce: str, tests: int) -> tuple[list[bool], str]:
    """Each test's outcome (all failed where the harness printed no verdict) and the stdout the
    agent may see (the verdict line taken out)."""
    passed, shown = [False] * tests, []
    for line in result.stdout.splitlines():
        if line.startswith(nonce + " "):
            flags = line[len(nonce) + 1 :]
            passed = [c == "1" for c in flags[:tests]] + [False] * max(0, tests - len(flags))
        else:
            shown.append(line)
    return passed, "\n".join(shown)


class CodeEnvironment:
    """One trajectory of the `code` family (options: `turns`, `observation_chars`, the sandbox's limits)."""

    max_output_tokens = 256

    def __init__(self, turns: int = 3, observation_chars: int = 400, wall_s: float = 10.0, cpu_s: int = 5, memory_mib: int = 512) -> None:
        self.turns = turns
        self.observation_chars = observation_chars
        self.limits = Limits(wall_s=wall_s, cpu_s=cpu_s, memory_bytes=memory_mib << 20)
        self.task: CodeTask | None = None
        self.turn = 0

    async def reset(self, task: Task) -> str:
        tasks = load_tasks()
        self.task = tasks[task.seed % len(tasks)]
        return f"# {self.task.prompt}\n# Reply with Python code only.\n"

    async def step(self, output: ModelOutput) -> StepResult:
        assert self.task is not None, "step before reset"
        passed, shown = await self.run(extract_code(output.text))
        self.turn += 1
        done = all(passed) or self.turn >= self.turns
        reward = sum(passed) / len(passed) if done else 0.0
        return StepResult(observation="" if done else shown, reward=reward, done=done, info={"passed": sum(passed)})

    async def run(self, code: str) -> tuple[list[bool], str]:
        """Run `code` with the task's tests: each test's outcome, and the observation."""
        nonce = secrets.token_hex(8)
        harness = HARNESS.format(tests=list(self.task.tests))
        result = await run_python(harness, self.limits, files={"solution.py": code}, args=(nonce,))
        passed, stdout = verdict(result, nonce, len(self.task.tests))
        status = "timed out" if result.timed_out else f"exit {result.exit_code}"
        text = f"\n[{status}] tests passed: {sum(passed)}/{len(passed)}\n{stdout}\n{result.stderr}"
        return passed, text[: self.observation_chars] + "\n"
