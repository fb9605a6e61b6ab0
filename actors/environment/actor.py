"""The environment actor: runs agent loops for the trajectories it is assigned.

Per trajectory: submit the prompt for prefill → receive the turn's result → call the tool
(a modelled latency) → submit the observation as the next turn … → compute the reward and
hand the finished trajectory to the trainer. A trajectory's shape (turns, lengths, tool
latencies, reward) is drawn from its task family's profile (`workloads.plan_trajectory`) or,
with `workload.trace` set, read from a recorded trace (`trace.ReplaySchedule`). With
`workload.share_prompts` a sampled task's G siblings share their prompt, and each first turn
carries the task id as `prompt_key` for the router and the engines' prefix caches. The task
assignment stays un-acked (kept alive with in-progress acks) until the finished trajectory
is stored, so an environment that dies mid-trajectory has the trajectory redelivered and
rerun elsewhere — never silently lost.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from actors.base import Actor
from actors.base.publish import publish_durable, pull_one
from actors.environment.router import Router, store_miss_share
from actors.environment.trace import ReplaySchedule, TracePlan
from actors.environment.workloads import PROFILES, TrajectoryPlan, plan_trajectory, shape_scales, task_prompt_seed
from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.lifecycle import EventKind
from bus_schemas.status import ActorStatus, EngineStatus
from bus_schemas.streams import pull_subscription, results_consumer, tasks_consumer
from bus_schemas.train import FinishedTrajectory, TaskAssignment
from bus_schemas.work import DecodeWork, PrefillWork, TurnResult, make_work_id

FETCH_WAIT_WALL_S = 0.2


@dataclass(slots=True)
class Trajectory:
    assignment: TaskAssignment
    task_msg: Msg
    plan: TrajectoryPlan | TracePlan
    started_at_s: float
    nonce: str = ""  # this rollout of the trajectory (a redelivered trajectory gets a new one)
    turn: int = 0
    context_tokens: int = 0  # history before the current turn
    new_tokens: int = 0  # what the current turn appends
    versions: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    observation_tokens: int = 0
    awaiting_result: bool = False
    prefix_engine_id: str = ""  # the prefill-side engine holding the prefix: it prefilled the last turn, or took its write-back
    kv_engine_id: str = ""  # the engine that decoded the last turn (holds all of the context)
    writeback_engine_id: str = ""  # the current turn is a short append on kv_engine_id: the prefix holder it writes back to

    def took_result(self, r: TurnResult) -> None:
        """The engines holding the KV after turn `r`: the one that decoded it holds all of it; the
        prefix holder is the one that prefilled it, or, for a short append its decode engine
        prefilled, the prefill-side holder the turn's KV was written back to."""
        local = r.prefill_engine_id == r.decode_engine_id and self.writeback_engine_id
        self.prefix_engine_id = self.writeback_engine_id if local else r.prefill_engine_id
        self.kv_engine_id = r.decode_engine_id

    @property
    def family(self) -> str:
        """The task family its turns and events carry: the plan's (a replayed trace line names its
        own), or the assignment's where there is no plan (real backends)."""
        return self.assignment.task_family if self.plan is None else self.plan.family


class EnvironmentActor(Actor):
    kind = "environment"

    def __init__(self, actor_id, config, nc, clock) -> None:
        super().__init__(actor_id, config, nc, clock)
        self.live: dict[str, Trajectory] = {}
        self._tasks_empty = False
        self._room = asyncio.Event()
        self.newest_version = 0  # the newest policy version a turn result has shown
        self.replay: ReplaySchedule | None = None  # workload.trace: the recorded trajectories replayed

    async def setup(self) -> None:
        ack_wait = self.clock.loop_s(self.config.run.ack_wait_wall_s)  # as the keep-alive's period
        max_deliver = self.config.run.max_deliver
        self._task_sub = await pull_subscription(self.js, tasks_consumer(), ack_wait, max_deliver)
        self._result_sub = await pull_subscription(self.js, results_consumer(self.actor_id), ack_wait, max_deliver)
        self.router = self._make_router() if self.config.affinity_routing else None
        if self.router is not None:
            await self.nc.subscribe(subjects.status_of_kind("engine"), cb=self._on_engine_status)
        await self.nc.subscribe(subjects.dead_letter_all(), cb=self._on_dead_letter)
        if self.config.workload.trace:  # checked when the config loaded; read here once (cached per process)
            self.replay = ReplaySchedule.of(self.config)

    def _make_router(self) -> Router:
        """Per-turn placement; with KV write-back a prefill engine's prefix includes the output."""
        ec = self.config.engines
        miss_share = store_miss_share(ec) if ec.kv_writeback == "store" else 1.0
        lease_s = self.config.run.lease_wall_s * self.clock.time_scale
        lockstep = ec.decode_lockstep and self.config.allocator.saturated_regime  # the regime's model assumes it
        return Router(self.config.engine_ids(), self.config.local_prefill_max_tokens, ec.kv_writeback, miss_share, lease_s, lockstep)

    async def _on_engine_status(self, msg: Msg) -> None:
        status = self.decode_or_count(EngineStatus, msg)
        if status is not None and self.router is not None:
            self.router.observe(status, self.clock.now_s())

    async def serve(self, burst: bool) -> None:
        self.spawn(self._result_loop(), "results")
        self.spawn(self._keep_alive(), "in-progress")
        await self._task_loop(burst)

    async def teardown(self) -> None:
        self._router_counters()
        for trajectory in self.live.values():  # hand unfinished trajectories back at once
            self.counters["returned_on_shutdown"] += 1
            with self.counting_bus_errors("nak_failures"):
                await trajectory.task_msg.nak()

    def _router_counters(self) -> None:
        if self.router is not None:
            for name, value in self.router.counters().items():
                self.counters[name] = value  # cumulative: assigned, never added

    def heartbeat(self) -> ActorStatus:
        self._router_counters()
        return ActorStatus(
            actor_id=self.actor_id, kind=self.kind, at_s=self.clock.now_s(), live_trajectories=len(self.live), counters=dict(self.counters)
        )

    def request_stop(self, reason: str = "") -> None:
        super().request_stop(reason)
        self._room.set()  # a task loop waiting for room sees the stop at once

    # --- taking assignments ----------------------------------------------------------------
    async def _task_loop(self, burst: bool) -> None:
        cap = self.config.environments.max_live_trajectories
        while not self.stopping.is_set():
            room = cap - len(self.live)
            if room <= 0:
                self._room.clear()
                await self._room.wait()
                continue
            msg = await pull_one(self._task_sub, self.clock.loop_s(FETCH_WAIT_WALL_S))
            if msg is None:
                if burst and not self.live:
                    return
                continue
            assignment = await self.decode_work(TaskAssignment, msg)
            if assignment is not None:
                await self._start(assignment, msg)

    async def _start(self, a: TaskAssignment, msg: Msg) -> None:
        if a.trajectory_id in self.live:  # redelivered while we still run it
            self.live[a.trajectory_id].task_msg = msg
            self.counters["redelivered_in_flight"] += 1
            return
        if a.task_family not in PROFILES:
            self.counters["invalid_messages"] += 1
            self.log.error("rejected task %s: unknown task family %r", a.trajectory_id, a.task_family)
            await msg.term()
            return
        # a.seed is the trajectory's index in the trainer's data schedule (group x G + sample), sync and async alike
        plan = self.replay.plan(a.seed) if self.replay is not None else self._sampled_plan(a)
        t = Trajectory(a, msg, plan, started_at_s=self.clock.now_s(), nonce=self.new_id()[:8], new_tokens=plan.prompt_tokens)
        self.live[a.trajectory_id] = t
        reruns = _deliveries(msg) - 1  # > 0: an earlier rollout was cut short (its environment died)
        if reruns > 0:
            self.counters["trajectories_rerun"] += 1
            self.log.warning("rerunning trajectory %s from its start (delivery %d)", a.trajectory_id, reruns + 1)
        self._event(t, EventKind.STARTED, new_tokens=plan.prompt_tokens, attempt=reruns)
        await self._submit(t)

    def _sampled_plan(self, a: TaskAssignment) -> TrajectoryPlan:
        workload, run_seed = self.config.workload, self.config.run.seed
        override = workload.overrides.get(a.task_family)
        kwargs: dict = {} if override is None else dict(turns_max=override.turns_max, tool_latency_scale=override.tool_latency_scale)
        turns, gen, obs = shape_scales(workload, run_seed, a)
        kwargs |= dict(
            turns_scale=turns,
            gen_scale=gen * (override.gen_scale if override else 1.0),
            obs_scale=obs * (override.obs_scale if override else 1.0),
        )
        if workload.tool_tail.share > 0:
            kwargs["tool_tail"] = workload.tool_tail
        if workload.share_prompts:  # the task's G siblings share one prompt
            kwargs["prompt_seed"] = task_prompt_seed(a.task_id)
        return plan_trajectory(PROFILES[a.task_family], run_seed, a.seed, **kwargs)

    async def _on_dead_letter(self, msg: Msg) -> None:
        """A turn of ours was dead-lettered (no engine could finish it): this rollout cannot
        finish, so it is given back to be rerun from its start (never reported as complete)."""
        stream = msg.subject.rsplit(".", 1)[-1]
        kinds = {"WORK_PREFILL": PrefillWork, "WORK_DECODE": DecodeWork, "RESULTS": TurnResult}
        if stream not in kinds:
            return
        item = self.decode_or_count(kinds[stream], msg)
        work_id = item.prefill.work_id if isinstance(item, DecodeWork) else getattr(item, "work_id", "")
        trajectory_id = work_id.split("/", 1)[0]
        t = self.live.get(trajectory_id)
        if t is None or not work_id.startswith(f"{trajectory_id}/{t.nonce}/"):
            return  # not ours, or an earlier rollout's
        del self.live[trajectory_id]
        self.counters["trajectories_dead_lettered"] += 1
        self.log.error("turn %s was dead-lettered: rerunning trajectory %s from its start", work_id, trajectory_id)
        with self.counting_bus_errors("nak_failures"):
            await t.task_msg.nak()
        self._room.set()

    async def _keep_alive(self) -> None:
        period_wall_s = self.config.run.ack_wait_wall_s / 3
        while True:
            await self.clock.sleep_wall(period_wall_s)
            for t in list(self.live.values()):
                with self.counting_bus_errors("keep_alive_failures"):
                    await t.task_msg.in_progress()

    # --- the agent loop ----------------------------------------------------------------------
    def _turn_fields(self, t: Trajectory) -> dict:
        """What this environment's turns carry beyond the shared fields (modelled lengths here)."""
        return dict(
            context_tokens=t.context_tokens,
            new_tokens=t.new_tokens,
            max_output_tokens=t.plan.max_output_tokens(t.turn),
            target_output_tokens=t.plan.gen_tokens(t.turn),
        )

    def _prompt_key(self, t: Trajectory) -> str:
        """The task's prompt identity on a first turn whose prompt its siblings share (a sampled
        plan with `workload.share_prompts`); empty otherwise (later turns, recorded traces)."""
        shared = t.turn == 0 and self.config.workload.share_prompts and isinstance(t.plan, TrajectoryPlan)
        return t.assignment.task_id if shared else ""

    async def _submit(self, t: Trajectory) -> None:
        a = t.assignment
        prompt_key = self._prompt_key(t)
        fields = self._turn_fields(t)
        t.awaiting_result = True
        engine_id = None
        if self.router is not None:
            engine_id = self.router.route(
                t.kv_engine_id, t.prefix_engine_id, fields["context_tokens"], fields["new_tokens"], self.clock.now_s(), prompt_key
            )
        # with write-back to the prefill side, a short append kept where its KV is writes back to
        # the prefill-side prefix holder, which stays the trajectory's home for its long turns
        local = engine_id is not None and engine_id == t.kv_engine_id and t.prefix_engine_id not in ("", engine_id)
        local = local and self.config.engines.kv_writeback == "to-prefill"
        t.writeback_engine_id = t.prefix_engine_id if local else ""
        work = PrefillWork(
            work_id=make_work_id(a.trajectory_id, t.nonce, t.turn, 0),
            trajectory_id=a.trajectory_id,
            turn=t.turn,
            env_id=self.actor_id,
            task_family=t.family,
            policy_version=self._turn_version(t),
            queued_at_s=self.clock.now_s(),
            prompt_key=prompt_key,
            writeback_engine_id=t.writeback_engine_id,
            **fields,
        )
        subject = subjects.work_prefill(engine_id)
        await publish_durable(self.js, subject, encode(work), work.work_id, self.counters, self.log, self.stopping, self.clock)
        self._event(t, EventKind.PREFILL_QUEUED, new_tokens=work.new_tokens, context_tokens=work.context_tokens)

    def _turn_version(self, t: Trajectory) -> int:
        """The oldest version a turn may run on: the assignment's; under async stale_policy
        "partial", the newest seen, so a trajectory's remaining turns move to it (docs/async.md)."""
        a = t.assignment
        if self.config.run.mode == "async" and self.config.trainer.stale_policy == "partial":
            return max(a.policy_version, self.newest_version)
        return a.policy_version

    @staticmethod
    def _turn_versions(r: TurnResult) -> int:
        """The version recorded for a turn: the oldest that generated any of its tokens."""
        return r.oldest_policy_version if 0 <= r.oldest_policy_version < r.policy_version else r.policy_version

    async def _result_loop(self) -> None:
        while True:
            msg = await pull_one(self._result_sub, self.clock.loop_s(FETCH_WAIT_WALL_S))
            if msg is None:
                continue
            result = await self.decode_work(TurnResult, msg)
            if result is not None:
                self._on_result(result)
                await msg.ack()

    def _on_result(self, r: TurnResult) -> None:
        t = self.live.get(r.trajectory_id)
        this_rollout = t is not None and r.work_id.startswith(make_work_id(r.trajectory_id, t.nonce, t.turn, 0).rsplit("/a", 1)[0] + "/")
        if t is None or r.turn != t.turn or not t.awaiting_result or not this_rollout:
            self.counters["stale_results"] += 1  # a duplicate from a redelivered turn, or an earlier rollout's
            return
        t.awaiting_result = False
        t.took_result(r)
        t.versions.append(self._turn_versions(r))
        self.newest_version = max(self.newest_version, r.policy_version)
        t.generated_tokens += r.output_tokens
        t.context_tokens += t.new_tokens + r.output_tokens
        cap = t.plan.context_cap_tokens
        if t.turn + 1 >= t.plan.turns or t.context_tokens >= cap:
            self.spawn(self._finish(t, truncated=t.context_tokens >= cap), f"finish-{r.trajectory_id}")
        else:
            self.spawn(self._tool_call(t), f"tool-{r.trajectory_id}-{t.turn}")

    async def _tool_call(self, t: Trajectory) -> None:
        latency_s = t.plan.tool_latency_s(t.turn)
        self._event(t, EventKind.TOOL_STARTED)
        await self.clock.sleep(latency_s)
        obs = t.plan.obs_tokens(t.turn)
        t.observation_tokens += obs
        self._event(t, EventKind.TOOL_DONE, duration_s=latency_s, new_tokens=obs)
        t.turn += 1
        t.new_tokens = obs
        await self._submit(t)

    def _outcome(self, t: Trajectory) -> dict:
        """The reward and what this environment's finished trajectories carry beyond the shared fields."""
        return dict(reward=t.plan.reward(), prompt_tokens=t.plan.prompt_tokens)

    async def _finish(self, t: Trajectory, truncated: bool) -> None:
        a = t.assignment
        now_s = self.clock.now_s()
        done = FinishedTrajectory(
            trajectory_id=a.trajectory_id,
            task_id=a.task_id,
            task_family=t.family,
            env_id=self.actor_id,
            step=a.step,
            policy_versions=t.versions,
            turns=t.turn + 1,
            truncated=truncated,
            generated_tokens=t.generated_tokens,
            observation_tokens=t.observation_tokens,
            started_at_s=t.started_at_s,
            finished_at_s=now_s,
            **self._outcome(t),
        )
        # logged first, and the trainer hears of it only once the whole trajectory's log is
        # stored. A kill -9 in between reruns it; on a bus that outlives this process, the
        # rerun's `finished` has the same id and the stream stores it once (the in-process bus
        # dies with the process; its drawn ids keep a simulation's order of simultaneous events)
        rerun_id = "" if self.lifecycle.stores_on_the_spot else f"{self.run_tag}/{a.trajectory_id}/finished"
        self._event(t, EventKind.FINISHED, event_id=rerun_id, generated_tokens=t.generated_tokens, reward=done.reward, at_s=now_s)
        await self.lifecycle.settled()
        stored = await publish_durable(
            self.js,
            subjects.train_finished(),
            encode(done),
            f"{self.run_tag}/{a.trajectory_id}",
            self.counters,
            self.log,
            self.stopping,
            self.clock,
        )
        if getattr(stored, "duplicate", False):  # a rerun of one already reported (its task's ack was lost)
            self.counters["finished_again"] += 1
            self.log.warning("trajectory %s was already reported finished; not reporting it twice", a.trajectory_id)
        with self.counting_bus_errors("ack_failures"):  # a lost ack reruns the task: the line above keeps that from counting twice
            await t.task_msg.ack()
        del self.live[a.trajectory_id]
        self.counters["finished"] += 1
        self._room.set()

    def _event(self, t: Trajectory, kind: EventKind, **fields) -> None:
        a = t.assignment
        self.event(
            kind,
            trajectory_id=a.trajectory_id,
            turn=t.turn,
            task_family=t.family,
            policy_version=a.policy_version,
            step=a.step,
            **fields,
        )


def _deliveries(msg: Msg) -> int:
    """How many times JetStream has delivered `msg` (1 on the in-process bus, which has no metadata)."""
    try:
        return msg.metadata.num_delivered or 1
    except (AttributeError, TypeError, ValueError):  # no JetStream reply subject to read it from
        return 1
