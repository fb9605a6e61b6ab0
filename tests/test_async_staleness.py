"""Async RL: the staleness bound holds in every training batch, for every stale_policy.

Pure: the trainer's gate under random completion orders and turn versions (many seeds).
Integration: whole async runs in virtual time (runners.simulate's actors, in-process bus),
seeded, with random training times; the bound is checked from the finished trajectories'
own per-turn versions, not from the trainer's report.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from actors.base.inproc import InProcServer
from actors.base.virtual import VirtualTimeLoop
from actors.config import ConfigError, load_config
from actors.trainer.async_loop import BatchCannotFill
from actors.trainer.staleness import StalenessGate
from bus_schemas import streams
from bus_schemas.train import FinishedTrajectory
from runners.simulate import build_actors
from tests.conftest import write_tiny_config

POLICIES = ("hold", "drop", "partial")


def finished(trajectory_id: str, task_id: str, versions: list[int]) -> FinishedTrajectory:
    return FinishedTrajectory(
        trajectory_id=trajectory_id,
        task_id=task_id,
        task_family="math",
        env_id="env0",
        step=0,
        policy_versions=versions,
        turns=len(versions),
        reward=0.0,
        prompt_tokens=1,
        generated_tokens=1,
        observation_tokens=0,
        started_at_s=0.0,
        finished_at_s=0.0,
    )


def check_batch(batch, eta: int, policy: str) -> None:
    """The bound, recomputed from the trajectories' own turn versions."""
    u = batch.index
    for t in batch.trajectories():
        if policy == "partial":
            kept = [v for v in t.policy_versions if v >= u - eta]
            assert batch.min_version == u - eta
            assert all(u - v <= eta for v in kept)
        else:
            assert u - min(t.policy_versions) <= eta, (policy, u, t.trajectory_id, t.policy_versions)
        assert max(t.policy_versions) <= u  # no turn of a version the trainer has not made


def drive_gate(policy: str, eta: int, seed: int, B: int = 3, G: int = 2, batches: int = 8) -> dict:
    """A discrete-event model of the async loop: random finishing order, and each turn runs on
    a version between the group's assignment and the trainer's current one (engines lag)."""
    rng = random.Random(seed)
    gate = StalenessGate(policy, eta, B, batches)
    version, running, seen = 0, [], {"batches": 0, "max_staleness": 0, "dropped": 0, "masked": 0}
    while gate.next_batch < batches:
        while gate.may_assign(version):
            g = gate.assign(f"k{gate.assigned}", version, [f"k{gate.assigned}-g{i}" for i in range(G)])
            running += [(t, g.task_id, g.version) for t in g.members]
        batch, dropped = gate.take_batch()
        seen["dropped"] += len(dropped)
        if batch is not None:
            check_batch(batch, eta, policy)
            seen["batches"] += 1
            seen["masked"] += batch.masked_turns
            seen["max_staleness"] = max(seen["max_staleness"], len(batch.staleness) - 1)
            version += 1
            continue
        if gate.may_assign(version):
            continue  # groups dropped just now are replaced
        assert running, f"{policy}: no batch, nothing running: the gate would hang"
        t, task_id, v0 = running.pop(rng.randrange(len(running)))
        turns = rng.randint(1, 4)
        versions = sorted(rng.randint(v0, version) for _ in range(turns))
        assert gate.finished(finished(t, task_id, versions)) == "ok"
    return seen


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("eta", [0, 1, 2])
def test_the_gate_never_trains_beyond_the_bound_under_random_completion_orders(policy: str, eta: int):
    seen = [drive_gate(policy, eta, seed) for seed in range(40)]
    assert all(s["batches"] == 8 for s in seen)
    if eta > 0:  # the bound is reached, not avoided by training only fresh samples
        assert max(s["max_staleness"] for s in seen) == eta
    if policy == "drop" and eta > 0:
        assert sum(s["dropped"] for s in seen) > 0  # too-stale groups exist and are dropped, counted
    if policy == "partial" and eta > 0:
        assert sum(s["masked"] for s in seen) > 0  # too-old turns exist and are masked


def test_hold_starts_a_group_only_if_a_batch_within_the_bound_has_room():
    gate = StalenessGate("hold", 0, 2, 4)
    assert [gate.may_assign(0) and gate.assign(f"k{i}", 0, [f"k{i}-g0"]) is not None for i in range(3)] == [True, True, False]
    for i in range(2):
        gate.finished(finished(f"k{i}-g0", f"k{i}", [0]))
    batch, _ = gate.take_batch()
    assert batch is not None and batch.index == 0
    assert not gate.may_assign(0)  # version 0 could only be trained in batch 1 at staleness 1
    assert gate.may_assign(1)


def run_async(tmp_path: Path, name: str, policy: str, eta: int, seed: int, train_s: float, inflight: str):
    """One async run of the tiny config in virtual time; returns the trainer."""
    path = write_tiny_config(tmp_path / f"{name}.toml", steps=4)
    text = path.read_text().replace("seed = 3", f"seed = {seed}").replace("[run]\n", '[run]\nmode = "async"\n')
    text = text.replace("train_s = 2.0", f'train_s = {train_s}\nmax_staleness = {eta}\nstale_policy = "{policy}"')
    text = text.replace("[engines]\n", f'[engines]\ninflight_on_update = "{inflight}"\n')
    path.write_text(text)
    config = load_config(path)
    loop = VirtualTimeLoop()

    async def main():
        server = InProcServer()
        await streams.ensure_streams(server.connect("test").jetstream())
        actors = build_actors(config, server)
        trainer = actors[-1]
        tasks = [asyncio.create_task(a.run()) for a in actors]
        try:
            await asyncio.wait_for(tasks[-1], timeout=100_000)  # model seconds: virtual time
        finally:
            for a in actors:
                a.request_stop("test over")
            await asyncio.gather(*tasks, return_exceptions=True)
        return trainer, actors

    try:
        return loop.run_until_complete(main())
    finally:
        for task in asyncio.all_tasks(loop):
            task.cancel()
        loop.run_until_complete(asyncio.gather(*asyncio.all_tasks(loop), return_exceptions=True))
        loop.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_async_runs_with_random_timings_never_exceed_the_bound(tmp_path: Path, policy: str):
    rng = random.Random(14)
    stalest = 0
    for run in range(4):
        eta, train_s = rng.choice([0, 1, 2]), rng.uniform(0.5, 20.0)
        inflight = rng.choice(["finish", "interrupt"])
        trainer, _ = run_async(tmp_path, f"{policy}{run}", policy, eta, seed=rng.randrange(1000), train_s=train_s, inflight=inflight)
        assert len(trainer.batches) == 4 and trainer.failure is None
        for batch in trainer.batches:
            check_batch(batch, eta, policy)
            assert len(batch.groups) == 2 and all(len(g.trajectories()) == 2 for g in batch.groups)  # B whole groups of G
            stalest = max(stalest, batch.index - min(min(t.policy_versions) for t in batch.trajectories()))
        reported = [r.staleness for r in trainer.reports]
        assert reported == [b.staleness for b in trainer.batches] and all(sum(s) <= 4 for s in reported)
        dropped = trainer.counters["dropped_stale"]
        assert dropped == sum(r.dropped for r in trainer.reports)  # every drop is counted, in a report too
        if policy != "drop":
            assert dropped == 0
    assert stalest > 0  # rollout overlapped training: some trained turns were older than the batch's version


def test_async_interrupt_resumes_turns_on_the_new_version_with_their_tokens(tmp_path: Path):
    """stale_policy "partial" with interrupting updates: a trajectory that spans versions keeps
    its earlier turns (and their versions), and a cut turn keeps the tokens it had."""
    trainer, actors = run_async(tmp_path, "partial", "partial", 1, seed=5, train_s=1.0, inflight="interrupt")
    engines = [a for a in actors if a.kind == "engine"]
    assert sum(e.counters["turns_interrupted"] for e in engines) > 0
    spanning = [t for b in trainer.batches for t in b.trajectories() if len(set(t.policy_versions)) > 1]
    assert spanning
    for t in spanning:
        assert t.policy_versions == sorted(t.policy_versions)  # remaining turns moved forward, never back
    env = next(a for a in actors if a.kind == "environment")
    assert env.counters["stale_results"] == 0 and env.newest_version >= 1


def test_negative_staleness_is_a_one_line_config_error(tmp_path: Path):
    path = write_tiny_config(tmp_path / "bad.toml")
    path.write_text(path.read_text().replace("train_s = 2.0", "train_s = 2.0\nmax_staleness = -1"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "max_staleness must be >= 0" in str(err.value) and "\n" not in str(err.value)


def test_a_batch_that_cannot_fill_is_an_error_not_a_hang(tmp_path: Path):
    """Every group finished and untrained, none may start, no batch forms: the loop raises."""
    from actors.trainer.async_loop import AsyncTrainerLoop

    config = load_config(write_tiny_config(tmp_path / "t.toml"))
    loop = AsyncTrainerLoop()
    loop.config, loop.counters, loop.policy_version = config, {"batch_cannot_fill": 0}, 0
    loop.gate = StalenessGate("hold", 0, 2, 1)
    loop.gate.assign("k0", 0, ["k0-g0"])
    loop.gate.finished(finished("k0-g0", "k0", [0]))
    loop.gate.dropped_groups = -1  # one group wanted in all: the batch of two can never fill
    assert loop.gate.take_batch() == (None, [])
    with pytest.raises(BatchCannotFill, match="batch 0 cannot fill"):
        loop._check_can_fill()
    assert loop.counters["batch_cannot_fill"] == 1
