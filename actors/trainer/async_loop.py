"""Async-mode trainer loop (run.mode = "async"; a mixin of TrainerActor; docs/async.md).

Rollout never pauses: (1) groups are assigned ahead while the staleness gate allows
(`staleness.StalenessGate`); (2) finished trajectories are collected; (3) as soon as the gate
can form batch n (B whole groups) it is trained from version n, while environments and
engines go on; (4) version n + 1 is published and every engine is asked to load it, in the
background, while the next batch collects; the trainer waits for every engine's confirmation
of n + 1 before it publishes n + 2, so a version engines never confirm fails the run by name
after `trainer.policy_ack_timeout_wall_s` instead of hanging. `trainer.steps` batches end the run.
"""

from __future__ import annotations

import asyncio

from actors.environment.workloads import choose_family
from actors.trainer.staleness import Batch, Group, StalenessGate
from bus_schemas import subjects
from bus_schemas.codec import encode
from bus_schemas.lifecycle import EventKind
from bus_schemas.train import PolicyVersion, StepReport, TaskAssignment


class BatchCannotFill(RuntimeError):
    """Every untrained group is finished, none may start, and still no batch forms."""


class AsyncTrainerLoop:
    """Needs the TrainerActor attributes: config, clock, counters, log, stopping, policy_version,
    reports, event(), _pull_finished(), _durable(), _train(), _weights_ref(),
    _load_policy_everywhere()."""

    async def _serve_async(self) -> None:
        tc = self.config.trainer
        self.gate = StalenessGate(tc.stale_policy, tc.max_staleness, tc.tasks_per_step, tc.steps)
        self.batches: list[Batch] = []
        self._dropped_since_batch = 0
        loading: asyncio.Task | None = None  # engines confirming the newest version
        batch_started_s = self.clock.now_s()
        while self.gate.next_batch < tc.steps:
            await self._top_up()
            batch, dropped = self.gate.take_batch()
            self._note_dropped(dropped)
            if batch is None:
                self._check_can_fill()
                await self._collect_one()
                continue
            formed_s = self.clock.now_s()
            self._note_batch(batch)
            await self._top_up()  # the batch freed room: new groups start before training
            train_s = await self._train(batch.trajectories(), batch.index + 1, min_version=batch.min_version)
            if loading is not None:
                await loading  # every engine confirmed version n before n + 1 goes out (raises if not in time)
            self.policy_version = batch.index + 1
            published = PolicyVersion(
                version=self.policy_version, published_at_s=self.clock.now_s(), train_s=train_s, weights_ref=self._weights_ref()
            )
            await self._durable(subjects.train_policy(), encode(published), f"policy-{self.policy_version}")
            self.event(EventKind.POLICY_PUBLISHED, step=batch.index, policy_version=self.policy_version, duration_s=train_s)
            loading = self.spawn(self._load_policy_everywhere(self.policy_version), f"load-policy-{self.policy_version}")
            report = self._batch_report(batch, batch_started_s, formed_s, train_s)
            self.reports.append(report)
            await self._durable(subjects.train_step(), encode(report), f"step-{batch.index}")
            self.log.info(
                "batch %d: %d trajectories, staleness %s, %d dropped, %d turns masked, mean reward %.3f",
                batch.index,
                report.trajectories,
                report.staleness,
                report.dropped,
                report.masked_turns,
                report.mean_reward,
            )
            batch_started_s = formed_s
        if loading is not None:
            await loading
        self.log.info("all %d batches done (async, max_staleness %d, %s)", tc.steps, tc.max_staleness, tc.stale_policy)

    # --- starting groups ---------------------------------------------------------------------
    async def _top_up(self) -> None:
        tc, run = self.config.trainer, self.config.run
        version = self.policy_version
        while self.gate.may_assign(version):
            i = self.gate.assigned
            # the data schedule is the sync run's: group i is task i % B of batch i // B, so a
            # shifting mix moves with the batches, not with the (lagging) policy version
            batch, k = divmod(i, tc.tasks_per_step)
            family = choose_family(self.config.workload.mix_at(batch, run.seed), run.seed, batch, k)
            task_id = f"a{i}"
            members = [f"{task_id}-g{g}" for g in range(tc.samples_per_task)]
            self.gate.assign(task_id, version, members)
            now_s = self.clock.now_s()
            for g, trajectory_id in enumerate(members):
                assignment = TaskAssignment(
                    trajectory_id=trajectory_id,
                    task_id=task_id,
                    task_family=family,
                    sample_index=g,
                    step=version,
                    policy_version=version,
                    seed=i * tc.samples_per_task + g,
                    assigned_at_s=now_s,
                )
                await self._durable(subjects.train_tasks(), encode(assignment), trajectory_id)
            self.counters["groups_assigned"] += 1
        if self.gate.wanted() > 0 and not self.gate.may_assign(version):
            self.counters["assign_held"] += 1  # the bound holds a group back until the trainer catches up

    def _check_can_fill(self) -> None:
        """Never a hang: if nothing runs and nothing may start, the batch can never fill."""
        if self.gate.outstanding() == 0 and not self.gate.may_assign(self.policy_version):
            self.counters["batch_cannot_fill"] += 1
            raise BatchCannotFill(
                f"batch {self.gate.next_batch} cannot fill: {len(self.gate.groups)} finished groups untrained, none running, "
                f"and the staleness bound ({self.config.trainer.stale_policy}, max_staleness "
                f"{self.config.trainer.max_staleness}) lets none start"
            )

    # --- collecting --------------------------------------------------------------------------
    async def _collect_one(self) -> None:
        pulled = await self._pull_finished()
        if pulled is None:
            return
        done, msg = pulled
        outcome = self.gate.finished(done)
        if outcome == "duplicate":
            self.counters["duplicate_finished"] += 1
        elif outcome == "unexpected":
            self.counters["unexpected_finished"] += 1
            self.log.warning("finished trajectory %s belongs to no untrained group", done.trajectory_id)
        else:
            self.finished[done.trajectory_id] = done
        await msg.ack()

    # --- batches -------------------------------------------------------------------------------
    def _note_dropped(self, dropped: list[Group]) -> None:
        eta = self.config.trainer.max_staleness
        for g in dropped:
            self._dropped_since_batch += len(g.members)
            for t in g.trajectories():
                staleness = self.gate.next_batch - min(t.policy_versions)
                self.counters["dropped_stale"] += 1
                self.event(
                    EventKind.TRAJECTORY_DROPPED,
                    trajectory_id=t.trajectory_id,
                    task_family=t.task_family,
                    policy_version=min(t.policy_versions),
                    step=self.gate.next_batch,
                    detail=f"group {g.task_id}: staleness {staleness} > max_staleness {eta} at batch {self.gate.next_batch}",
                )
            self.log.warning("dropped group %s from training: too stale for batch %d", g.task_id, self.gate.next_batch)

    def _note_batch(self, batch: Batch) -> None:
        self.batches.append(batch)
        for s, count in enumerate(batch.staleness):
            self.counters[f"staleness_{s}"] += count
        self.counters["masked_turns"] += batch.masked_turns
        self.counters["batches"] += 1
        self.event(
            EventKind.BATCH_READY,
            step=batch.index,
            policy_version=batch.index,
            detail=f"staleness {batch.staleness}; masked turns {batch.masked_turns}",
        )

    def _take_dropped(self) -> int:
        dropped, self._dropped_since_batch = self._dropped_since_batch, 0
        return dropped

    def _batch_report(self, batch: Batch, started_s: float, formed_s: float, train_s: float) -> StepReport:
        trajectories = batch.trajectories()
        return StepReport(
            step=batch.index,
            policy_version=batch.index,
            started_at_s=started_s,
            rollout_done_at_s=formed_s,
            rollout_s=formed_s - started_s,
            train_s=train_s,
            trajectories=len(trajectories),
            mean_reward=sum(t.reward for t in trajectories) / len(trajectories),
            mode="async",
            staleness=batch.staleness,
            dropped=self._take_dropped(),
            masked_turns=batch.masked_turns,
            trajectory_ids=[t.trajectory_id for t in trajectories],
        )
