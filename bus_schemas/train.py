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
    policy_versions: list[int]  # per turn, in turn order: the (oldest) version that generated its tokens
    turns: int
    reward: float
    truncated: bool = False  # ended by the context cap, not by the agent
    error: str = ""  # real backends: why the environment's code ended it (reward 0), empty if it did not fail
    prompt_tokens: int
    generated_tokens: int  # summed over turns
    observation_tokens: int  # summed over turns
    started_at_s: float
    finished_at_s: float
    # real backends: the whole trajectory as the policy saw it (prompt, generations, observations),
    # a 0/1 mask of the tokens the policy generated, and their rollout log-probabilities (0.0 elsewhere)
    token_ids: list[int] = []
    generated_mask: list[int] = []
    logprobs: list[float] = []


class PolicyVersion(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    published_at_s: float
    train_s: float  # modelled or measured training time that produced it
    weights_ref: str = ""  # where real weights can be fetched (empty when modelled)


class StepReport(msgspec.Struct, frozen=True, kw_only=True):
    """Published on subjects.train_step() when a sync step ends, or (async) when a batch is trained:
    `step` is then the batch index and `policy_version` the version it was trained from."""

    step: int
    policy_version: int  # version the rollout ran on
    started_at_s: float
    rollout_done_at_s: float
    rollout_s: float  # first assignment to last finished trajectory
    train_s: float
    trajectories: int
    mean_reward: float
    # run.mode = "async" (docs/async.md); empty / zero in sync mode
    mode: str = "sync"
    staleness: list[int] = []  # trained trajectories per staleness 0, 1, ... (policy versions behind policy_version)
    dropped: int = 0  # trajectories finished but kept out of this batch as too stale (stale_policy "drop")
    masked_turns: int = 0  # turns older than the bound, masked out of the loss (stale_policy "partial")
    trajectory_ids: list[str] = []  # the trajectories trained on, in batch order


class ModelSpecRequest(msgspec.Struct, frozen=True, kw_only=True):
    """An engine asks the trainer for its model spec (request/reply on subjects.train_model())."""

    requester_id: str


class ModelSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What must be identical between trainer and engines: model config and tokenizer."""

    model_config: dict[str, str]  # HF config fields, values JSON-encoded (private fields left out)
    tokenizer: dict[str, str]  # tokenizer kind, vocabulary size, special ids, vocabulary digest


class WeightsFetch(msgspec.Struct, frozen=True, kw_only=True):
    """Request for one chunk of a policy version's weights (request/reply on subjects.train_weights())."""

    version: int
    chunk: int = 0
    requester_id: str


class WeightsChunk(msgspec.Struct, frozen=True, kw_only=True):
    """Reply to a WeightsFetch: one chunk of the safetensors-serialised state dict, or why none."""

    version: int
    ok: bool  # False: the trainer does not serve this version (any more)
    error: str = ""
    chunk: int = 0
    n_chunks: int = 1
    total_bytes: int = 0
    checksum: str = ""  # blake2b of the whole payload, checked after the last chunk
    data: bytes = b""
