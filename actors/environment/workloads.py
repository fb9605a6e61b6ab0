"""Agentic task families as seeded samplers (pure; no bus, no clock).

Parameters and their sources: ``docs/workloads.md``; LN(m, s) is a lognormal with median m
and log-sd s, truncated at the stated caps. Every trajectory gets its own numpy Generator
seeded from (run seed, trajectory seed), so a run is reproducible whatever the order in
which environments pick up trajectories.

With shared prompts (`workload.share_prompts`; `plan_trajectory`'s `prompt_seed`) the G
siblings of a GRPO task get one prompt, as on the real backends: its length is drawn from a
Generator seeded from (run seed, the task's prompt seed, `PROMPT_TAG`), where the prompt seed
is a digest of the task id (`task_prompt_seed`), so every sibling draws the same. Each trajectory
still draws its turn count and a prompt length of its own from its own Generator (the latter
discarded), so everything after the prompt (per-turn lengths, tool latencies, reward) is the
draw it gets with prompts not shared: only the prompt length differs between the two.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class LogNormal:
    median: float
    sigma: float
    lo: float = 0.0
    hi: float = float("inf")

    def sample(self, rng: np.random.Generator) -> float:
        return float(min(max(self.median * math.exp(self.sigma * rng.standard_normal()), self.lo), self.hi))


@dataclass(frozen=True, slots=True)
class Normal:
    mean: float
    sd: float
    lo: float
    hi: float

    def sample(self, rng: np.random.Generator) -> float:
        return float(min(max(rng.normal(self.mean, self.sd), self.lo), self.hi))


@dataclass(frozen=True, slots=True)
class Uniform:
    lo: float
    hi: float

    def sample(self, rng: np.random.Generator) -> float:
        return float(rng.uniform(self.lo, self.hi))


@dataclass(frozen=True, slots=True)
class GeometricPlusOne:
    p: float
    lo: int
    hi: int

    def sample(self, rng: np.random.Generator) -> float:
        return float(min(max(rng.geometric(self.p), self.lo), self.hi))


def pick(rng: np.random.Generator, cdf: np.ndarray) -> int:
    """An index drawn with the probabilities behind `cdf` (from `cumulative`): the same draw,
    from the same single uniform, as `rng.choice(len(cdf), p=...)`, without its per-call checks."""
    return int(cdf.searchsorted(rng.random(), side="right"))


def cumulative(probs: tuple[float, ...]) -> np.ndarray:
    cdf = np.cumsum(probs)
    return cdf / cdf[-1]


@dataclass(frozen=True, slots=True)
class Categorical:
    values: tuple[float, ...]
    probs: tuple[float, ...]
    cdf: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cdf", cumulative(self.probs))

    def sample(self, rng: np.random.Generator) -> float:
        return float(self.values[pick(rng, self.cdf)])


@dataclass(frozen=True, slots=True)
class Mixture:
    parts: tuple[object, ...]
    weights: tuple[float, ...]
    cdf: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cdf", cumulative(self.weights))

    def sample(self, rng: np.random.Generator) -> float:
        return self.parts[pick(rng, self.cdf)].sample(rng)  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class Profile:
    """One task family. Token counts in tokens, latencies in model seconds."""

    name: str
    turns: object
    prompt_tokens: object
    gen_tokens: object
    obs_tokens: object
    tool_latency_s: object
    context_cap_tokens: int
    solve_rate: float  # probability a trajectory earns reward 1 (modelled policy)
    source: str = field(default="docs/workloads.md")


PROFILES: dict[str, Profile] = {
    # Profile A: SWE coding agent (DeepSWE / SkyRL / OpenHands-like), thinking on.
    "swe": Profile(
        name="swe",
        turns=LogNormal(20, 0.6, 3, 50),
        prompt_tokens=Normal(3000, 600, 1500, 4096),
        gen_tokens=LogNormal(600, 0.8, 1, 4096),
        obs_tokens=LogNormal(400, 1.2, 1, 8000),
        tool_latency_s=Mixture((LogNormal(0.8, 1.0, 0, 300), LogNormal(15, 0.9, 0, 300)), (0.85, 0.15)),
        context_cap_tokens=65536,
        solve_rate=0.3,
    ),
    # Profile B: search agent, Search-R1 mode.
    "search": Profile(
        name="search",
        turns=Categorical((1, 2, 3, 4), (0.35, 0.35, 0.2, 0.1)),
        prompt_tokens=LogNormal(250, 0.4, 1, 4096),
        gen_tokens=LogNormal(150, 0.6, 1, 500),
        obs_tokens=Uniform(250, 500),
        tool_latency_s=LogNormal(1.5, 0.8, 0, 30),
        context_cap_tokens=4096,
        solve_rate=0.5,
    ),
    # Profile C: math + code interpreter (ReTool / SimpleTIR).
    "math": Profile(
        name="math",
        turns=GeometricPlusOne(0.35, 1, 10),
        prompt_tokens=LogNormal(200, 0.5, 1, 4096),
        gen_tokens=LogNormal(1500, 1.0, 1, 16384),
        obs_tokens=LogNormal(60, 1.2, 1, 1024),
        tool_latency_s=LogNormal(0.4, 0.9, 0, 30),
        context_cap_tokens=28672,
        solve_rate=0.6,
    ),
    # Profile D: terminal / OS agent (Terminal-Bench style).
    "terminal": Profile(
        name="terminal",
        turns=LogNormal(18, 0.7, 2, 50),
        prompt_tokens=LogNormal(2500, 0.5, 1, 8192),
        gen_tokens=LogNormal(400, 0.8, 1, 4096),
        obs_tokens=LogNormal(300, 1.4, 1, 8000),
        tool_latency_s=Mixture((LogNormal(0.5, 1.0, 0, 300), LogNormal(20, 1.2, 0, 300)), (0.8, 0.2)),
        context_cap_tokens=65536,
        solve_rate=0.4,
    ),
    # The learnable `calc` task of `envs/calc.py` (real backends run it for real); its modelled
    # shape for emulated runs: 2 turns of <= 24 tokens, a ~1 ms calculator tool.
    "calc": Profile(
        name="calc",
        turns=Categorical((2,), (1.0,)),
        prompt_tokens=Uniform(10, 18),
        gen_tokens=Uniform(1, 24),
        obs_tokens=Uniform(8, 60),
        tool_latency_s=LogNormal(0.001, 0.5, 0, 0.1),
        context_cap_tokens=4096,
        solve_rate=0.1,
        source="actors/environment/envs/calc.py",
    ),
    # The sandboxed `code` family of `envs/code.py` (real backends run the code); its modelled
    # shape: 1-3 turns (the last passes every test or is the third), prompts of ~110 bytes,
    # replies up to 256 tokens, test reports up to 400 bytes, a ~50 ms sandboxed run.
    "code": Profile(
        name="code",
        turns=Categorical((1, 2, 3), (0.2, 0.2, 0.6)),
        prompt_tokens=Uniform(90, 140),
        gen_tokens=Uniform(1, 256),
        obs_tokens=Uniform(40, 400),
        tool_latency_s=LogNormal(0.05, 0.5, 0, 10),
        context_cap_tokens=2048,
        solve_rate=0.05,
        source="actors/environment/envs/code.py",
    ),
}


@dataclass(slots=True)
class TrajectoryPlan:
    """The sampled shape of one trajectory; drawn lazily turn by turn from its own RNG.

    The environment's plan interface (a recorded trajectory, `trace.TracePlan`, has the same):
    `turn` names the turn a value is for; a sampled plan draws afresh on each call whatever
    the turn, in the order the agent loop asks."""

    profile: Profile
    rng: np.random.Generator
    turns: int
    prompt_tokens: int
    gen_scale: float = 1.0
    obs_scale: float = 1.0
    tool_latency_scale: float = 1.0
    # heavy-tailed tool calls with timeouts and retries (`workload.tool_tail`: share, alpha,
    # scale_s, timeout_s, retries), drawn from a stream of their own so the others stay as
    # they are; None: the family's latencies alone
    tool_tail: object | None = None
    tail_rng: np.random.Generator | None = None

    @property
    def family(self) -> str:
        return self.profile.name

    @property
    def context_cap_tokens(self) -> int:
        return self.profile.context_cap_tokens

    def max_output_tokens(self, turn: int = 0) -> int:
        return self.profile.gen_tokens.hi  # type: ignore[attr-defined]

    def gen_tokens(self, turn: int = 0) -> int:
        return max(1, round(self.profile.gen_tokens.sample(self.rng) * self.gen_scale))  # type: ignore[attr-defined]

    def obs_tokens(self, turn: int = 0) -> int:
        return max(1, round(self.profile.obs_tokens.sample(self.rng) * self.obs_scale))  # type: ignore[attr-defined]

    def tool_latency_s(self, turn: int = 0) -> float:
        latency_s = self.profile.tool_latency_s.sample(self.rng) * self.tool_latency_scale  # type: ignore[attr-defined]
        if self.tool_tail is None or self.tail_rng is None:
            return latency_s
        rng = self.tail_rng
        return tail_latency_s(self.tool_tail, rng, latency_s, lambda: self.profile.tool_latency_s.sample(rng) * self.tool_latency_scale)  # type: ignore[attr-defined]

    def reward(self) -> float:
        return float(self.rng.random() < self.profile.solve_rate)


PROMPT_TAG = 11  # separates a task's prompt stream from the streams seeded by (run seed, trajectory seed)
DIFFICULTY_TAG = 13  # ... the latent difficulty's streams
TAIL_TAG = 17  # ... and a trajectory's heavy-tailed tool calls


def tail_latency_s(spec, rng: np.random.Generator, first_s: float, redraw) -> float:
    """A tool call's time under `spec` (`workload.tool_tail`): an attempt takes the family's
    time (`first_s`, then `redraw()`), or with probability `spec.share` a Pareto(alpha,
    scale_s) one; an attempt past `timeout_s` is abandoned there and retried, at most
    `retries` times, the last one ending at the timeout whatever it returns."""
    total_s, latency_s = 0.0, first_s
    for attempt in range(spec.retries + 1):
        if rng.random() < spec.share:
            latency_s = spec.scale_s * (1.0 - rng.random()) ** (-1.0 / spec.alpha)
        if latency_s <= spec.timeout_s:
            return total_s + latency_s
        total_s += spec.timeout_s
        if attempt < spec.retries:
            latency_s = redraw()
    return total_s


def latent_difficulty(run_seed: int, task_seed: int, trajectory_seed: int, sibling_correlation: float) -> float:
    """A trajectory's standard-normal difficulty: `sibling_correlation` of it its task's (every
    sibling draws the same from `task_seed`), the rest its own."""
    task = np.random.default_rng([run_seed, task_seed, DIFFICULTY_TAG]).standard_normal()
    own = np.random.default_rng([run_seed, trajectory_seed, DIFFICULTY_TAG]).standard_normal()
    rho = sibling_correlation
    return float(rho * task + math.sqrt(1.0 - rho * rho) * own)


def task_prompt_seed(task_id: str) -> int:
    """The prompt seed every sibling of a task shares: a stable digest of its task id."""
    return zlib.crc32(task_id.encode())


def shape_scales(workload, run_seed: int, a) -> tuple[float, float, float]:
    """(turns, output, observation) multipliers of the trajectory assigned by `a` (its
    `task_id`, `seed` and `policy_version`) from the structure `workload` adds to the family
    (`workload.difficulty`, `workload.drift`): 1.0 each where it adds none."""
    d, drift = workload.difficulty, workload.drift
    z = latent_difficulty(run_seed, task_prompt_seed(a.task_id), a.seed, d.sibling_correlation) if d.sigma > 0 else 0.0
    k = a.policy_version  # sync: the RL step
    return (
        math.exp(d.sigma * d.turns * z) * (1.0 + drift.turns_per_step) ** k,
        math.exp(d.sigma * d.gen * z) * (1.0 + drift.gen_per_step) ** k,
        math.exp(d.sigma * d.obs * z) * (1.0 + drift.obs_per_step) ** k,
    )


def plan_trajectory(
    profile: Profile,
    run_seed: int,
    trajectory_seed: int,
    turns_max: int | None = None,
    gen_scale: float = 1.0,
    obs_scale: float = 1.0,
    tool_latency_scale: float = 1.0,
    prompt_seed: int | None = None,
    turns_scale: float = 1.0,
    tool_tail: object | None = None,
) -> TrajectoryPlan:
    """`prompt_seed` (`task_prompt_seed`): the prompt length is the task's, shared by its
    siblings; None: the trajectory draws its own. `turns_scale` multiplies the drawn turn
    count (before `turns_max`); `tool_tail` (`workload.tool_tail`) makes tool calls heavy-tailed."""
    rng = np.random.default_rng([run_seed, trajectory_seed])
    turns = max(1, round(profile.turns.sample(rng) * turns_scale))  # type: ignore[attr-defined]
    if turns_max is not None:
        turns = min(turns, turns_max)
    prompt = max(1, round(profile.prompt_tokens.sample(rng)))  # type: ignore[attr-defined]
    if prompt_seed is not None:  # the trajectory's own draw above keeps its later draws as they are
        task_rng = np.random.default_rng([run_seed, prompt_seed, PROMPT_TAG])
        prompt = max(1, round(profile.prompt_tokens.sample(task_rng)))  # type: ignore[attr-defined]
    tail_rng = np.random.default_rng([run_seed, trajectory_seed, TAIL_TAG]) if tool_tail is not None else None
    return TrajectoryPlan(profile, rng, turns, prompt, gen_scale, obs_scale, tool_latency_scale, tool_tail, tail_rng)


def choose_family(mix: dict[str, float], run_seed: int, step: int, task_index: int) -> str:
    """Deterministic family for a task, by the mix shares."""
    families = sorted(mix)
    shares = np.array([mix[f] for f in families], dtype=float)
    rng = np.random.default_rng([run_seed, step, task_index, 7])
    return families[int(rng.choice(len(families), p=shares / shares.sum()))]
