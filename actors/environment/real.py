"""The environment actor for real backends: real tokens, and an environment class
(`interface.Environment`: a built-in one per family, or `environments.entrypoint`) that
gives the prompt, answers each turn and decides the reward.

Same agent loop and bus protocol as `actor.py`. Per trajectory it builds one instance of
the class, asks it for the first observation (`reset`), and after each turn hands it the
model's output (`step`): its observation is the next turn's new tokens, its reward adds up,
`done` (or `environments.max_turns`, or the model's context) ends the trajectory. It keeps
the token ids the policy has seen (prompt, generations, observations), a mask of the
generated ones and their rollout logprobs, and hands all three to the trainer in the
FinishedTrajectory. Each prefill work item carries the whole history (`context_token_ids`)
and the turn's new tokens (`token_ids`), so any engine can serve the turn, cached prefix or
not. A call into the class that fails (`interface.UserCodeError`) ends its trajectory only:
an `env_error` event, reward 0, a counter per reason.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg

from actors.engine.torch.model import load_tokenizer
from actors.environment.actor import EnvironmentActor, Trajectory
from actors.environment.envs import entrypoint_for
from actors.environment.interface import (
    ModelOutput,
    Observation,
    Task,
    UserCodeError,
    as_step_result,
    call_user,
    check_observation,
    load_class,
)
from bus_schemas.lifecycle import EventKind
from bus_schemas.train import TaskAssignment
from bus_schemas.work import TurnResult


@dataclass(slots=True)
class RealTrajectory(Trajectory):
    env: Any = None  # the environment instance of this trajectory
    max_output_tokens: int = 0
    ids: list[int] = field(default_factory=list)  # everything the policy has seen or written
    generated_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    new_ids: list[int] = field(default_factory=list)  # what the current turn appends
    reward: float = 0.0  # summed over the steps
    error: str = ""  # why the environment ended it, where it failed


class RealEnvironmentActor(EnvironmentActor):
    def __init__(self, actor_id, config, nc, clock, tokenizer=None) -> None:
        super().__init__(actor_id, config, nc, clock)
        self.tokenizer = tokenizer or load_tokenizer(config.model.checkpoint)
        self.classes: dict[str, type] = {}  # family -> environment class
        self._timeout_s = config.environments.step_timeout_wall_s  # real backends run live: the loop's clock is the wall's

    async def _start(self, a: TaskAssignment, msg: Msg) -> None:
        if a.trajectory_id in self.live:
            self.live[a.trajectory_id].task_msg = msg
            self.counters["redelivered_in_flight"] += 1
            return
        cls = self._class_of(a.task_family)
        if cls is None:
            self.counters["invalid_messages"] += 1
            self.log.error("rejected task %s: no environment for family %r", a.trajectory_id, a.task_family)
            await msg.term()
            return
        t = RealTrajectory(a, msg, plan=None, started_at_s=self.clock.now_s(), nonce=self.new_id()[:8])  # type: ignore[arg-type]
        self.live[a.trajectory_id] = t
        try:
            t.env = self._build(cls)
            task = Task(
                a.task_id, a.task_family, self.config.run.seed, zlib.crc32(a.task_id.encode()), a.sample_index, a.step, a.trajectory_id
            )
            first = await call_user("reset", self._timeout_s, t.env.reset, task)
            t.max_output_tokens = self._max_output_tokens(t.env)
            t.new_ids = self._encode(first, first_turn=True)
            if not t.new_ids:
                raise UserCodeError("env_bad_returns", "reset returned an empty prompt")
        except UserCodeError as e:
            self._event(t, EventKind.STARTED, new_tokens=0)
            await self._fail(t, e)
            return
        t.new_tokens = len(t.new_ids)
        self._event(t, EventKind.STARTED, new_tokens=t.new_tokens)
        await self._submit(t)

    def _class_of(self, family: str) -> type | None:
        if family not in self.classes:
            target = entrypoint_for(family, self.config.environments.entrypoint)
            if target is None:
                return None
            self.classes[family] = load_class(target)  # checked at launch: an error here is a bug
        return self.classes[family]

    def _build(self, cls: type) -> Any:
        try:
            return cls(**self.config.environments.options)
        except Exception as e:  # user code: its failure ends this trajectory only
            raise UserCodeError("env_exceptions", f"{cls.__name__}(**environments.options) raised {type(e).__name__}: {e}") from e

    def _max_output_tokens(self, env: Any) -> int:
        """The class's cap for the next turn (a positive int, read before each turn), else
        `environments.max_output_tokens`."""
        try:
            cap = getattr(env, "max_output_tokens", None)
        except Exception as e:  # user code (a property that raises)
            raise UserCodeError("env_exceptions", f"max_output_tokens raised {type(e).__name__}: {e}") from e
        if cap is None:
            return self.config.environments.max_output_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
            raise UserCodeError("env_bad_returns", f"max_output_tokens is {cap!r}, not a positive int")
        return cap

    def _encode(self, obs: Observation, first_turn: bool) -> list[int]:
        """An observation's token ids: text tokenized, ids as they are, chat messages rendered
        with the checkpoint's chat template (a later turn's without the template's preamble)."""
        check_observation(obs, "the environment", self.tokenizer.vocab_size)
        if isinstance(obs, str):
            return self.tokenizer.encode(obs)
        if obs and isinstance(obs[0], dict):
            try:
                return self.tokenizer.render_chat(list(obs), continuation=not first_turn)
            except ValueError as e:
                raise UserCodeError("env_bad_returns", f"chat messages: {e}") from e
        return list(obs)

    def _turn_fields(self, t: RealTrajectory) -> dict:  # type: ignore[override]
        return dict(
            context_tokens=len(t.ids),
            new_tokens=len(t.new_ids),
            max_output_tokens=t.max_output_tokens,
            token_ids=t.new_ids,
            context_token_ids=t.ids,
        )

    def _on_result(self, r: TurnResult) -> None:
        t = self.live.get(r.trajectory_id)
        if t is None or r.turn != t.turn or not t.awaiting_result:
            self.counters["stale_results"] += 1
            return
        if len(r.token_ids) != r.output_tokens or len(r.logprobs) != r.output_tokens or not r.token_ids:
            self.counters["invalid_messages"] += 1  # the turn stays awaited: its redelivery or a rerun answers it
            self.log.error(
                "turn result %s carries %d ids / %d logprobs for %d tokens", r.work_id, len(r.token_ids), len(r.logprobs), r.output_tokens
            )
            return
        t.awaiting_result = False
        t.took_result(r)
        t.versions.append(self._turn_versions(r))
        self.newest_version = max(self.newest_version, r.policy_version)
        t.ids = t.ids + t.new_ids + list(r.token_ids)
        t.generated_mask += [0] * len(t.new_ids) + [1] * len(r.token_ids)
        t.logprobs += [0.0] * len(t.new_ids) + list(r.logprobs)
        t.generated_tokens += r.output_tokens
        t.context_tokens = len(t.ids)
        output = ModelOutput(self.tokenizer.decode(list(r.token_ids)), list(r.token_ids), t.turn, list(r.logprobs))
        self.spawn(self._env_step(t, output), f"step-{r.trajectory_id}-{t.turn}")

    async def _env_step(self, t: RealTrajectory, output: ModelOutput) -> None:  # the tool call of `actor.py`
        started_s = self.clock.now_s()
        try:
            result = as_step_result(await call_user("step", self._timeout_s, t.env.step, output))
            t.reward += float(result.reward)
            if result.done:
                await self._finish(t, truncated=False)
                return
            new_ids = self._encode(result.observation, first_turn=False)
            t.max_output_tokens = self._max_output_tokens(t.env)
        except UserCodeError as e:
            await self._fail(t, e)
            return
        if t.turn + 1 >= self.config.environments.max_turns or not self._fits(t, new_ids):
            await self._finish(t, truncated=True)
            return
        self._event(t, EventKind.TOOL_STARTED, at_s=started_s)
        t.new_ids = new_ids
        t.observation_tokens += len(new_ids)
        self._event(t, EventKind.TOOL_DONE, duration_s=self.clock.now_s() - started_s, new_tokens=len(new_ids))
        t.turn += 1
        t.new_tokens = len(new_ids)
        await self._submit(t)

    def _fits(self, t: RealTrajectory, new_ids: list[int]) -> bool:
        """The next turn, its observation and its output, fit the model's context."""
        limit = self.config.model.max_positions
        return not limit or len(t.ids) + len(new_ids) + t.max_output_tokens <= limit

    async def _fail(self, t: RealTrajectory, e: UserCodeError) -> None:
        """The environment failed this trajectory: it ends now, reward 0, the reason counted and logged."""
        self.counters["env_errors"] += 1
        self.counters[e.reason] += 1
        t.reward, t.error = 0.0, str(e)
        self.log.warning("trajectory %s ends at turn %d: the environment's %s", t.assignment.trajectory_id, t.turn, e)
        self._event(t, EventKind.ENV_ERROR, detail=f"{e.reason}: {e}"[:500])
        await self._finish(t, truncated=True)

    async def _finish(self, t: RealTrajectory, truncated: bool) -> None:  # type: ignore[override]
        try:
            close = getattr(t.env, "close", None)
            if callable(close):
                await call_user("close", self._timeout_s, close)
        except Exception as e:  # user code: a failed close is counted, the trajectory still finishes
            self.counters["env_close_errors"] += 1
            self.log.warning("trajectory %s: the environment's close failed: %s", t.assignment.trajectory_id, e)
        await super()._finish(t, truncated)

    def _outcome(self, t: RealTrajectory) -> dict:  # type: ignore[override]
        return dict(
            reward=t.reward,
            error=t.error,
            prompt_tokens=t.generated_mask.index(1) if 1 in t.generated_mask else len(t.ids),
            token_ids=t.ids,
            generated_mask=t.generated_mask,
            logprobs=t.logprobs,
        )
