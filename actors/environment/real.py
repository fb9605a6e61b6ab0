"""The environment actor for real backends: real tokens, a real tool, a reward from the text.

Same agent loop and bus protocol as `actor.py`; per trajectory it keeps the token ids the
policy has seen (prompt, generations, observations), a mask of the generated ones and their
rollout logprobs, and hands all three to the trainer in the FinishedTrajectory. Each
prefill work item carries the whole history (`context_token_ids`) and the turn's new
tokens (`token_ids`), so any engine can serve the turn, cached prefix or not.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from actors.engine.torch.model import load_tokenizer
from actors.environment.actor import EnvironmentActor, Trajectory
from actors.environment.tasks import TASKS, CalcTask
from bus_schemas.lifecycle import EventKind
from bus_schemas.train import TaskAssignment
from bus_schemas.work import TurnResult


@dataclass(slots=True)
class RealTrajectory(Trajectory):
    task: CalcTask | None = None
    ids: list[int] = field(default_factory=list)  # everything the policy has seen or written
    generated_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    new_ids: list[int] = field(default_factory=list)  # what the current turn appends
    outputs: list[str] = field(default_factory=list)  # the model's text, per turn


class RealEnvironmentActor(EnvironmentActor):
    def __init__(self, actor_id, config, nc, clock, tokenizer=None) -> None:
        super().__init__(actor_id, config, nc, clock)
        self.tokenizer = tokenizer or load_tokenizer(config.model.checkpoint)

    async def _start(self, a: TaskAssignment, msg: Msg) -> None:
        if a.trajectory_id in self.live:
            self.live[a.trajectory_id].task_msg = msg
            self.counters["redelivered_in_flight"] += 1
            return
        task = TASKS.get(a.task_family)
        if task is None:
            self.counters["invalid_messages"] += 1
            self.log.error("rejected task %s: no real task family %r (known: %s)", a.trajectory_id, a.task_family, sorted(TASKS))
            await msg.term()
            return
        seed = zlib.crc32(a.task_id.encode())  # one prompt per task: its G samples form a GRPO group
        prompt = self.tokenizer.encode(task.prompt(self.config.run.seed, seed))
        t = RealTrajectory(
            a, msg, plan=None, started_at_s=self.clock.now_s(), nonce=self.new_id()[:8], new_tokens=len(prompt), task=task, new_ids=prompt
        )  # type: ignore[arg-type]
        self.live[a.trajectory_id] = t
        self._event(t, EventKind.STARTED, new_tokens=len(prompt))
        await self._submit(t)

    def _turn_fields(self, t: RealTrajectory) -> dict:  # type: ignore[override]
        return dict(
            context_tokens=len(t.ids),
            new_tokens=len(t.new_ids),
            max_output_tokens=t.task.max_output_tokens,
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
        t.prefix_engine_id, t.kv_engine_id = r.prefill_engine_id, r.decode_engine_id
        t.versions.append(self._turn_versions(r))
        self.newest_version = max(self.newest_version, r.policy_version)
        t.ids = t.ids + t.new_ids + list(r.token_ids)
        t.generated_mask += [0] * len(t.new_ids) + [1] * len(r.token_ids)
        t.logprobs += [0.0] * len(t.new_ids) + list(r.logprobs)
        t.generated_tokens += r.output_tokens
        t.context_tokens = len(t.ids)
        t.outputs.append(self.tokenizer.decode(list(r.token_ids)))
        if t.turn + 1 >= t.task.turns:
            self.spawn(self._finish(t, truncated=False), f"finish-{r.trajectory_id}")
        else:
            self.spawn(self._tool_call(t), f"tool-{r.trajectory_id}-{t.turn}")

    async def _tool_call(self, t: RealTrajectory) -> None:  # type: ignore[override]
        self._event(t, EventKind.TOOL_STARTED)
        started_s = self.clock.now_s()
        observation = t.task.tool(t.outputs[-1])
        latency_s = self.clock.now_s() - started_s  # the model seconds the real tool took
        t.new_ids = self.tokenizer.encode(observation)
        t.observation_tokens += len(t.new_ids)
        self._event(t, EventKind.TOOL_DONE, duration_s=latency_s, new_tokens=len(t.new_ids))
        t.turn += 1
        t.new_tokens = len(t.new_ids)
        await self._submit(t)

    def _outcome(self, t: RealTrajectory) -> dict:  # type: ignore[override]
        return dict(
            reward=t.task.reward(t.outputs),
            prompt_tokens=t.generated_mask.index(1) if 1 in t.generated_mask else len(t.ids),
            token_ids=t.ids,
            generated_mask=t.generated_mask,
            logprobs=t.logprobs,
        )
