"""Recorded traces as workloads (docs/workloads.md, "Recorded traces"): the format and its JSON
Schema, the checks a trace gets when the config loads, the mapping of its lines onto a run's
steps, tasks and samples, and the round trip: a run recorded with `runners.trace` and
replayed in virtual time under the emulated engines reproduces the run's turns, tokens,
tool seconds and rewards exactly (sync and async emulated runs here; in the e2e test, a
launched torch run, replayed in virtual time and launched on a nats-server)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import msgspec
import polars as pl
import pytest

from actors.config import ConfigError, load_config
from actors.environment.trace import TRACE_SCHEMA, ReplaySchedule, TraceError, TraceLine, TracePlan, TraceTurn, load_trace
from bus_schemas.eventlog import load_events
from runners import trace as trace_cli
from runners.simulate import run as simulate
from tests.conftest import REPO, write_tiny_config

DOCS = REPO / "docs" / "workloads.md"

REPLAY_CONFIG = """
[run]
name = "replay"
seed = 9
policy = "{policy}"
mode = "{mode}"
time_scale = {time_scale}

[engines]
count = 2
prefill_engines = 1
backend = "{backend}"

[environments]
count = 1

[trainer]
steps = {steps}
tasks_per_step = {tasks}
samples_per_task = {samples}
train_s = 1.0

[workload]
mix = {{ math = 1.0 }}
trace = "{trace}"
"""


def replay_config(path: Path, trace: Path | str, steps: int = 1, tasks: int = 2, samples: int = 2, **kw) -> Path:
    fields = dict(policy="static", mode="sync", backend="emulated", time_scale=1.0) | kw
    path.write_text(REPLAY_CONFIG.format(trace=trace, steps=steps, tasks=tasks, samples=samples, **fields))
    return path


def line(family="calc", turns=((13, 24, 0.5), (9, 7)), reward=0.25, **extra) -> dict:
    out = {"family": family, "turns": [dict(zip(("new_tokens", "output_tokens", "tool_latency_s"), t)) for t in turns], "reward": reward}
    return out | extra


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def docs_schema() -> dict:
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)\n```", DOCS.read_text(), re.S) if b.lstrip().startswith('{\n  "$schema"')]
    assert len(blocks) == 1, "docs/workloads.md should hold one JSON Schema block"
    return blocks[0]


# --- the format and its schema -------------------------------------------------------------


def test_the_schema_in_the_docs_is_the_loaders_and_the_cli_prints_it(capsys):
    assert docs_schema() == TRACE_SCHEMA, "docs/workloads.md's schema is stale: paste `python -m runners.trace --schema`"
    assert trace_cli.main(["--schema"]) == 0
    assert json.loads(capsys.readouterr().out) == TRACE_SCHEMA
    assert TRACE_SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_a_line_round_trips_and_leaves_out_what_it_does_not_have(tmp_path: Path):
    written = TraceLine(
        family="swe",
        turns=[TraceTurn(new_tokens=3000, output_tokens=600, tool_latency_s=0.1 + 0.2), TraceTurn(new_tokens=400, output_tokens=12)],
        reward=1.0,
    )
    path = tmp_path / "t.jsonl"
    trace_cli.write_trace([written], path)
    text = path.read_text()
    assert text == '{"family":"swe","turns":[{"new_tokens":3000,"output_tokens":600,"tool_latency_s":0.30000000000000004},' + (
        '{"new_tokens":400,"output_tokens":12}],"reward":1.0}\n'
    )
    (read,) = load_trace(path).lines
    assert read == written and read.turns[0].tool_latency_s == 0.1 + 0.2  # floats exactly


GOOD = [
    line(),
    line(turns=((5, 1),), reward=-1, id="x", step=3, group="g"),
    line(family="anything", turns=((1, 1, 0), (2, 2, 1e-9), (3, 3, 0)), reward=0),
]
# (line, what the loader's one-line error says); each breaks a rule the schema states too
BAD_FOR_BOTH = [
    ({"turns": [{"new_tokens": 1, "output_tokens": 1}], "reward": 0}, "missing required field `family`"),
    (line(family=""), "Expected `str` of length >= 1 - at `$.family`"),
    (line(turns=()), "Expected `array` of length >= 1 - at `$.turns`"),
    (line(turns=((0, 5),)), "Expected `int` >= 1 - at `$.turns[0].new_tokens`"),
    (line(turns=((4, 0),)), "Expected `int` >= 1 - at `$.turns[0].output_tokens`"),
    (line(turns=((4, 2, -1.0), (1, 1))), "Expected `float` >= 0.0 - at `$.turns[0].tool_latency_s`"),
    (line(turns=((4, 2.5),)), "Expected `int`, got `float` - at `$.turns[0].output_tokens`"),
    (line(reward="1"), "Expected `float`, got `str` - at `$.reward`"),
    (line(step=-1), "Expected `int` >= 0 - at `$.step`"),
    (line(step=None), "Expected `int`, got `null` - at `$.step`"),
    (line(tool=3), "Object contains unknown field `tool`"),
    ({**line(), "turns": [{"new_tokens": 1, "output_tokens": 1, "tool_s": 0}]}, "unknown field `tool_s` - at `$.turns[0]`"),
]


def test_the_loader_and_the_json_schema_agree_on_good_and_bad_lines(tmp_path: Path):
    import jsonschema  # the dev extra installs it

    validator = jsonschema.Draft202012Validator(docs_schema())
    jsonschema.Draft202012Validator.check_schema(docs_schema())
    for good in GOOD:
        validator.validate(good)
        load_trace(write_lines(tmp_path / "good.jsonl", [good]))
    for bad, message in BAD_FOR_BOTH:
        assert not validator.is_valid(bad), bad
        with pytest.raises(TraceError) as err:
            load_trace(write_lines(tmp_path / "bad.jsonl", [line(), bad]))
        assert f"trace {tmp_path / 'bad.jsonl'} line 2: " in str(err.value) and message in str(err.value)


@pytest.mark.parametrize(
    "lines, message",
    [
        (["{not json"], "line 1: JSON is malformed"),
        ([line(), "[1, 2]"], "line 2: Expected `object`, got `array`"),
        ([line(turns=((4, 2, 0.5),))], "line 1: the last turn (turns[0]) has tool_latency_s = 0.5; no tool call follows it"),
        ([line(turns=((4, 2, 0.5), (1, 1, 2.0)))], "line 1: the last turn (turns[1]) has tool_latency_s = 2.0"),
        (
            ['{"family": "calc", "turns": [{"new_tokens": 1, "output_tokens": 1}], "reward": 1e999}'],
            "line 1: Number out of range - at `$.reward`",
        ),
        ([line(step=0), line()], "line 2: lacks 'step', which line 1 has (step goes on every line or on none)"),
        ([line(), "", line(group="a")], "line 3: has 'group', which line 1 lacks"),
        ([], ": no trajectories (a trace holds one JSON object a line)"),
        (["", "  "], ": no trajectories"),
    ],
)
def test_a_malformed_trace_is_a_one_line_config_error_at_load(tmp_path: Path, lines, message):
    trace = write_lines(tmp_path / "t.jsonl", lines)
    with pytest.raises(ConfigError) as err:
        load_config(replay_config(tmp_path / "c.toml", trace))
    text = str(err.value)
    assert "\n" not in text and text.startswith(f"{tmp_path / 'c.toml'}: trace {trace}") and message in text, text


def test_a_missing_trace_and_a_real_backend_are_config_errors(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"c\.toml: trace .*nope\.jsonl: no such file$"):
        load_config(replay_config(tmp_path / "c.toml", tmp_path / "nope.jsonl"))
    trace = write_lines(tmp_path / "t.jsonl", [line()] * 2)
    with pytest.raises(ConfigError, match="workload.trace replays recorded trajectories on the emulated backend only"):
        load_config(replay_config(tmp_path / "c.toml", trace, backend="torch"))


def test_a_relative_trace_path_is_taken_from_the_working_directory(tmp_path: Path, monkeypatch):
    write_lines(tmp_path / "t.jsonl", [line()] * 4)
    monkeypatch.chdir(tmp_path)
    config = load_config(replay_config(tmp_path / "c.toml", "t.jsonl"))
    assert config.workload.trace == str(tmp_path / "t.jsonl")


# --- from lines to steps, tasks and samples ---------------------------------------------


def ids(schedule: ReplaySchedule, n: int) -> list[str]:
    return [schedule.line(i).id for i in range(n)]  # type: ignore[misc]


def schedule_of(tmp_path: Path, lines: list[dict], steps: int, tasks: int, samples: int) -> ReplaySchedule:
    trace = load_trace(write_lines(tmp_path / f"t{len(list(tmp_path.iterdir()))}.jsonl", lines))
    return ReplaySchedule.build(trace, steps, tasks, samples)


def test_lines_without_step_or_group_are_replayed_in_order(tmp_path: Path):
    s = schedule_of(tmp_path, [line(id=f"l{n}") for n in range(9)], steps=2, tasks=2, samples=2)
    assert ids(s, 8) == [f"l{n}" for n in range(8)]  # the ninth goes unused
    assert s.line(8).id == "l0" and s.line(11).id == "l3"  # a replacement group past the run's wraps


def test_groups_are_taken_in_order_of_first_appearance_and_need_not_be_adjacent(tmp_path: Path):
    lines = [line(id=f"{g}{n}", group=g) for n, g in enumerate("bababcc")]
    s = schedule_of(tmp_path, lines, steps=1, tasks=2, samples=2)
    assert ids(s, 4) == ["b0", "b2", "a1", "a3"]  # b's third line and group c go unused


def test_steps_are_taken_in_increasing_order_and_their_groups_in_file_order(tmp_path: Path):
    lines = [
        line(id="s7-x0", step=7, group="x"),
        line(id="s2-y0", step=2, group="y"),
        line(id="s2-z0", step=2, group="z"),
        line(id="s7-w0", step=7, group="w"),
        line(id="s2-y1", step=2, group="y"),
        line(id="s2-z1", step=2, group="z"),
        line(id="s7-x1", step=7, group="x"),
        line(id="s7-w1", step=7, group="w"),
        line(id="s9-v0", step=9, group="v"),
    ]
    s = schedule_of(tmp_path, lines, steps=2, tasks=2, samples=2)
    assert ids(s, 8) == ["s2-y0", "s2-y1", "s2-z0", "s2-z1", "s7-x0", "s7-x1", "s7-w0", "s7-w1"]


def test_steps_without_groups_are_cut_into_groups_in_order(tmp_path: Path):
    lines = [line(id=f"s{s}-{n}", step=s) for s in (1, 0) for n in range(5)]
    s = schedule_of(tmp_path, lines, steps=2, tasks=2, samples=2)
    assert ids(s, 8) == ["s0-0", "s0-1", "s0-2", "s0-3", "s1-0", "s1-1", "s1-2", "s1-3"]


@pytest.mark.parametrize(
    "lines, message",
    [
        ([line()] * 7, "trace {t} has 7 lines; trainer.steps x tasks_per_step x samples_per_task = 2 x 2 x 2 needs 8 (replayed in order)"),
        ([line(group=g) for g in "aabbcc"], "trace {t} has 3 groups; trainer.steps x tasks_per_step = 2 x 2 needs 4"),
        ([line(group=g) for g in "aabbccd"], "trace {t}: group 'd' has 1 line; trainer.samples_per_task = 2 needs 2"),
        ([line(step=5, group=g) for g in "aabb"], "trace {t} has 1 step (step values 5); trainer.steps = 2 needs 2"),
        (
            [line(step=int(s), group=g) for s, g in ["0a", "0a", "0b", "0b", "1a", "1a"]],
            "trace {t}: step 1 has 1 group; trainer.tasks_per_step = 2 needs 2",
        ),
        (
            [line(step=s) for s in [0] * 4 + [1] * 3],
            "trace {t}: step 1 has 3 lines; trainer.tasks_per_step x samples_per_task = 2 x 2 needs 4 (replayed in order)",
        ),
    ],
)
def test_a_trace_too_short_for_the_run_is_a_config_error_naming_what_is_short(tmp_path: Path, lines, message):
    trace = write_lines(tmp_path / "t.jsonl", lines)
    with pytest.raises(ConfigError) as err:
        load_config(replay_config(tmp_path / "c.toml", trace, steps=2))
    assert str(err.value) == f"{tmp_path / 'c.toml'}: " + message.format(t=trace)


def test_a_trace_plan_reads_every_value_from_its_line():
    plan = TracePlan(
        TraceLine(
            family="f",
            turns=[TraceTurn(new_tokens=7, output_tokens=3, tool_latency_s=0.25), TraceTurn(new_tokens=5, output_tokens=40)],
            reward=0.5,
        ),
        24,
    )
    assert (plan.family, plan.turns, plan.prompt_tokens, plan.reward()) == ("f", 2, 7, 0.5)
    assert [plan.gen_tokens(t) for t in (0, 1)] == [3, 40] and [plan.max_output_tokens(t) for t in (0, 1)] == [24, 40]
    assert (plan.tool_latency_s(0), plan.obs_tokens(0)) == (0.25, 5)
    assert plan.context_cap_tokens >= 2**62  # never cut short


# --- recording and replaying -----------------------------------------------------------------


def turn_table(run: Path) -> dict[tuple[str, int], tuple[int, int, float]]:
    """Per (trajectory, turn) of a run's finished trajectories, read independently of
    runners.trace: the new tokens the environment submitted (prefill_queued), the tokens the
    engine generated (decode_done) and the tool call's seconds after it (tool_done; 0 after the last)."""
    events = load_events(run / "events.parquet")
    finished = set(events.filter(pl.col("kind") == "finished")["trajectory_id"])
    rows = events.filter(pl.col("trajectory_id").is_in(list(finished)))

    def last(kind: str, column: str) -> dict:
        return {(r["trajectory_id"], r["turn"]): r[column] for r in rows.filter(pl.col("kind") == kind).iter_rows(named=True)}

    new, out, tool = last("prefill_queued", "new_tokens"), last("decode_done", "generated_tokens"), last("tool_done", "duration_s")
    assert set(out) == set(new) and set(tool) < set(new)
    return {key: (new[key], out[key], tool.get(key, 0.0)) for key in sorted(new)}


def rewards(run: Path) -> dict[str, float]:
    events = load_events(run / "events.parquet").filter(pl.col("kind") == "finished")
    return dict(zip(events["trajectory_id"], events["reward"]))


def totals(table: dict) -> tuple[int, int, int, float]:
    """Turns, new tokens, output tokens and tool seconds of a run."""
    values = list(table.values())
    return len(values), sum(v[0] for v in values), sum(v[1] for v in values), math.fsum(v[2] for v in values)


def record(run: Path, out: Path) -> Path:
    proc = subprocess.run(
        [sys.executable, "-m", "runners.trace", str(run), "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.startswith("wrote "), proc.stdout + proc.stderr
    return out


def replay(tmp_path: Path, trace: Path, name: str = "replay", **shape) -> Path:
    config = load_config(replay_config(tmp_path / f"{name}.toml", trace, **shape))
    out = tmp_path / name
    summary = simulate(config, out, show_progress=False)
    assert summary["status"] == "completed" and summary["trajectories_finished"] == summary["trajectories_expected"]
    return out


def assert_round_trip(original: Path, trace: Path, replayed: Path) -> None:
    before, after = turn_table(original), turn_table(replayed)
    assert totals(after) == totals(before)
    assert after == before  # every turn of every trajectory, in the same step, task and sample
    assert rewards(replayed) == rewards(original)
    again = record(replayed, replayed / "trace.jsonl")
    assert again.read_bytes() == trace.read_bytes()  # the replay's own trace is the same file


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_emulated_run_replays_from_its_trace_exactly(tmp_path: Path, mode: str):
    """Sampled families (swe and math, truncated by the overrides) recorded, then replayed with the
    families' mix gone: same turns, tokens, tool seconds and rewards. Async: groups only."""
    path = write_tiny_config(tmp_path / "sampled.toml", policy="static", steps=2)
    path.write_text(path.read_text().replace("[run]\n", f'[run]\nmode = "{mode}"\n'))
    original = tmp_path / "sampled"
    assert simulate(load_config(path), original, show_progress=False)["status"] == "completed"
    trace = record(original, tmp_path / "sampled.jsonl")
    lines = load_trace(trace).lines
    assert len(lines) == 8 and {ln.family for ln in lines} <= {"swe", "math"}
    assert all((ln.step is not msgspec.UNSET) == (mode == "sync") and ln.group is not msgspec.UNSET for ln in lines)
    replayed = replay(tmp_path, trace, steps=2, tasks=2, samples=2, policy="static", mode=mode)
    assert_round_trip(original, trace, replayed)
    # each replayed trajectory carries its line's family, not the replay config's mix (math only)
    assert families(replayed) == families(original) and set(families(original).values()) == {"swe", "math"}


def families(run: Path) -> dict[str, str]:
    events = load_events(run / "events.parquet").filter(pl.col("kind") == "finished")
    return dict(zip(events["trajectory_id"], events["task_family"]))


def test_recording_a_folder_without_a_log_is_a_one_line_error(tmp_path: Path, capsys):
    assert trace_cli.main([str(tmp_path), "--out", str(tmp_path / "t.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {tmp_path / 'events.parquet'}: no such event log\n" and not (tmp_path / "t.jsonl").exists()


@pytest.mark.e2e
def test_a_torch_runs_trace_replays_in_the_emulated_engines_exactly(tmp_path: Path):
    """The done-when: a real torch run (two GRPO steps of the calc task, generations cut by EOS
    where the model writes one), recorded with runners.trace and replayed in virtual time under
    the emulated engines, reproduces its turn count, token totals and tool seconds exactly,
    turn by turn. The emulated engine stops at the recorded output length; the tool sleeps
    the recorded seconds."""
    pytest.importorskip("torch", reason="the torch backend is the optional [torch] extra; the dev extra CI installs includes it")
    from tests.torch_helpers import write_torch_config

    config = write_torch_config(tmp_path / "torch.toml", steps=2, stop_at_eos=True)
    original = tmp_path / "torch"
    proc = subprocess.run(
        [sys.executable, "-m", "ops.launch", str(config), "--out", str(original)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trace = record(original, tmp_path / "torch.jsonl")
    lines = load_trace(trace).lines
    assert len(lines) == 16 and {(ln.family, len(ln.turns)) for ln in lines} == {("calc", 2)}
    assert [ln.step for ln in lines] == [0] * 8 + [1] * 8 and lines[4].group == "s0-k1"
    assert all(0 < ln.turns[0].tool_latency_s < 1 for ln in lines)  # the real calculator's measured seconds

    replayed = replay(tmp_path, trace, steps=2, tasks=2, samples=4)
    assert_round_trip(original, trace, replayed)
    turns, new, out, tool_s = totals(turn_table(replayed))
    assert turns == 32 and new > 0 and out > 0 and tool_s > 0

    # launched too: every actor its own process on a nats-server, each reading the trace the config names
    launched = tmp_path / "launched"
    config = replay_config(tmp_path / "launched.toml", trace, steps=2, tasks=2, samples=4, time_scale=10.0)
    proc = subprocess.run(
        [sys.executable, "-m", "ops.launch", str(config), "--out", str(launched)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_round_trip(original, trace, launched)

    import jsonschema  # the dev extra installs it

    validator = jsonschema.Draft202012Validator(docs_schema())
    for text in trace.read_text().splitlines():
        validator.validate(json.loads(text))
