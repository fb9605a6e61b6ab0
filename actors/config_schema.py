"""The run configuration's schema: TOML decoded by msgspec into typed Structs.

Unknown keys are errors (``forbid_unknown_fields``), so a typo fails before anything
starts, with a message that names the key and the file.

A leaf: it imports only the standard library, msgspec and bus_schemas, so any layer may
import it (tests/test_layers.py holds it to that). Each section checks what it can alone;
the checks that need the registries of other packages (cost-model presets and links, task
families, forecasting models) and the cost model an engine runs with are added by
``actors.config``, whose ``load_config`` is the one to use for a run.
"""

from __future__ import annotations

import random
import re
import tomllib
from pathlib import Path
from typing import Literal, TypeVar

import msgspec

from bus_schemas.control import Role

Policy = Literal["colocated", "colocated-sticky", "static", "reactive", "prorsa", "oracle"]
POLICIES: tuple[str, ...] = Policy.__args__  # type: ignore[attr-defined]
DYNAMIC_POLICIES = ("reactive", "prorsa", "oracle")  # run an allocator that switches roles


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the key."""


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


class RunSection(_Section):
    name: str = "prorsa"
    seed: int = 0  # seeds every sampled length and latency
    time_scale: float = 1.0  # model seconds per wall second (20: a 60 s rollout takes 3 s)
    # "sync": rollout pauses while the trainer trains; "async": it never pauses (docs/async.md)
    mode: Literal["sync", "async"] = "sync"
    policy: Policy = "colocated"  # overridden by `--policy` (which also takes `static-P:D`)
    # status heartbeat period in wall seconds; default one per model second (1 / time_scale),
    # so the allocator and the routers see the same freshness at any time compression
    heartbeat_wall_s: float | None = None
    ack_wait_wall_s: float = 30.0  # un-acked work is redelivered after this many wall seconds
    # faults (docs/operations.md, "Faults and guarantees"): what the launcher does when an actor
    # process dies; "restart" brings it back (at most max_restarts times per actor, waiting
    # restart_backoff_wall_s, doubled at each restart); "abort" stops the run
    on_actor_death: Literal["abort", "restart"] = "restart"
    max_restarts: int = 5
    restart_backoff_wall_s: float = 0.5
    # an engine whose last heartbeat is older than this is out of allocation and routing until
    # it reports again; default: 10 heartbeats, at least 3 s
    lease_wall_s: float | None = None
    # deliveries of one work item before it goes to the dead-letter subject (bus_schemas/streams.py);
    # below max_restarts x engines, so a message that kills every engine it reaches stops first
    max_deliver: int = 10

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError("run.time_scale must be > 0")
        if self.heartbeat_wall_s is None:
            self.heartbeat_wall_s = 1.0 / self.time_scale
        if self.ack_wait_wall_s <= 0 or self.heartbeat_wall_s <= 0:
            raise ValueError("run.ack_wait_wall_s and run.heartbeat_wall_s must be > 0")
        if self.lease_wall_s is None:
            self.lease_wall_s = max(10 * self.heartbeat_wall_s, 3.0)
        if self.lease_wall_s <= self.heartbeat_wall_s:
            raise ValueError("run.lease_wall_s must be longer than run.heartbeat_wall_s")
        if self.max_restarts < 0 or self.restart_backoff_wall_s < 0 or self.max_deliver < 2:
            raise ValueError("run.max_restarts and run.restart_backoff_wall_s must be >= 0, run.max_deliver >= 2")


class LayoutSection(_Section):
    """Parallel layout of an engine (see actors.engine.emulated.costmodel.Layout)."""

    tp: int = 1  # tensor parallel GPUs per rank
    dp: int = 1  # DP-attention ranks per engine
    ep: int = 1  # expert-parallel GPUs (MoE)

    def __post_init__(self) -> None:
        if min(self.tp, self.dp, self.ep) < 1:
            raise ValueError("layout tp, dp and ep must be >= 1")


class EngineTruth(_Section):
    """What emulated engines really run, where it differs from the cost model the allocator,
    forecaster and routers are given (`engines.preset` and its constants): the rollout bench's
    mismatch table (docs/allocation.md, "What the allocator knows"). Factors multiply model
    time: prefill 1.3 makes every prefill token's compute (GEMM and attention) 30% slower,
    decode 0.75 every decode step's weight reads, KV reads and per-sequence work 25% faster;
    kv scales the KV pool. Empty and 1.0 everywhere: the engines run the priced model."""

    preset: str = ""  # another preset (e.g. an H100 fleet priced as H200); "": engines.preset
    prefill: float = 1.0
    decode: float = 1.0
    kv: float = 1.0
    lockstep_constants: Literal["", "value", "low", "high"] = ""  # "": engines.lockstep_constants
    # each engine's prefill and decode factors are further multiplied by one draw from
    # U(1 - spread, 1 + spread), fixed per engine id (engines of one fleet differ)
    spread: float = 0.0

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.kv) <= 0 or not 0 <= self.spread < 1:
            raise ValueError("engines.truth: prefill, decode and kv must be > 0, spread in [0, 1)")

    @property
    def exact(self) -> bool:
        """The engines run the model they are priced with."""
        return not self.preset and not self.lockstep_constants and self.spread == 0 and (self.prefill, self.decode, self.kv) == (1, 1, 1)


class EngineSection(_Section):
    count: int = 4
    backend: Literal["emulated", "torch", "vllm"] = "emulated"  # torch: real compute, see [model]; vllm: see [vllm]
    preset: str = "h100-qwen3-8b"  # cost-model preset, see actors.engine.emulated.costmodel.PRESETS
    link: str = "rdma-8x400g"  # KV transfer link preset, see actors.engine.emulated.costmodel.LINKS
    prefill_engines: int = 1  # engines in the prefill role under the `static` policy
    max_batch_tokens: int = 8192  # chunked-prefill token budget per iteration
    max_decode_seqs: int = 256  # decode batch cap
    max_waiting: int = 64  # admitted-but-unprefilled sequences before the engine stops pulling
    kv_ttl_s: float = 120.0  # model seconds a prefill engine holds KV for a decode engine
    decode_quantum_wall_s: float = 0.005  # wall time batched into one decode advance
    layout: LayoutSection = msgspec.field(default_factory=LayoutSection)  # every role, unless overridden
    prefill_layout: LayoutSection | None = None  # stage-specific parallelism for prefill engines
    decode_layout: LayoutSection | None = None  # ... and for decode engines
    switch_regime: Literal["instant", "sleep-wake", "restart"] = "instant"  # reconfiguration cost of a role switch
    # run.mode = "async": a new policy version reaches an engine mid-rollout. "finish": the engine
    # stops pulling, lets its in-flight turns finish on the old weights, then loads; "interrupt":
    # it loads at the next iteration boundary and recomputes its in-flight turns' KV (tokens so
    # far kept) on the new weights (docs/async.md)
    inflight_on_update: Literal["finish", "interrupt"] = "finish"
    # Per-turn placement (every policy but plain colocated): a turn appending at most this many
    # uncached tokens is prefilled where its KV already lives, a decode engine included; a
    # longer one goes to a prefill engine. 0: every prefill on a prefill (or colocated) engine.
    local_prefill_max_tokens: int = 1024
    # How the DP-attention ranks of one engine (layout dp > 1) share a forward mode per step
    # (docs/calibration.md, "DP-attention lockstep constants"): "sglang" — any rank prefilling makes every
    # rank eager with normal-mode all-to-all, and the prefilling rank's decodes wait that
    # step unless `mixed_chunk`; "vllm" — a chunk above the graph capture size makes every
    # rank eager, a smaller mixed step runs piecewise padded to the largest rank; "ideal" —
    # ranks only wait for the slowest (no mode coupling), the ablation baseline.
    dp_sync: Literal["sglang", "vllm", "ideal"] = "sglang"
    mixed_chunk: bool = False  # sglang: a prefilling rank's decodes advance in the same (eager) step
    # which value of each lockstep constant's published range: "value" (the one cited), "low"
    # (the end with the least penalty) or "high" (the most); the sensitivity bench sweeps it
    lockstep_constants: Literal["value", "low", "high"] = "value"
    # KV of a decode engine's generated tokens after a turn: "none" — the next remote prefill
    # recomputes them; "to-prefill" — pulled back by the prefill engine that holds the
    # trajectory's prefix, off the critical path; "store" — written to a shared KV store tier
    # any prefill engine loads from (`kv_store_*`).
    kv_writeback: Literal["none", "to-prefill", "store"] = "to-prefill"
    # How an engine admits work into its KV pool (actors/engine/admission.py): "sglang" — a new
    # request starts only if the free KV also holds the expected growth of the running decodes
    # (new_token_ratio), and a PD decode engine keeps 512 tokens per request in reserve;
    # "vllm" — whatever fits now starts, and the newest sequence is preempted when KV runs out
    admission: Literal["sglang", "vllm"] = "sglang"
    kv_store_link: str = "remote-store"  # link between engines and the store tier
    # A host-memory KV tier on every engine, whatever its role (SGLang's hierarchical cache,
    # vLLM's CPU offload): KV that no longer fits on the GPU (a decode retracted for room, a
    # prefix the LRU evicts) is copied to host memory over the GPU's PCIe link and copied back
    # when it is needed, instead of being computed again. False: it is dropped and recomputed.
    host_kv_tier: bool = True
    host_kv_ratio: float = 2.0  # host tier capacity / the GPU KV pool (SGLang hicache_ratio's default)
    # Under DP attention SGLang divides the chunked-prefill budget by the DP size
    # (`max_batch_tokens` / dp per rank); "full": every rank gets all of it (vLLM's DP engines)
    dp_chunk: Literal["divided", "full"] = "divided"
    # SGLang's PrefillDelayer (colocated DP-attention engines only): a rank's prefill waits, for
    # a bounded number of passes, until every rank of the group has prefill to run
    prefill_delayer: bool = False
    kv_store_capacity_tokens: int = 50_000_000  # store tier capacity (LRU eviction beyond it)
    truth: EngineTruth = msgspec.field(default_factory=EngineTruth)  # emulated engines only

    def __post_init__(self) -> None:
        if self.kv_store_capacity_tokens < 0:
            raise ValueError("engines.kv_store_capacity_tokens must be >= 0")
        if self.host_kv_ratio < 0:
            raise ValueError("engines.host_kv_ratio must be >= 0")
        if self.count < 1 or self.prefill_engines < 1:
            raise ValueError("engines.count and engines.prefill_engines must be >= 1")

    def layout_for(self, role: Role) -> LayoutSection:
        if role is Role.PREFILL and self.prefill_layout is not None:
            return self.prefill_layout
        if role is Role.DECODE and self.decode_layout is not None:
            return self.decode_layout
        return self.layout


class EnvironmentSection(_Section):
    count: int = 2
    max_live_trajectories: int = 256  # trajectories one environment runs at once
    # real backends (docs/environments.md): the class that runs every trajectory,
    # "package.module:Class"; empty: each family's built-in one (calc, code)
    entrypoint: str = ""
    options: dict[str, object] = msgspec.field(default_factory=dict)  # keyword arguments of its constructor
    step_timeout_wall_s: float = 30.0  # a reset or step that takes longer ends its trajectory
    max_turns: int = 16  # a trajectory still going after this many turns ends, truncated
    max_output_tokens: int = 256  # per turn, where the class sets no `max_output_tokens`

    def __post_init__(self) -> None:
        if self.count < 1 or self.max_live_trajectories < 1:
            raise ValueError("environments.count and max_live_trajectories must be >= 1")
        if self.step_timeout_wall_s <= 0 or self.max_turns < 1 or self.max_output_tokens < 1:
            raise ValueError("environments.step_timeout_wall_s must be > 0, max_turns and max_output_tokens >= 1")
        if self.entrypoint and not re.fullmatch(r"[\w.]+:\w+", self.entrypoint):
            raise ValueError(f"environments.entrypoint {self.entrypoint!r} is not 'package.module:Class'")


class TrainerSection(_Section):
    steps: int = 3
    tasks_per_step: int = 8  # B
    samples_per_task: int = 4  # G
    train_s: float = 30.0  # modelled training time per step, model seconds
    policy_ack_timeout_wall_s: float = 60.0  # engines must ack a new policy within this
    # real backends: "local" trains in the trainer actor (GRPO); "external" sends each step's
    # trajectories to `update_module` (launched as the `updater` actor) and serves the weights it
    # returns (docs/environments.md, "Your own trainer")
    update: Literal["local", "external"] = "local"
    update_module: str = ""  # python -m module of the external trainer
    update_timeout_wall_s: float = 600.0
    # run.mode = "async" only (docs/async.md): how many policy versions a trained trajectory may
    # lag the version it is trained from, and what happens to one that would lag more
    max_staleness: int = 1
    stale_policy: Literal["hold", "drop", "partial"] = "hold"
    # the torch trainer's correction for samples of an older policy: "none" clips the ratio
    # against the behaviour logprobs (PPO); "clipped_is" clips against the policy before the
    # update and weights each token by min(pi_before / pi_behaviour, is_cap) (decoupled PPO)
    off_policy_correction: Literal["none", "clipped_is"] = "none"
    is_cap: float = 2.0

    def __post_init__(self) -> None:
        if min(self.steps, self.tasks_per_step, self.samples_per_task) < 1:
            raise ValueError("trainer.steps, tasks_per_step and samples_per_task must be >= 1")
        if self.max_staleness < 0:
            raise ValueError(f"trainer.max_staleness must be >= 0 (policy versions), not {self.max_staleness}")
        if self.is_cap < 1.0:
            raise ValueError("trainer.is_cap must be >= 1")
        if (self.update == "external") != bool(self.update_module):
            raise ValueError("trainer.update = 'external' and trainer.update_module go together (the external trainer's module)")
        if self.update_timeout_wall_s <= 0:
            raise ValueError("trainer.update_timeout_wall_s must be > 0")


class FamilyOverride(_Section):
    """Shrink a profile for demos and tests; the defaults leave it as published."""

    turns_max: int | None = None  # clip turns per trajectory to this
    gen_scale: float = 1.0  # multiply per-turn generation lengths
    obs_scale: float = 1.0  # multiply observation lengths
    tool_latency_scale: float = 1.0  # multiply tool latencies


class Difficulty(_Section):
    """A latent difficulty per trajectory that moves its turn count and its output and
    observation lengths together, correlated across the G siblings of a task (harder tasks
    take more turns, longer reasoning and longer tool outputs for every sample; an assumption,
    docs/workloads.md, "Structure nobody told the forecaster"). Each trajectory's z is
    rho z_task + sqrt(1 - rho^2) z_own (standard normals); its turns, outputs and observations
    are multiplied by exp(sigma x elasticity x z). sigma 0: off."""

    sigma: float = 0.0
    sibling_correlation: float = 0.7  # rho
    turns: float = 1.0  # elasticities
    gen: float = 1.0
    obs: float = 1.0

    def __post_init__(self) -> None:
        if self.sigma < 0 or not 0 <= self.sibling_correlation <= 1:
            raise ValueError("workload.difficulty: sigma must be >= 0, sibling_correlation in [0, 1]")


class ToolTail(_Section):
    """Heavy-tailed tool calls with timeouts and retries: a share of calls takes a Pareto(alpha,
    scale_s) time instead of the family's; a call past timeout_s is abandoned at the timeout
    and retried (a fresh draw) up to `retries` times, the last one ending at the timeout
    whatever it returns. share 0: off."""

    share: float = 0.0
    alpha: float = 1.5
    scale_s: float = 10.0
    timeout_s: float = 120.0
    retries: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.share <= 1 or self.alpha <= 0 or self.scale_s <= 0 or self.timeout_s <= 0 or self.retries < 0:
            raise ValueError("workload.tool_tail: share in [0, 1], alpha, scale_s and timeout_s > 0, retries >= 0")


class RandomMixes(_Section):
    """Each RL step's task mix drawn at random over `families` (seeded by run.seed and the
    step): with probability single_share all of one family (abrupt changes between steps),
    otherwise shares from a flat Dirichlet. Empty families: off (mix and phases decide)."""

    families: list[str] = []
    single_share: float = 0.3

    def __post_init__(self) -> None:
        if not 0 <= self.single_share <= 1:
            raise ValueError("workload.random_mixes.single_share must be in [0, 1]")


class Drift(_Section):
    """Families whose trajectories grow as the policy learns: at RL step k (sync; async: the
    policy version) turns, outputs and observations are multiplied by (1 + per_step)^k."""

    turns_per_step: float = 0.0
    gen_per_step: float = 0.0
    obs_per_step: float = 0.0

    def __post_init__(self) -> None:
        if min(self.turns_per_step, self.gen_per_step, self.obs_per_step) <= -1:
            raise ValueError("workload.drift: each per_step must be > -1")


class WorkloadPhase(_Section):
    """From RL step `from_step` on, tasks follow `mix` (a task mix that shifts mid-run)."""

    from_step: int
    mix: dict[str, float]


def random_mix(spec: RandomMixes, run_seed: int, step: int) -> dict[str, float]:
    """Step `step`'s mix under `spec` (`RandomMixes`), the same for every reader."""
    rng = random.Random(f"mix:{run_seed}:{step}")
    families = sorted(spec.families)
    if rng.random() < spec.single_share:
        return {rng.choice(families): 1.0}
    draws = [rng.expovariate(1.0) for _ in families]  # a flat Dirichlet, normalised below
    return {f: d / sum(draws) for f, d in zip(families, draws)}


class WorkloadSection(_Section):
    mix: dict[str, float] = msgspec.field(default_factory=lambda: {"swe": 0.5, "math": 0.5})  # family -> share
    phases: list[WorkloadPhase] = []  # later steps' mixes, in increasing from_step
    overrides: dict[str, FamilyOverride] = {}
    # a recorded trace (JSONL, one trajectory a line) the environments replay instead of sampling
    # the families; mix, phases and overrides then pick nothing (docs/workloads.md, "Recorded traces")
    trace: str = ""
    # GRPO siblings (the G samples of a task) share their first turn's prompt, which a prefix
    # cache can reuse across them (as on the torch and vLLM backends); False: each draws its own
    share_prompts: bool = True
    # structure the forecaster is not told (docs/workloads.md, "Structure nobody told the forecaster")
    difficulty: Difficulty = msgspec.field(default_factory=Difficulty)
    tool_tail: ToolTail = msgspec.field(default_factory=ToolTail)
    random_mixes: RandomMixes = msgspec.field(default_factory=RandomMixes)
    drift: Drift = msgspec.field(default_factory=Drift)

    def __post_init__(self) -> None:
        for mix in self.mixes():
            if not mix or min(mix.values()) < 0 or sum(mix.values()) <= 0:
                raise ValueError("every workload mix needs positive shares")
        starts = [p.from_step for p in self.phases]
        if starts != sorted(set(starts)) or any(s < 1 for s in starts):
            raise ValueError("workload.phases need strictly increasing from_step values >= 1")

    def mixes(self) -> list[dict[str, float]]:
        return [self.mix, *(p.mix for p in self.phases)]

    def families(self) -> list[str]:
        """Every task family the section names (its mixes, or the random mixes' families, which
        replace them; and the overrides), each once."""
        drawn = self.random_mixes.families or [f for m in self.mixes() for f in m]
        named = [*drawn, *self.overrides]
        return list(dict.fromkeys(named))

    def mix_at(self, step: int, run_seed: int = 0) -> dict[str, float]:
        """The task mix of RL step `step` (random mixes: drawn from `run_seed` and the step)."""
        if self.random_mixes.families:
            return random_mix(self.random_mixes, run_seed, step)
        mix = self.mix
        for phase in self.phases:
            if phase.from_step <= step:
                mix = phase.mix
        return mix


class ModelSection(_Section):
    """The real model of the `torch` backend and its training (ignored by `emulated`)."""

    checkpoint: str = ""  # local HF checkpoint dir; empty: ops.launch builds the tiny model into <run>/model
    architecture: Literal["qwen2", "llama"] = "qwen2"  # the tiny model (built when checkpoint is empty)
    hidden_size: int = 64
    intermediate_size: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    max_positions: int = 2048
    seed: int = 0  # initialises the tiny model's weights
    temperature: float = 1.0  # sampling temperature; logprobs are of the tempered distribution
    stop_at_eos: bool = True  # False: every turn generates max_output_tokens (benchmarks)
    prefix_cache_tokens: int = 65536  # per-engine prefix cache (trajectory@version), LRU, in tokens
    decode_chunk_tokens: int = 8  # decode iterations one scheduler step runs on a fixed batch
    kv_chunk_bytes: int = 4 * 1024 * 1024  # KV and weights travel in chunks of this size
    threads: int = 1  # torch intra-op threads per process
    learning_rate: float = 3e-3  # Adam
    clip_eps: float = 0.2  # GRPO ratio clip
    epochs: int = 2  # optimisation passes over one step's trajectories
    verify_trainer: bool = True  # engines compare their model/tokenizer with the trainer's at start
    trainer_wait_wall_s: float = 120.0  # how long an engine waits for the trainer's model spec

    def __post_init__(self) -> None:
        if self.temperature <= 0 or self.learning_rate <= 0 or self.clip_eps <= 0:
            raise ValueError("model.temperature, learning_rate and clip_eps must be > 0")
        if min(self.hidden_size, self.layers, self.heads, self.kv_heads, self.decode_chunk_tokens, self.epochs) < 1:
            raise ValueError("model sizes, decode_chunk_tokens and epochs must be >= 1")
        if self.kv_chunk_bytes < 1024 or self.kv_chunk_bytes > 7 * 1024 * 1024:
            raise ValueError("model.kv_chunk_bytes must be in [1 KiB, 7 MiB] (the server's max_payload is 8 MiB)")


class VllmSection(_Section):
    """The `vllm` backend: a vLLM v1 engine in each engine actor (docs/vllm.md)."""

    model: str = ""  # local HF checkpoint dir (no download); empty: the tiny model of [model], built by the launcher
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len_tokens: int = 2048  # longest context (prompt + output) of one sequence
    kv_pool_gib: int = 1  # KV pool per engine (CPU: VLLM_CPU_KVCACHE_SPACE; GPU: kv_cache_memory_bytes)
    block_size_tokens: int = 0  # KV block size; 0: vLLM's default for the platform
    enforce_eager: bool = True  # False: compiled / CUDA-graph model (slower start, faster steps)
    tensor_parallel_size: int = 1  # GPUs per engine (CPU: 1)
    max_num_seqs: int = 64  # sequences one engine step holds
    seed: int = 0
    # KV between engines: "prorsa" — Prorsa's connector over NATS (actors.engine.vllm.connector);
    # "nixl" — vLLM's NixlConnector (GPU clusters; not tested here)
    kv_connector: Literal["prorsa", "nixl"] = "prorsa"
    kv_chunk_bytes: int = 4 * 1024 * 1024  # a KV transfer travels in chunks of this size
    kv_ttl_wall_s: float = 120.0  # held KV is dropped after this unless fetched
    kv_fetch_timeout_wall_s: float = 10.0  # one chunk's request/reply; past it the KV is recomputed

    def __post_init__(self) -> None:
        if min(self.max_model_len_tokens, self.kv_pool_gib, self.tensor_parallel_size, self.max_num_seqs) < 1:
            raise ValueError("vllm.max_model_len_tokens, kv_pool_gib, tensor_parallel_size and max_num_seqs must be >= 1")
        if self.kv_chunk_bytes < 1024 or self.kv_chunk_bytes > 7 * 1024 * 1024:
            raise ValueError("vllm.kv_chunk_bytes must be in [1 KiB, 7 MiB] (the server's max_payload is 8 MiB)")
        if self.kv_ttl_wall_s <= 0 or self.kv_fetch_timeout_wall_s <= 0:
            raise ValueError("vllm.kv_ttl_wall_s and kv_fetch_timeout_wall_s must be > 0")


class ForecasterSection(_Section):
    """The forecaster actor: one model, ticking every `tick_s` model seconds."""

    enabled: bool = False  # ops.launch starts the forecaster actor only when enabled
    model: str = "lifecycle"  # a name in forecasting.models.REGISTRY
    bin_s: float = 1.0  # width of one series bin, model seconds
    tick_s: float = 1.0  # forecast period, a multiple of bin_s
    horizons_s: list[float] = msgspec.field(default_factory=lambda: [1.0, 5.0, 10.0, 20.0, 30.0])
    watermark_s: float = 2.0  # wait this long past a tick for its late events, model seconds
    # an earlier run's lifecycle log (its folder or events.parquet): the forecaster starts from
    # the per-family statistics learned there, and this run's own displace them as they come
    prior_log: str = ""

    def __post_init__(self) -> None:
        if self.bin_s <= 0 or self.watermark_s < 0 or not self.horizons_s:
            raise ValueError("forecaster.bin_s must be > 0, watermark_s >= 0, horizons_s non-empty")
        for value, what in [(self.tick_s, "tick_s"), *((h, "horizons_s") for h in self.horizons_s)]:
            ratio = value / self.bin_s
            if value <= 0 or abs(ratio - round(ratio)) > 1e-9:
                raise ValueError(f"forecaster.{what} = {value} is not a positive multiple of bin_s = {self.bin_s}")


class AllocatorSection(_Section):
    """The allocator actor (policies reactive, prorsa and oracle); times in model seconds."""

    tick_s: float = 2.0  # decision period
    horizon_s: float = 10.0  # prorsa / oracle: size the split for the demand over this horizon
    min_dwell_s: float = 10.0  # an engine keeps a role at least this long before switching again
    drain_deadline_s: float = 5.0  # in-flight decodes left at this deadline migrate to another engine
    ack_timeout_wall_s: float = 10.0  # an engine that does not ack a SetRole within this is left out
    prefill_target_util: float = 0.8  # size prefill capacity so its utilisation stays at this
    decode_tpot_slack: float = 2.0  # a decode engine is "full" at the batch whose step time is this x its minimum
    min_gain_s: float = 2.0  # a change must save at least this many engine-seconds over the horizon, net of its cost
    # Colocation or PD (actors/allocator/policy.py): "cost-model" compares the fleet's load
    # colocated with the PD split's, both from the cost model, net of the switches' cost;
    # "thresholds" uses the two thresholds below; "never" always splits.
    colocation: Literal["cost-model", "thresholds", "never"] = "cost-model"
    # "thresholds": with prefill load (in engines, long prefills only) above this the fleet
    # splits into prefill and decode engines; below `colocate_below_engines` it goes back to
    # colocated (0: never colocated). Set from an earlier rollout bench, before the cost-model rule.
    disaggregate_above_engines: float = 1.0
    colocate_below_engines: float = 0.5
    oracle_log: str = ""  # oracle: events.parquet of a recorded run of the same workload
    # engines the dynamic policies start in the prefill role, the rest decode (0: every
    # engine starts colocated). Where a split is known to pay from the first second (an
    # earlier run of the same workload), the fleet need not relocate the step's burst to
    # reach it; the allocator's rules judge it from the first decision on (docs/allocation.md)
    start_prefill_engines: int = 0
    # prorsa: size on the forecast's mean (0) or on this quantile of it, in (0, 1) (e.g. 0.9:
    # provision for the upper end of the calibrated 10-90% interval); see docs/forecasting.md
    provision_quantile: float = 0.0
    # prorsa / oracle: rate a saturated fleet by the decode tokens each arrangement turns over
    # (actors/allocator/throughput.py), and keep appends off full lockstep decode engines, which
    # that model assumes (docs/allocation.md; false restores the load rules alone)
    saturated_regime: bool = True
    # Where prorsa's and reactive's capacities come from (docs/allocation.md, "What the
    # allocator knows"): "measured", the cost model (`engines.preset`) as a prior that the
    # engines' own step times overrule as they accumulate (actors/allocator/measured.py);
    # "model", the cost model alone; "truth", the cost model the emulated engines really run
    # (`engines.truth`; the oracle's, in the bench's mismatch table)
    capacity: Literal["measured", "model", "truth"] = "measured"
    # How prorsa and oracle choose an arrangement (docs/allocation.md): "evaluator", one
    # prediction per arrangement of the time to finish the live trajectories' work left,
    # switches included, and the best (actors/allocator/evaluator.py); "rules", the load and
    # throughput rules of actors/allocator/policy.py, each change paid back within the horizon
    decision: Literal["rules", "evaluator"] = "evaluator"

    def __post_init__(self) -> None:
        if self.start_prefill_engines < 0:
            raise ValueError(f"allocator.start_prefill_engines = {self.start_prefill_engines} must be >= 0 (0: start colocated)")
        if not 0 <= self.provision_quantile < 1:
            raise ValueError("allocator.provision_quantile must be 0 (the mean) or a quantile level in (0, 1)")
        if min(self.tick_s, self.horizon_s, self.ack_timeout_wall_s) <= 0 or self.min_dwell_s < 0 or self.drain_deadline_s < 0:
            raise ValueError("allocator.tick_s, horizon_s and ack_timeout_wall_s must be > 0; min_dwell_s, drain_deadline_s >= 0")
        if not 0 <= self.colocate_below_engines <= self.disaggregate_above_engines:
            raise ValueError("allocator.colocate_below_engines must be in [0, disaggregate_above_engines]")
        if not 0 < self.prefill_target_util <= 1 or self.decode_tpot_slack <= 1:
            raise ValueError("allocator.prefill_target_util must be in (0, 1] and decode_tpot_slack > 1")


class BusSection(_Section):
    """The embedded nats-server and the LIFECYCLE stream (docs/operations.md, "Faults and guarantees")."""

    storage: Literal["file", "memory"] = "file"  # the LIFECYCLE stream's storage
    # JetStream fsync: "always" (the safe choice: an acked event survives a host crash), or a
    # period such as "2m" (NATS's default: faster, an acked event may be lost with the host)
    sync_interval: str = "always"
    lifecycle_max_bytes: int = -1  # -1: no limit; when full, new events are refused (discard new) and the launcher alerts
    lifecycle_max_msgs: int = -1
    # servers holding each stream and KV bucket: 1 on a lone server, 3 on a 3-server cluster
    # (every stream survives the loss of one server; docs/deploy.md); JetStream allows 1 to 5
    replicas: int = 1
    # TLS on every connection to the bus (docs/deploy.md, "TLS"): "off"; "local": the launcher
    # makes a CA and certificates for the run (DIR/tls) and its embedded server requires TLS
    # with client certificates (mutual TLS); "on": a server given with --nats-url (tls:// URLs),
    # trusted through tls_ca, with tls_cert and tls_key as the clients' certificate (mutual TLS)
    tls: Literal["off", "local", "on"] = "off"
    tls_ca: str = ""  # PEM: the CA bundle that signed the servers' certificates ("on")
    tls_cert: str = ""  # PEM: the actors' client certificate, where the server verifies clients ("on"; with tls_key)
    tls_key: str = ""

    def __post_init__(self) -> None:
        if self.tls == "on" and not self.tls_ca:
            raise ValueError("bus.tls = 'on' needs bus.tls_ca (the PEM bundle of the CA that signed the servers' certificates)")
        if self.tls != "on" and (self.tls_ca or self.tls_cert or self.tls_key):
            raise ValueError(f"bus.tls_ca, tls_cert and tls_key apply with bus.tls = 'on', not {self.tls!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("bus.tls_cert and bus.tls_key go together (a client certificate and its key)")
        if self.sync_interval != "always" and not re.fullmatch(r"\d+(ms|s|m|h)", self.sync_interval):
            raise ValueError(f"bus.sync_interval must be 'always' or a period like '2m', not {self.sync_interval!r}")
        if not 1 <= self.replicas <= 5:
            raise ValueError(f"bus.replicas must be 1 to 5 (JetStream's limit), not {self.replicas}")


class GatewaySection(_Section):
    """The OpenAI-compatible endpoint (docs/gateway.md): each environment actor serves it, the
    i-th on `port` + i, and outside agent harnesses drive the trajectories the trainer assigns."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str = ""  # what /v1/models lists; empty: the run's name
    claim_wait_wall_s: float = 30.0  # longest a GET /v1/prorsa/sessions/next waits for a session
    reply_timeout_wall_s: float = 600.0  # longest a chat request waits for the model's reply
    # a session that gets no request or end for this long (from its assignment, or from the
    # model's last reply) ends, reward 0 (an env_timeouts error); in place of
    # environments.step_timeout_wall_s
    session_idle_wall_s: float = 600.0

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"gateway.port must be 0-65535, not {self.port}")
        if min(self.claim_wait_wall_s, self.reply_timeout_wall_s, self.session_idle_wall_s) <= 0:
            raise ValueError("gateway.claim_wait_wall_s, reply_timeout_wall_s and session_idle_wall_s must be > 0")


class Config(_Section):
    run: RunSection = msgspec.field(default_factory=RunSection)
    bus: BusSection = msgspec.field(default_factory=BusSection)
    engines: EngineSection = msgspec.field(default_factory=EngineSection)
    environments: EnvironmentSection = msgspec.field(default_factory=EnvironmentSection)
    trainer: TrainerSection = msgspec.field(default_factory=TrainerSection)
    workload: WorkloadSection = msgspec.field(default_factory=WorkloadSection)
    forecaster: ForecasterSection = msgspec.field(default_factory=ForecasterSection)
    model: ModelSection = msgspec.field(default_factory=ModelSection)
    vllm: VllmSection = msgspec.field(default_factory=VllmSection)
    allocator: AllocatorSection = msgspec.field(default_factory=AllocatorSection)
    gateway: GatewaySection = msgspec.field(default_factory=GatewaySection)

    def __post_init__(self) -> None:
        if self.run.policy == "oracle" and not self.allocator.oracle_log:
            raise ValueError("policy oracle needs allocator.oracle_log (events.parquet of a recorded run)")
        if self.trainer.update == "external" and self.engines.backend == "emulated":
            raise ValueError("trainer.update = 'external' trains real models (engines.backend = 'torch' or 'vllm')")
        if self.gateway.enabled and self.engines.backend == "emulated":
            raise ValueError("gateway.enabled serves real engines (engines.backend = 'torch' or 'vllm'), not emulated ones")

    @property
    def affinity_routing(self) -> bool:
        """A trajectory's next turn goes back to the engine that prefilled its last one
        (its prefix is cached there). Every policy but plain `colocated`, the paper's baseline."""
        return self.run.policy != "colocated"

    @property
    def local_prefill_max_tokens(self) -> int:
        """Per-turn placement's threshold under this policy (0: decode engines never prefill):
        every policy with decode engines, a fixed split's included (an operator of a static
        PD deployment prefills a short append where its KV lives, as NVIDIA Dynamo's
        conditional disaggregation does); plain `colocated` has one shared queue."""
        return 0 if self.run.policy == "colocated" else self.engines.local_prefill_max_tokens

    @property
    def runs_allocator(self) -> bool:
        return self.run.policy in DYNAMIC_POLICIES

    @property
    def runs_forecaster(self) -> bool:
        return self.forecaster.enabled or self.run.policy == "prorsa"

    def engine_ids(self) -> list[str]:
        return [f"e{i}" for i in range(self.engines.count)]

    def env_ids(self) -> list[str]:
        return [f"env{i}" for i in range(self.environments.count)]

    def trajectories_expected(self) -> int:
        t = self.trainer
        return t.steps * t.tasks_per_step * t.samples_per_task


C = TypeVar("C", bound=Config)


def parse_config(path: str | Path, config_type: type[C]) -> C:
    """Read a TOML (or JSON) config as `config_type`: this module's `Config`, or one that adds
    checks to it (``actors.config.Config``); raise ConfigError naming the file and what is wrong."""
    path = Path(path)
    try:
        text = path.read_text()
        raw = msgspec.json.decode(text) if path.suffix == ".json" else tomllib.loads(text)
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except (tomllib.TOMLDecodeError, msgspec.DecodeError) as err:
        raise ConfigError(f"{path}: not valid {path.suffix.lstrip('.').upper() or 'TOML'}: {err}") from None
    try:
        return msgspec.convert(raw, config_type)
    except msgspec.ValidationError as err:
        raise ConfigError(f"{path}: {err}") from None


def with_policy(config: C, policy: str | None) -> C:
    """`config` under another policy, checked again as its own type; `static-P:D` is the static
    policy with P prefill engines."""
    if policy is None:
        return config
    engines = config.engines
    split = re.fullmatch(r"static-(\d+):(\d+)", policy)
    if split is not None:
        n_prefill, n_decode = int(split[1]), int(split[2])
        if n_prefill < 1 or n_decode < 1 or n_prefill + n_decode != engines.count:
            raise ConfigError(f"--policy {policy}: P:D must be >= 1 each and add up to engines.count = {engines.count}")
        policy, engines = "static", msgspec.structs.replace(engines, prefill_engines=n_prefill)
    raw = {**msgspec.to_builtins(config), "run": {**msgspec.to_builtins(config.run), "policy": policy}}
    raw["engines"] = msgspec.to_builtins(engines)
    try:
        return msgspec.convert(raw, type(config))
    except msgspec.ValidationError as err:
        raise ConfigError(f"--policy: {err}") from None


def policy_label(config: Config) -> str:
    """The policy's name in results: `static-P:D` for a static split."""
    if config.run.policy == "static":
        p = config.engines.prefill_engines
        return f"static-{p}:{config.engines.count - p}"
    return config.run.policy


def initial_roles(config: Config) -> dict[str, Role]:
    """The role each engine starts in under the config's policy: a split for `static`, and
    for a dynamic policy given `allocator.start_prefill_engines`; colocated otherwise (a
    dynamic fleet's allocator splits it when that pays)."""
    ids = config.engine_ids()
    if config.run.policy == "static":
        n_prefill, key = config.engines.prefill_engines, "static policy: engines.prefill_engines"
    elif config.run.policy in DYNAMIC_POLICIES and config.allocator.start_prefill_engines:
        n_prefill, key = config.allocator.start_prefill_engines, "allocator.start_prefill_engines"
    else:
        return {engine_id: Role.COLOCATED for engine_id in ids}
    if n_prefill >= len(ids):
        raise ConfigError(f"{key} = {n_prefill} leaves no decode engine out of engines.count = {len(ids)}")
    return {engine_id: Role.PREFILL if i < n_prefill else Role.DECODE for i, engine_id in enumerate(ids)}
