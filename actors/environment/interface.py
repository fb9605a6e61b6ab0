"""The environment interface: a user's agent environment, run by Prorsa's environment actor.

    trainer ──TaskAssignment──▶ environment actor ──reset(task)──▶ user class
                                     │  ▲                              │
           prefill / decode ◀────────┘  └──── observation ◀────────────┘
                 │ model output (text + token ids)
                 └──────────────────▶ step(output) ──▶ observation, reward, done

One instance per trajectory, built with the config's `environments.options` as keyword
arguments. `reset` and `step` may be `async def` (awaited, cancelled at the timeout) or plain
functions (run in a worker thread and abandoned at the timeout). An observation is text
(tokenized with the model checkpoint's tokenizer), token ids (appended as they are), or
chat messages (`[{"role": "tool", "content": ...}]`, rendered with the checkpoint's chat
template). The trajectory's reward is the sum of the rewards `step` returns. Prorsa keeps the
token ids, logprobs and masks, emits the lifecycle events, and hands the finished trajectory
to the trainer.

A call that raises, outlasts `environments.step_timeout_wall_s` or returns something that is
not an observation ends that trajectory only (`UserCodeError`): reward 0, an `env_error`
event naming the reason, a counter per reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Message = dict[str, str]
Observation = str | list[int] | list[Message]


@dataclass(frozen=True, slots=True)
class Task:
    """What `reset` is told: the task (its G samples share `task_id` and `seed`) and this sample."""

    task_id: str
    family: str
    run_seed: int  # `run.seed`
    seed: int  # the task id, hashed (crc32): a task's G samples get one prompt
    sample_index: int  # 0..G-1
    step: int
    trajectory_id: str = ""  # this rollout's id in the run ("s<step>-k<task>-g<sample>")


@dataclass(frozen=True, slots=True)
class ModelOutput:
    """One turn of the model: its text (the checkpoint's tokenizer, special tokens skipped) and ids."""

    text: str
    token_ids: list[int]
    turn: int
    logprobs: list[float] = field(default_factory=list)  # the sampled tokens' log-probabilities


@dataclass(frozen=True, slots=True)
class StepResult:
    observation: Observation = ""
    reward: float = 0.0
    done: bool = False
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """What a user class provides (`max_output_tokens` is optional: a cap per turn)."""

    async def reset(self, task: Task) -> Observation: ...

    async def step(self, output: ModelOutput) -> StepResult | tuple[Observation, float, bool]: ...


class UserCodeError(Exception):
    """The user's environment failed a call; `reason` is a counter name, the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EntrypointError(ValueError):
    """`environments.entrypoint` names nothing usable."""


def load_class(entrypoint: str) -> type:
    """The class `package.module:Class` names, checked to have `reset` and `step`."""
    module_name, sep, attr = entrypoint.partition(":")
    if not sep or not module_name or not attr:
        raise EntrypointError(f"environments.entrypoint {entrypoint!r} is not 'package.module:Class'")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a user module: any import failure is a config error
        raise EntrypointError(f"environments.entrypoint {entrypoint!r}: cannot import {module_name}: {type(e).__name__}: {e}") from e
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise EntrypointError(f"environments.entrypoint {entrypoint!r}: {module_name} has no class {attr}")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EntrypointError(f"environments.entrypoint {entrypoint!r}: {attr} has no {' or '.join(missing)} method")
    return cls


async def call_user(what: str, timeout_s: float, fn, *args: Any) -> Any:
    """`fn(*args)`, awaited or on a thread of its own, within `timeout_s`; failures as UserCodeError."""
    try:
        if inspect.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(*args), timeout_s)
        return await asyncio.wait_for(_in_thread(fn, *args), timeout_s)
    except TimeoutError:
        raise UserCodeError("env_timeouts", f"{what} did not return within {timeout_s:g} s") from None
    except asyncio.CancelledError:
        raise
    except Exception as e:  # user code: whatever it raises ends its trajectory only
        raise UserCodeError("env_exceptions", f"{what} raised {type(e).__name__}: {e}") from e


def _in_thread(fn, *args: Any) -> asyncio.Future:
    """`fn(*args)` on a daemon thread of its own: one that hangs is abandoned at the timeout and
    holds no pool worker that other trajectories' calls would wait for."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(value)

    def run() -> None:
        try:
            value, error = fn(*args), None
        except BaseException as e:  # handed to the awaiting coroutine
            value, error = None, e
        with contextlib.suppress(RuntimeError):  # the loop closed while the call ran
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name=f"user-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future


def as_step_result(value: Any) -> StepResult:
    """A StepResult from what `step` returned: a StepResult or (observation, reward, done)."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) == 3:
        result = StepResult(observation=value[0], reward=value[1], done=value[2])
    else:
        raise UserCodeError("env_bad_returns", f"step returned {type(value).__name__}, not a StepResult or (observation, reward, done)")
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise UserCodeError("env_bad_returns", f"step returned reward {reward!r}, not a finite number")
    if not isinstance(result.done, bool):
        raise UserCodeError("env_bad_returns", f"step returned done {result.done!r}, not a bool")
    check_observation(result.observation, "step")
    return result


def check_observation(obs: Any, what: str, vocab_size: int | None = None) -> None:
    """Raise UserCodeError unless `obs` is text, token ids (in the vocabulary) or chat messages."""
    if isinstance(obs, str):
        return
    if isinstance(obs, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in obs):
        bad = [t for t in obs if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise UserCodeError("env_bad_returns", f"{what} returned token id {bad[0]} outside the vocabulary ({vocab_size})")
        return
    if isinstance(obs, Sequence) and all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in obs):
        return
    raise UserCodeError("env_bad_returns", f"{what} returned a {type(obs).__name__} observation, not text, token ids or chat messages")
