"""RL-loop messages: task assignments, finished trajectories, policy versions, step reports."""

from __future__ import annotations

import msgspec


class TaskAssignment(msgspec.Struct, frozen=True, kw_only=True):
    """One trajectory to roll out (one of the G samples of one task)."""

    trajectory_id: str  # unique in the run: "s<step>-k<task>-g<sample>"
    task_id: str  # the task; its G samples form one GRPO group
    task_family: str  # workload profile name
    sample_index: int  # 0..G-1
    step: int  # RL step that wants this trajectory
    policy_version: int  # the trajectory runs on this policy (sync: == step)
    seed: int  # drives the trajectory's sampled lengths and latencies
    assigned_at_s: float


class FinishedTrajectory(msgspec.Struct, frozen=True, kw_only=True):
    """A trajectory at its end, for the trainer."""

    trajectory_id: str
    task_id: str
    task_family: str
    env_id: str
    step: int
    policy_versions: list[int]  # every version the turns ran on, in turn order
    turns: int
    reward: float
    truncated: bool = False  # ended by the context cap, not by the agent
    prompt_tokens: int
    generated_tokens: int  # summed over turns
    observation_tokens: int  # summed over turns
    started_at_s: float
    finished_at_s: float


class PolicyVersion(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    published_at_s: float
    train_s: float  # modelled or measured training time that produced it
    weights_ref: str = ""  # where real weights can be fetched (empty when modelled)


class StepReport(msgspec.Struct, frozen=True, kw_only=True):
    """Published on subjects.train_step() when a sync step ends."""

    step: int
    policy_version: int  # version the rollout ran on
    started_at_s: float
    rollout_done_at_s: float
    rollout_s: float  # first assignment to last finished trajectory
    train_s: float
    trajectories: int
    mean_reward: float
