"""The trainer. Async mode (run.mode = "async") is `async_loop.AsyncTrainerLoop`; sync mode:

Each step: (1) every engine confirms the step's policy version; (2) B tasks x G samples are
assigned; (3) finished trajectories are collected until every one of the step is in;
(4) training runs for its modelled duration; (5) version v+1 is published; repeat.
The actor exits when the last step is done; ``ops.launch`` takes that as the run's end.
"""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from actors.base import Actor
from actors.base.publish import publish_durable, pull_one
from actors.environment.workloads import choose_family
from actors.trainer.async_loop import AsyncTrainerLoop
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import CommandAck, LoadPolicy
from bus_schemas.lifecycle import FINAL_STEP, EventKind
from bus_schemas.status import ActorStatus
from bus_schemas.streams import finished_consumer, pull_subscription
from bus_schemas.train import FinishedTrajectory, PolicyVersion, StepReport, TaskAssignment

FETCH_WAIT_WALL_S = 0.2
COMMAND_TIMEOUT_WALL_S = 2.0
LOAD_RETRY_WALL_S = 0.1  # an engine not yet serving commands is asked again after this


class TrainerActor(AsyncTrainerLoop, Actor):
    kind = "trainer"

    def __init__(self, actor_id, config, nc, clock) -> None:
        super().__init__(actor_id, config, nc, clock)
        self.policy_version = 0
        self.finished: dict[str, FinishedTrajectory] = {}
        self.reports: list[StepReport] = []

    async def setup(self) -> None:
        self._finished_sub = await pull_subscription(self.js, finished_consumer(), self.clock.loop_s(self.config.run.ack_wait_wall_s))

    def heartbeat(self) -> ActorStatus:
        return ActorStatus(actor_id=self.actor_id, kind=self.kind, at_s=self.clock.now_s(), counters=dict(self.counters))

    async def serve(self, burst: bool) -> None:
        await self.wait_for_heartbeats("environment", self.config.env_ids(), self.config.trainer.policy_ack_timeout_wall_s)
        await self._load_policy_everywhere(self.policy_version)
        if self.config.run.mode == "async":
            await self._serve_async()
            return
        for step in range(self.config.trainer.steps):
            report = await self._run_step(step)
            self.reports.append(report)
            self.log.info(
                "step %d: rollout %.1f s, %d trajectories, mean reward %.3f",
                step,
                report.rollout_s,
                report.trajectories,
                report.mean_reward,
            )
        self.log.info("all %d steps done", self.config.trainer.steps)

    async def _run_step(self, step: int) -> StepReport:
        version = self.policy_version
        started_s = self.clock.now_s()
        self.event(EventKind.STEP_STARTED, step=step, policy_version=version)
        wanted = await self._assign(step, version, started_s)
        batch = await self._collect(wanted)
        rollout_done_s = max(f.finished_at_s for f in batch)
        final = FINAL_STEP if step == self.config.trainer.steps - 1 else ""
        self.event(EventKind.ROLLOUT_DONE, step=step, policy_version=version, at_s=rollout_done_s, detail=final)
        train_s = await self._train(batch, version + 1)
        self.policy_version = version + 1
        published = PolicyVersion(
            version=self.policy_version, published_at_s=self.clock.now_s(), train_s=train_s, weights_ref=self._weights_ref()
        )
        await self._durable(subjects.train_policy(), encode(published), f"policy-{self.policy_version}")
        self.event(EventKind.POLICY_PUBLISHED, step=step, policy_version=self.policy_version, duration_s=train_s)
        await self._load_policy_everywhere(self.policy_version)
        report = StepReport(
            step=step,
            policy_version=version,
            started_at_s=started_s,
            rollout_done_at_s=rollout_done_s,
            rollout_s=rollout_done_s - started_s,
            train_s=train_s,
            trajectories=len(batch),
            mean_reward=sum(f.reward for f in batch) / len(batch),
        )
        await self._durable(subjects.train_step(), encode(report), f"step-{step}")
        return report

    async def _train(self, batch: list[FinishedTrajectory], new_version: int, min_version: int = -1) -> float:
        """Produce policy `new_version` from the step's trajectories; return the training time.
        Modelled here (a wait); `TorchTrainerActor` trains for real. `min_version`: turns of an
        older policy are masked out of the loss (async, stale_policy "partial")."""
        await self.clock.sleep(self.config.trainer.train_s)
        return self.config.trainer.train_s

    def _weights_ref(self) -> str:
        """Where engines fetch the new weights (empty: modelled, nothing to fetch)."""
        return ""

    async def _assign(self, step: int, version: int, now_s: float) -> set[str]:
        tc, run = self.config.trainer, self.config.run
        wanted: set[str] = set()
        for k in range(tc.tasks_per_step):
            family = choose_family(self.config.workload.mix_at(step, run.seed), run.seed, step, k)
            for g in range(tc.samples_per_task):
                trajectory_id = f"s{step}-k{k}-g{g}"
                assignment = TaskAssignment(
                    trajectory_id=trajectory_id,
                    task_id=f"s{step}-k{k}",
                    task_family=family,
                    sample_index=g,
                    step=step,
                    policy_version=version,
                    seed=(step * tc.tasks_per_step + k) * tc.samples_per_task + g,
                    assigned_at_s=now_s,
                )
                await self._durable(subjects.train_tasks(), encode(assignment), trajectory_id)
                wanted.add(trajectory_id)
        return wanted

    async def _pull_finished(self) -> tuple[FinishedTrajectory, Msg] | None:
        """The next finished trajectory and its message (ack it once recorded); None when none
        came within the fetch wait, or it was malformed (terminated, never redelivered)."""
        if self.stopping.is_set():
            raise asyncio.CancelledError
        msg = await pull_one(self._finished_sub, self.clock.loop_s(FETCH_WAIT_WALL_S))
        if msg is None:
            return None
        done = await self.decode_work(FinishedTrajectory, msg)
        return None if done is None else (done, msg)

    async def _collect(self, wanted: set[str]) -> list[FinishedTrajectory]:
        missing = set(wanted) - set(self.finished)
        while missing:
            pulled = await self._pull_finished()
            if pulled is None:
                continue
            done, msg = pulled
            if done.trajectory_id in self.finished:
                self.counters["duplicate_finished"] += 1
            elif done.trajectory_id not in wanted:
                self.counters["unexpected_finished"] += 1
                self.log.warning("finished trajectory %s is not part of this step", done.trajectory_id)
            else:
                self.finished[done.trajectory_id] = done
                missing.discard(done.trajectory_id)
            await msg.ack()
        return [self.finished[t] for t in sorted(wanted)]

    async def _load_policy_everywhere(self, version: int) -> None:
        """Every engine must confirm the version before the step's work is assigned."""
        waiting = set(self.config.engine_ids())
        give_up_at_s = self.clock.now_s() + self.config.trainer.policy_ack_timeout_wall_s * self.clock.time_scale
        while waiting:
            if self.config.run.mode == "async":  # every engine takes it at once, each while its rollout goes on
                confirmed = await asyncio.gather(*(self._send_load_policy(e, version) for e in sorted(waiting)))
                waiting -= {e for e, ok in zip(sorted(waiting), confirmed) if ok}
            for engine_id in sorted(waiting) if self.config.run.mode == "sync" else ():
                if await self._send_load_policy(engine_id, version):
                    waiting.discard(engine_id)
            if waiting:
                if self.clock.now_s() > give_up_at_s:
                    raise RuntimeError(f"engines {sorted(waiting)} did not confirm policy {version} in time")
                if self.stopping.is_set():
                    raise asyncio.CancelledError
                await self.clock.sleep_wall(LOAD_RETRY_WALL_S)  # engines still starting up: ask again

    async def _send_load_policy(self, engine_id: str, version: int) -> bool:
        try:
            reply = await self.nc.request(
                subjects.ctl_policy(engine_id), encode(LoadPolicy(version=version)), timeout=self.clock.loop_s(COMMAND_TIMEOUT_WALL_S)
            )
        except (NoRespondersError, TimeoutError):
            self.counters["policy_load_retries"] += 1
            return False
        ack = decode(CommandAck, reply.data)
        if not ack.ok:
            raise RuntimeError(f"engine {engine_id} refused policy {version}: {ack.error}")
        return ack.policy_version >= version

    async def _durable(self, subject: str, data: bytes, msg_id: str) -> None:
        await publish_durable(self.js, subject, data, f"{self.run_tag}/{msg_id}", self.counters, self.log, self.stopping, self.clock)
