"""The run summary in async mode (ops/export.py, ops/checks.py): steps rows carry each batch's
staleness, drops and masked turns; under stale_policy "drop" the replacements are expected
too, so nothing reads as lost (or as negative lost); the completeness check accepts the async
events (turn_interrupted, trajectory_dropped)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from actors.config import load_config
from bus_schemas.eventlog import events_frame
from bus_schemas.lifecycle import LifecycleEvent
from bus_schemas.train import FinishedTrajectory, StepReport
from ops.checks import incomplete_trajectories
from ops.export import RunRecord, summarize
from runners.simulate import run
from tests.conftest import write_tiny_config


def finished(trajectory_id: str) -> FinishedTrajectory:
    return FinishedTrajectory(
        trajectory_id=trajectory_id,
        task_id=trajectory_id.split("-")[0],
        task_family="math",
        env_id="env0",
        step=0,
        policy_versions=[0],
        turns=1,
        reward=1.0,
        prompt_tokens=1,
        generated_tokens=1,
        observation_tokens=0,
        started_at_s=0.0,
        finished_at_s=1.0,
    )


def report(step: int, ids: list[str], staleness: list[int], dropped: int = 0, masked: int = 0) -> StepReport:
    return StepReport(
        step=step,
        policy_version=step,
        started_at_s=10.0 * step,
        rollout_done_at_s=10.0 * step + 9,
        rollout_s=9.0,
        train_s=1.0,
        trajectories=len(ids),
        mean_reward=1.0,
        mode="async",
        staleness=staleness,
        dropped=dropped,
        masked_turns=masked,
        trajectory_ids=ids,
    )


def test_summary_expects_the_replacements_of_dropped_groups_and_copies_the_batch_fields():
    """2 batches of 2 groups of 2 (8 expected by the config); batch 1 dropped one group (2
    trajectories), whose replacement finished too: 10 finished, 10 expected, 0 lost."""
    ids = [f"a{i}-g{g}" for i in range(5) for g in range(2)]
    record = RunRecord(
        events=[],
        finished=[finished(t) for t in ids],
        steps=[report(0, ids[:4], [4]), report(1, ids[6:], [2, 2], dropped=2, masked=3)],
        reports=[],
    )
    s = summarize(record, events_frame([]), policy="colocated", mode="async", backend="emulated", expected=8)
    assert s["trajectories_expected"] == 10 and s["trajectories_finished"] == 10
    assert s["trajectories_lost"] == 0 and s["trajectories_extra"] == 0
    assert s["trajectories_dropped"] == 2 and s["trajectories_trained"] == 8
    rows = s["steps"]
    assert [r["staleness"] for r in rows] == [[4], [2, 2]]
    assert [r["dropped"] for r in rows] == [0, 2] and [r["masked_turns"] for r in rows] == [0, 3]
    assert [(r["started_at_s"], r["rollout_done_at_s"]) for r in rows] == [(0.0, 9.0), (10.0, 19.0)]


def test_lost_is_never_negative_and_extra_finished_trajectories_are_counted():
    record = RunRecord(events=[], finished=[finished(f"a{i}-g0") for i in range(5)], steps=[report(0, ["a0-g0"], [1])], reports=[])
    s = summarize(record, events_frame([]), policy="colocated", mode="async", backend="emulated", expected=3)
    assert s["trajectories_lost"] == 0 and s["trajectories_extra"] == 2
    short = RunRecord(events=[], finished=[finished("a0-g0")], steps=[report(0, ["a0-g0"], [1])], reports=[])
    assert summarize(short, events_frame([]), policy="colocated", mode="async", backend="emulated", expected=3)["trajectories_lost"] == 2


def test_the_completeness_check_accepts_interrupted_turns_and_dropped_trajectories():
    def ev(kind: str, turn: int, **kw) -> LifecycleEvent:
        return LifecycleEvent(event_id=f"{kind}-{turn}", kind=kind, at_s=0.0, actor_id="x", trajectory_id="t", turn=turn, **kw)

    turn = ["prefill_queued", "prefill_started", "prefill_done", "decode_started", "decode_done"]
    events = [
        ev("started", 0),
        *(ev(k, 0) for k in turn),
        ev("turn_interrupted", 0, detail="policy 0 -> 1"),
        ev("tool_started", 0),
        ev("tool_done", 0),
    ]
    events += [*(ev(k, 1) for k in turn), ev("finished", 1), ev("trajectory_dropped", -1, detail="too stale")]
    assert incomplete_trajectories(events_frame(events), {"t"}, disaggregated=False) == {}
    assert incomplete_trajectories(events_frame(events[:-3]), {"t"}, disaggregated=False)["t"] == [
        "finished",
        "turn 1: decode_done",
    ]  # it still finds gaps


def test_the_completeness_check_judges_a_turn_on_its_last_attempt():
    """A hand-off abandoned for a re-prefill (an engine on a newer policy got KV of the older
    one, measured in the async DeepSeek bench while roles changed) leaves a `decode_queued` that
    no `kv_transfer_done` follows; the turn then runs on one engine and is complete. A last
    attempt that crossed engines still needs the whole hand-off."""

    def ev(kind: str, attempt: int = 0) -> LifecycleEvent:
        return LifecycleEvent(event_id=f"{kind}-{attempt}", kind=kind, at_s=0.0, actor_id="x", trajectory_id="t", turn=0, attempt=attempt)

    abandoned = [ev("started"), ev("prefill_queued"), ev("prefill_started"), ev("prefill_done"), ev("decode_queued"), ev("reprefill", 1)]
    colocated = [ev("prefill_started", 1), ev("prefill_done", 1), ev("decode_started", 1), ev("decode_done", 1), ev("finished")]
    assert incomplete_trajectories(events_frame(abandoned + colocated), {"t"}, disaggregated=None) == {}
    crossed = [
        ev("prefill_started", 1),
        ev("prefill_done", 1),
        ev("decode_queued", 1),
        ev("decode_started", 1),
        ev("decode_done", 1),
        ev("finished"),
    ]
    assert incomplete_trajectories(events_frame(abandoned + crossed), {"t"}, disaggregated=None)["t"] == ["turn 0: kv_transfer_done"]
    assert incomplete_trajectories(events_frame(abandoned + colocated[:-2] + colocated[-1:]), {"t"}, disaggregated=None)["t"] == [
        "turn 0: decode_done"
    ]


def async_run(
    tmp_path: Path, name: str, policy: str, eta: int, inflight: str = "interrupt", seed: int = 0, fleet: str = "colocated"
) -> Path:
    """The tiny config in async mode, 4 batches, in virtual time (runners.simulate): its folder."""
    path = write_tiny_config(tmp_path / f"{name}.toml", policy=fleet, steps=4)
    text = path.read_text().replace("seed = 3", f"seed = {seed}").replace("[run]\n", '[run]\nmode = "async"\n')
    text = text.replace("train_s = 2.0", f'train_s = 1.0\nmax_staleness = {eta}\nstale_policy = "{policy}"')
    text = text.replace("[engines]\n", f'[engines]\ninflight_on_update = "{inflight}"\n')
    path.write_text(text)
    out = tmp_path / name
    assert run(load_config(path), out, show_progress=False)["status"] == "completed"
    return out


@pytest.mark.parametrize("fleet", ["colocated", "static"])
def test_a_drop_run_expects_its_replacements_and_loses_nothing(tmp_path: Path, fleet: str):
    """max_staleness 0 with interrupting updates: groups go stale and are dropped and replaced;
    the log has both async event kinds, and every trajectory is complete."""
    out = async_run(tmp_path, "drop", "drop", 0, fleet=fleet)  # static: PD turns (1 prefill, 1 decode engine)
    s = json.loads((out / "summary.json").read_text())
    events = pl.read_parquet(out / "events.parquet")
    drops = events.filter(pl.col("kind") == "trajectory_dropped")
    assert drops.height > 0 and events.filter(pl.col("kind") == "turn_interrupted").height > 0
    assert s["trajectories_dropped"] == drops.height == sum(r["dropped"] for r in s["steps"]) == s["actors"]["trainer"]["dropped_stale"]
    assert s["trajectories_expected"] == 4 * 2 * 2 + drops.height == s["trajectories_finished"]
    assert s["trajectories_lost"] == 0 and s["trajectories_extra"] == 0 and s["incomplete_trajectories"] == 0
    assert s["trajectories_trained"] == 16 and [sum(r["staleness"]) for r in s["steps"]] == [4, 4, 4, 4]
    assert all(len(r["staleness"]) == 1 for r in s["steps"])  # max_staleness 0: every trained trajectory fresh


def test_a_partial_run_reports_its_masked_turns_per_batch(tmp_path: Path):
    out = async_run(tmp_path, "partial", "partial", 0, seed=5)
    s = json.loads((out / "summary.json").read_text())
    assert s["trajectories_expected"] == s["trajectories_finished"] == 16 and s["trajectories_lost"] == 0
    assert sum(r["masked_turns"] for r in s["steps"]) == s["actors"]["trainer"]["masked_turns"] > 0
    assert all(r["dropped"] == 0 for r in s["steps"]) and s["incomplete_trajectories"] == 0
