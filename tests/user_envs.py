"""User environments for the tests (`environments.entrypoint = "tests.user_envs:..."`)."""

from __future__ import annotations

import asyncio
import time

from actors.environment.interface import ModelOutput, StepResult, Task


class Misbehaving:
    """One way to fail per GRPO sample: 0 and 5 behave (two turns, reward 0.5 per turn); step
    raises on 1, hangs on 2, returns garbage on 3; reset raises on 4."""

    def __init__(self, greeting: str = "hi") -> None:
        self.greeting = greeting
        self.sample = -1

    async def reset(self, task: Task) -> str:
        self.sample = task.sample_index
        if self.sample == 4:
            raise KeyError("no such task")
        return f"{self.greeting} {task.task_id}:"

    async def step(self, output: ModelOutput) -> StepResult | tuple:
        if self.sample == 1:
            raise RuntimeError("tool crashed")
        if self.sample == 2:
            await asyncio.sleep(3600)  # barrier-ok: a step that hangs, for the timeout to end
        if self.sample == 3:
            return {"observation": "not a tuple"}
        return (list(output.token_ids[:3]), 0.5, output.turn >= 1)  # token ids as the observation


class SyncBlocking:
    """Plain (not async) methods; step blocks its thread for good on the second sample."""

    def reset(self, task: Task) -> list[int]:
        self.sample = task.sample_index
        return [104, 105, 58]  # "hi:" in the byte tokenizer

    def step(self, output: ModelOutput) -> StepResult:
        if self.sample == 1:
            time.sleep(3600)  # barrier-ok: a blocked thread, for the timeout to abandon
        return StepResult(reward=1.0, done=True)
