"""GRPO siblings share their first turn's prompt in the emulated workloads: one prompt length
per task, a prompt key on the first turn, and routing to where a sibling's prompt went."""

from __future__ import annotations

import msgspec
import numpy as np

from actors.environment.actor import EnvironmentActor, Trajectory
from actors.environment.router import PROMPT_HOMES, Router
from actors.environment.trace import TracePlan
from actors.environment.workloads import PROFILES, TrajectoryPlan, plan_trajectory, task_prompt_seed
from bus_schemas.control import Role
from bus_schemas.status import EngineStatus
from bus_schemas.train import TaskAssignment
from bus_schemas.work import PrefillWork

G = 8


def _siblings(profile: str, run_seed: int, step: int, k: int, tasks_per_step: int = 4, share: bool = True) -> list[TrajectoryPlan]:
    """The plans of task k's G siblings, seeded as the trainer seeds them."""
    task_id = f"s{step}-k{k}"
    seeds = [(step * tasks_per_step + k) * G + g for g in range(G)]
    prompt_seed = task_prompt_seed(task_id) if share else None
    return [plan_trajectory(PROFILES[profile], run_seed, s, prompt_seed=prompt_seed) for s in seeds]


def _draws(plan: TrajectoryPlan, n: int = 6) -> list:
    return [plan.turns] + [(plan.gen_tokens(t), plan.obs_tokens(t), plan.tool_latency_s(t)) for t in range(n)] + [plan.reward()]


def test_siblings_share_the_prompt_length_and_draw_the_rest_their_own():
    for family in PROFILES:
        plans = _siblings(family, 2026, 3, 1)
        assert len({p.prompt_tokens for p in plans}) == 1, family
        if family != "calc":  # calc's turns are fixed, its per-turn lengths are not
            assert len({p.turns for p in plans}) > 1, family
        assert len({tuple(_draws(p)[1:]) for p in plans}) == G, family  # per-turn draws differ among siblings
    other_tasks = {_siblings("swe", 2026, 3, k)[0].prompt_tokens for k in range(8)}
    assert len(other_tasks) > 1  # each task has its own prompt
    assert _siblings("swe", 2026, 3, 1)[0].prompt_tokens == _siblings("swe", 2026, 3, 1)[5].prompt_tokens


def test_shared_prompts_change_only_the_prompt_length():
    """With prompts shared each trajectory's later draws are those it gets without."""
    for family in PROFILES:
        for shared, own in zip(_siblings(family, 7, 0, 2), _siblings(family, 7, 0, 2, share=False), strict=True):
            assert _draws(shared) == _draws(own), family


def _old_plan(profile, run_seed: int, seed: int) -> tuple:
    """The plan as drawn before prompts could be shared: turns, then the prompt, then the turns'
    draws, all from the trajectory's own Generator."""
    rng = np.random.default_rng([run_seed, seed])
    turns = max(1, round(profile.turns.sample(rng)))
    prompt = max(1, round(profile.prompt_tokens.sample(rng)))
    rest = [
        (max(1, round(profile.gen_tokens.sample(rng))), max(1, round(profile.obs_tokens.sample(rng))), profile.tool_latency_s.sample(rng))
        for _ in range(6)
    ]
    return turns, prompt, rest, float(rng.random() < profile.solve_rate)


def test_unshared_prompts_reproduce_the_per_trajectory_draws():
    for family, profile in PROFILES.items():
        for seed in range(20):
            plan = plan_trajectory(profile, 11, seed)
            assert plan_trajectory(profile, 11, seed, prompt_seed=None).prompt_tokens == plan.prompt_tokens
            draws = _draws(plan)
            assert (plan.turns, plan.prompt_tokens, draws[1:-1], draws[-1]) == _old_plan(profile, 11, seed), family


def _status(engine_id: str, waiting_tokens: int, role: Role = Role.COLOCATED) -> EngineStatus:
    return EngineStatus(
        engine_id=engine_id,
        at_s=0.0,
        role=role,
        epoch=0,
        policy_version=0,
        backend="emulated",
        waiting_prefill=0,
        running_decode=0,
        kv_used_tokens=0,
        kv_capacity_tokens=1,
        held_kv_handles=0,
        busy_fraction=0.0,
        waiting_prefill_tokens=waiting_tokens,
    )


def test_a_siblings_first_turn_goes_where_the_prompt_went():
    router = Router(["e0", "e1", "e2"])
    for e in ("e0", "e1", "e2"):
        router.observe(_status(e, 0))
    first = router.route("", "", 0, 3000, prompt_key="s0-k0")
    assert first == "e0"
    assert [router.route("", "", 0, 3000, prompt_key="s0-k0") for _ in range(G - 1)] == ["e0"] * (G - 1)
    assert router.counters()["routed_prompt_home"] == G - 1
    assert router.route("", "", 0, 3000) == "e1"  # no prompt key: the least loaded, as before
    assert router.route("", "", 0, 3000, prompt_key="s0-k1") == "e2"  # a new task's prompt: the least loaded
    assert router.route("", "", 0, 3000, prompt_key="s0-k1") == "e2"


def test_an_overloaded_prompt_home_loses_the_sibling_to_the_least_loaded():
    router = Router(["e0", "e1"])
    router.observe(_status("e0", 0))
    router.observe(_status("e1", 0))
    assert router.route("", "", 0, 2000, prompt_key="s0-k0") == "e0"
    router.observe(_status("e0", 2000))  # e0 queued 2000 more than e1: within the prompt a miss recomputes
    assert router.route("", "", 0, 2000, prompt_key="s0-k0") == "e0"
    router.observe(_status("e0", 2001))  # more than the prompt's tokens ahead: balance wins
    assert router.route("", "", 0, 2000, prompt_key="s0-k0") == "e1"
    assert router.route("", "", 0, 2000, prompt_key="s0-k0") == "e1"  # the prompt's home is now where it last went


def test_the_prompt_key_counts_only_on_a_first_turn_and_homes_are_bounded():
    router = Router(["e0", "e1"])
    assert router.route("", "", 0, 100, prompt_key="t") == "e0"
    assert router.route("", "", 500, 100, prompt_key="t") == "e1"  # not a first turn: no prompt home
    for i in range(PROMPT_HOMES + 10):
        router.route("", "", 0, 1, prompt_key=f"task{i}")
    assert len(router.prompt_homes) == PROMPT_HOMES and "t" not in router.prompt_homes


def test_prefill_work_round_trips_the_prompt_key():
    work = PrefillWork(
        work_id="s0-k0-g1/n/t0/a0",
        trajectory_id="s0-k0-g1",
        turn=0,
        env_id="env0",
        task_family="swe",
        policy_version=0,
        context_tokens=0,
        new_tokens=3000,
        max_output_tokens=4096,
        queued_at_s=0.0,
        prompt_key="s0-k0",
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(work), type=PrefillWork)
    assert back == work and back.prompt_key == "s0-k0"
    assert msgspec.json.decode(msgspec.json.encode(work), type=PrefillWork).prompt_key == "s0-k0"
    older = msgspec.msgpack.encode({k: v for k, v in msgspec.structs.asdict(work).items() if k != "prompt_key"})
    assert msgspec.msgpack.decode(older, type=PrefillWork).prompt_key == ""  # a sender without the field


def _assignment(g: int, k: int = 0) -> TaskAssignment:
    return TaskAssignment(
        trajectory_id=f"s1-k{k}-g{g}",
        task_id=f"s1-k{k}",
        task_family="swe",
        sample_index=g,
        step=1,
        policy_version=1,
        seed=(4 + k) * G + g,
        assigned_at_s=0.0,
    )


def _environment(config, share: bool) -> EnvironmentActor:
    env = object.__new__(EnvironmentActor)  # only its config is read below
    env.config = msgspec.structs.replace(config, workload=msgspec.structs.replace(config.workload, share_prompts=share))
    return env


def test_the_environment_shares_prompts_and_keys_first_turns_by_task(tiny_config):
    env = _environment(tiny_config, share=True)
    plans = [env._sampled_plan(_assignment(g)) for g in range(G)]
    assert len({p.prompt_tokens for p in plans}) == 1
    t = Trajectory(_assignment(2), None, plans[2], started_at_s=0.0)
    assert env._prompt_key(t) == "s1-k0"
    t.turn = 1
    assert env._prompt_key(t) == ""
    replayed = Trajectory(_assignment(2), None, object.__new__(TracePlan), started_at_s=0.0)
    assert env._prompt_key(replayed) == ""  # a recorded trace's prompts are its own

    env = _environment(tiny_config, share=False)
    for g in range(G):
        a = _assignment(g)
        assert env._sampled_plan(a).prompt_tokens == plan_trajectory(PROFILES["swe"], tiny_config.run.seed, a.seed).prompt_tokens
    assert env._prompt_key(Trajectory(_assignment(2), None, plans[2], started_at_s=0.0)) == ""
