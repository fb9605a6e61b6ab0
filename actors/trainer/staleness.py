"""The async trainer's pure core: which groups may start, and which form the next batch.

Units are GRPO groups (a task's G samples); a batch is B whole groups. Batch n is trained from
policy version n and produces n + 1. A trajectory's staleness in batch n is
n - (the oldest policy version among the turns it trains on); the bound is `max_staleness` (η).

* "hold": a group assigned at version v gets the deadline d = v + η, the last batch that may
  train it. Invariant F, for every batch index k >= n (n: the next batch to form):
  R(<=k) <= (k - n + 1) B, with R(<=k) the untrained groups whose deadline is <= k. A group
  starts only if F still holds with it; batch n takes complete groups earliest deadline first,
  and only once F holds for n + 1 after it (so every group due at n is in it). Every group is
  trained, at staleness <= n - v <= η (turns never run on a version older than their
  assignment's: engines refuse work newer than they hold and restamp older work with theirs).
* "drop": at most (η + 1) B untrained groups at a time; batch n takes complete groups in the
  order they completed; a group with a trajectory staler than η is dropped (counted, kept in
  the log and the stream) and replaced by a new group.
* "partial": as "drop" for starting and batching; nothing is dropped: turns older than
  n - η are masked out of the loss, so every trained turn is within the bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bus_schemas.train import FinishedTrajectory


@dataclass(slots=True)
class Group:
    task_id: str
    index: int  # assignment order
    version: int  # policy version at assignment
    deadline: int  # last batch index that may train it (hold); version + η otherwise too
    members: list[str]
    done: dict[str, FinishedTrajectory] = field(default_factory=dict)
    completed_order: int = -1  # when its last member finished (a counter), -1: not yet

    @property
    def complete(self) -> bool:
        return len(self.done) == len(self.members)

    def trajectories(self) -> list[FinishedTrajectory]:
        return [self.done[t] for t in self.members]


@dataclass(slots=True)
class Batch:
    index: int  # == the policy version it is trained from
    groups: list[Group]
    dropped: list[Group]
    staleness: list[int]  # trajectories per staleness 0, 1, ...
    masked_turns: int  # partial: turns masked out of the loss
    min_version: int  # partial: turns of an older version are masked (-1: none masked)

    def trajectories(self) -> list[FinishedTrajectory]:
        return [t for g in self.groups for t in g.trajectories()]


def trained_versions(t: FinishedTrajectory, min_version: int) -> list[int]:
    """The versions of the turns of `t` that are trained on (turns older than min_version are masked)."""
    return [v for v in t.policy_versions if v >= min_version]


class StalenessGate:
    def __init__(self, policy: str, max_staleness: int, groups_per_batch: int, batches: int) -> None:
        self.policy = policy
        self.eta = max_staleness
        self.B = groups_per_batch
        self.batches = batches
        self.groups: dict[str, Group] = {}  # untrained (and not dropped), by task id
        self.by_trajectory: dict[str, Group] = {}
        self.next_batch = 0
        self.assigned = 0
        self.dropped_groups = 0
        self._completions = 0

    # --- starting groups -------------------------------------------------------------------
    def wanted(self) -> int:
        """Groups still to assign for the run's batches (dropped groups are replaced)."""
        return self.batches * self.B + self.dropped_groups - self.assigned

    def may_assign(self, version: int) -> bool:
        if self.wanted() <= 0:
            return False
        if self.policy != "hold":
            return len(self.groups) < (self.eta + 1) * self.B
        deadline = version + self.eta
        if deadline < self.next_batch:
            return False  # it could only be trained staler than the bound
        deadlines = {deadline, *(g.deadline for g in self.groups.values() if g.deadline >= deadline)}
        return all(self._due_by(k) + 1 <= (k - self.next_batch + 1) * self.B for k in deadlines)

    def _due_by(self, k: int) -> int:
        return sum(1 for g in self.groups.values() if g.deadline <= k)

    def assign(self, task_id: str, version: int, members: list[str]) -> Group:
        group = Group(task_id, self.assigned, version, version + self.eta, members)
        self.assigned += 1
        self.groups[task_id] = group
        for t in members:
            self.by_trajectory[t] = group
        return group

    # --- finished trajectories ------------------------------------------------------------
    def finished(self, t: FinishedTrajectory) -> str:
        """'ok', 'duplicate' or 'unexpected'."""
        group = self.by_trajectory.get(t.trajectory_id)
        if group is None or group.task_id not in self.groups:
            return "unexpected"
        if t.trajectory_id in group.done:
            return "duplicate"
        group.done[t.trajectory_id] = t
        if group.complete:
            group.completed_order = self._completions
            self._completions += 1
        return "ok"

    def outstanding(self) -> int:
        """Assigned groups with a trajectory still running."""
        return sum(1 for g in self.groups.values() if not g.complete)

    # --- forming batch n ------------------------------------------------------------------
    def take_batch(self) -> tuple[Batch | None, list[Group]]:
        """The next batch, trained from version `next_batch` (None while it cannot form), and
        the groups dropped as too stale on the way (stale_policy "drop")."""
        n = self.next_batch
        complete = [g for g in self.groups.values() if g.complete]
        if self.policy == "hold":
            chosen = self._hold_choice(n, complete)
            dropped: list[Group] = []
        else:
            chosen, dropped = self._fifo_choice(n, complete)
        for g in dropped:
            self._remove(g)
            self.dropped_groups += 1
        if chosen is None:
            return None, dropped
        for g in chosen:
            self._remove(g)
        self.next_batch += 1
        min_version = n - self.eta if self.policy == "partial" else -1
        staleness: list[int] = []
        masked = 0
        for g in chosen:
            for t in g.trajectories():
                kept = trained_versions(t, min_version)
                masked += len(t.policy_versions) - len(kept)
                if kept:
                    s = n - min(kept)
                    staleness += [0] * (s + 1 - len(staleness))
                    staleness[s] += 1
        return Batch(n, chosen, dropped, staleness, masked, min_version), dropped

    def _hold_choice(self, n: int, complete: list[Group]) -> list[Group] | None:
        if len(complete) < self.B:
            return None
        chosen = sorted(complete, key=lambda g: (g.deadline, g.index))[: self.B]
        ids = {id(g) for g in chosen}
        rest = [g for g in self.groups.values() if id(g) not in ids]
        for k in {n, *(g.deadline for g in rest)}:  # F for batch n + 1, with this batch taken
            if sum(1 for g in rest if g.deadline <= k) > max(0, k - n) * self.B:
                return None
        return chosen

    def _fifo_choice(self, n: int, complete: list[Group]) -> tuple[list[Group] | None, list[Group]]:
        chosen, dropped = [], []
        for g in sorted(complete, key=lambda g: g.completed_order):
            if self.policy == "drop" and any(n - min(t.policy_versions) > self.eta for t in g.trajectories()):
                dropped.append(g)
            elif len(chosen) < self.B:
                chosen.append(g)
        return (chosen if len(chosen) == self.B else None), dropped

    def _remove(self, g: Group) -> None:
        del self.groups[g.task_id]
        for t in g.members:
            self.by_trajectory.pop(t, None)
