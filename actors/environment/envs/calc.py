"""`calc` — "write digits for the calculator", the task the tiny model learns.

The prompt names two numbers; each turn the model writes up to `max_output_tokens` tokens;
the calculator tool sums every digit the model wrote in that turn and answers with the sum
(the next turn's observation). Reward: digits written over the whole trajectory / the
trajectory's token budget, in [0, 1], given when the last turn ends. A randomly initialised
byte-level model writes a digit ~4% of the time; GRPO raises it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from actors.environment.interface import ModelOutput, StepResult, Task

TURNS, MAX_OUTPUT_TOKENS = 2, 24


@dataclass(frozen=True, slots=True)
class CalcTask:
    name: str = "calc"
    turns: int = TURNS
    max_output_tokens: int = MAX_OUTPUT_TOKENS

    def prompt(self, run_seed: int, task_seed: int) -> str:
        rng = np.random.default_rng([run_seed, task_seed, 11])
        a, b = (int(x) for x in rng.integers(0, 1000, size=2))
        return f"calc {a} {b}:"

    def tool(self, written: str) -> str:
        """The calculator: sums the digits of what the model wrote."""
        digits = [int(c) for c in written if c.isascii() and c.isdigit()]
        expression = "+".join(str(d) for d in digits) or "0"
        return f"\n= {expression} = {sum(digits)}\n"

    def reward(self, outputs: list[str]) -> float:
        """Digits written, over the trajectory's token budget."""
        digits = sum(1 for text in outputs for c in text if c.isascii() and c.isdigit())
        return min(1.0, digits / (self.turns * self.max_output_tokens))


class CalcEnvironment:
    """`CalcTask` behind the environment interface: one instance per trajectory."""

    max_output_tokens = MAX_OUTPUT_TOKENS

    def __init__(self, turns: int = TURNS) -> None:
        self.task = CalcTask(turns=turns)
        self.outputs: list[str] = []

    async def reset(self, task: Task) -> str:
        return self.task.prompt(task.run_seed, task.seed)

    async def step(self, output: ModelOutput) -> StepResult:
        self.outputs.append(output.text)
        if len(self.outputs) >= self.task.turns:
            return StepResult(reward=self.task.reward(self.outputs), done=True)
        return StepResult(observation=self.task.tool(output.text))
