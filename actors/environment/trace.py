"""Recorded traces as workloads (pure; no bus, no clock): the JSONL format, its loader and
checks, and the mapping of a trace's lines onto a run's steps, tasks and samples.

A trace holds one recorded trajectory a line (`TraceLine`): its task family, per turn the
tokens the turn appends, the tokens the policy generated and the seconds of the tool call
that follows, and its reward. With ``workload.trace`` set, the environments replay these
trajectories (`TracePlan`) instead of sampling them from the family profiles. The format,
its JSON Schema (`TRACE_SCHEMA`) and the mapping: docs/workloads.md, "Recorded traces".
`runners.trace` writes a trace from a run's lifecycle log.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, UnsetType

from actors.environment.workloads import PROFILES

JSON_SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


class TraceError(ValueError):
    """A trace that cannot be replayed; the one-line message names the file, the line and what is wrong."""


class TraceTurn(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """One turn of a recorded trajectory."""

    new_tokens: Annotated[
        int, Meta(ge=1, description="tokens the turn appends to the context: the prompt on turn 0, else the last tool call's observation")
    ]
    output_tokens: Annotated[int, Meta(ge=1, description="tokens the policy generated in the turn")]
    tool_latency_s: Annotated[
        float, Meta(ge=0, description="seconds of the tool call that follows the turn; 0 (or absent) on the last turn, which has none")
    ] = 0.0


class TraceLine(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    """One recorded trajectory: one line of a trace."""

    family: Annotated[str, Meta(min_length=1, description="the task family; labels the replayed trajectory's events")]
    turns: Annotated[list[TraceTurn], Meta(min_length=1, description="the turns, in order")]
    reward: Annotated[float, Meta(description="the trajectory's reward")]
    id: Annotated[str, Meta(min_length=1, description="where the trajectory came from (the recorded run's trajectory id); not used")] | (
        UnsetType
    ) = UNSET
    step: Annotated[int, Meta(ge=0, description="the RL step it belongs to; on every line or on none")] | UnsetType = UNSET
    group: Annotated[str, Meta(min_length=1, description="its GRPO group (task), within its step; on every line or on none")] | (
        UnsetType
    ) = UNSET


TRACE_SCHEMA: dict = {"$schema": JSON_SCHEMA_DIALECT, **msgspec.json.schema(TraceLine)}
"""The JSON Schema (draft 2020-12) of one trace line, as docs/workloads.md prints it."""


@dataclass(frozen=True, slots=True)
class Trace:
    path: str
    lines: tuple[TraceLine, ...]
    line_numbers: tuple[int, ...]  # each line's number in the file (1-based; blank lines are skipped)

    @property
    def has_steps(self) -> bool:
        return bool(self.lines) and self.lines[0].step is not UNSET

    @property
    def has_groups(self) -> bool:
        return bool(self.lines) and self.lines[0].group is not UNSET


_DECODER = msgspec.json.Decoder(TraceLine)
_CACHE: dict[tuple[str, int, int], Trace] = {}


def load_trace(path: str | Path) -> Trace:
    """Read and check a trace (every line, and `step` / `group` on every line or on none);
    raise TraceError naming the file and line. Cached by (path, mtime, size)."""
    path = Path(path)
    try:
        stat = path.stat()
        key = (str(path.resolve()), stat.st_mtime_ns, stat.st_size)
        if key in _CACHE:
            return _CACHE[key]
        data = path.read_bytes()
    except FileNotFoundError:
        raise TraceError(f"trace {path}: no such file") from None
    except OSError as err:
        raise TraceError(f"trace {path}: cannot read it: {err.strerror or err}") from None
    lines: list[TraceLine] = []
    numbers: list[int] = []
    for number, raw in enumerate(data.split(b"\n"), 1):
        if not raw.strip():
            continue
        try:
            line = _DECODER.decode(raw)
        except msgspec.DecodeError as err:
            raise TraceError(f"trace {path} line {number}: {_one_line(err)}") from None
        _check_line(line, f"trace {path} line {number}")
        for field in ("step", "group") if lines else ():
            here, first = getattr(line, field) is not UNSET, getattr(lines[0], field) is not UNSET
            if here != first:
                raise TraceError(
                    f"trace {path} line {number}: {'has' if here else 'lacks'} {field!r}, which line {numbers[0]} "
                    f"{'lacks' if here else 'has'} ({field} goes on every line or on none)"
                )
        lines.append(line)
        numbers.append(number)
    if not lines:
        raise TraceError(f"trace {path}: no trajectories (a trace holds one JSON object a line)")
    trace = Trace(str(path), tuple(lines), tuple(numbers))
    _CACHE[key] = trace
    return trace


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


def _check_line(line: TraceLine, where: str) -> None:
    """What the schema cannot say: no tool call after the last turn. (JSON has no infinities:
    the decoder refuses a number out of a float's range.)"""
    if line.turns[-1].tool_latency_s != 0:
        raise TraceError(
            f"{where}: the last turn (turns[{len(line.turns) - 1}]) has tool_latency_s = {line.turns[-1].tool_latency_s}; "
            f"no tool call follows it (0 or absent)"
        )


def trace_line_text(line: TraceLine) -> str:
    """One line of a trace file (no newline)."""
    return msgspec.json.encode(line).decode()


@dataclass(frozen=True, slots=True)
class ReplaySchedule:
    """The trace line each trajectory of a run replays, from the run's data schedule: the
    trainer's group i (task k of step s: i = s x tasks_per_step + k) and its sample g.

    * `step` and `group` on the lines: step s replays the trace's s-th step (its step values in
      increasing order), task k that step's k-th group (in order of first appearance in the
      file), sample g the group's g-th line;
    * `group` only: group i replays the trace's i-th group, sample g its g-th line;
    * `step` only: step s replays the trace's s-th step, task k sample g its (k x G + g)-th line;
    * neither: the run's n-th trajectory (n = i x G + g) replays the n-th line.

    Lines, groups and steps past what the run needs go unused; fewer is a TraceError. A group
    index past steps x tasks_per_step (async, stale_policy "drop", assigns one for each
    dropped group) wraps around to group i mod (steps x tasks_per_step)."""

    trace: Trace
    samples_per_task: int
    groups: tuple[tuple[int, ...], ...]  # per trainer group: the indexes of its G lines

    @classmethod
    def build(cls, trace: Trace, steps: int, tasks_per_step: int, samples_per_task: int) -> ReplaySchedule:
        B, G = tasks_per_step, samples_per_task
        where = f"trace {trace.path}"
        if trace.has_steps:
            by_step: dict[int, list[int]] = {}
            for n, line in enumerate(trace.lines):
                by_step.setdefault(line.step, []).append(n)  # type: ignore[arg-type]
            values = sorted(by_step)
            if len(values) < steps:
                raise TraceError(
                    f"{where} has {_count(len(values), 'step')} (step values {_listed(values)}); trainer.steps = {steps} needs {steps}"
                )
            # (name, its lines, groups it must give, the settings behind that number)
            units = [(f"step {v}", by_step[v], B, ("tasks_per_step", B)) for v in values[:steps]]
        else:
            units = [("", list(range(len(trace.lines))), steps * B, ("steps x tasks_per_step", steps, B))]
        groups: list[tuple[int, ...]] = []
        for name, members, need, (names, *counts) in units:
            why = f"trainer.{names} = {' x '.join(map(str, counts))}"
            subject = f"{where}: {name}" if name else where
            if trace.has_groups:
                by_group: dict[str, list[int]] = {}
                for n in members:
                    by_group.setdefault(trace.lines[n].group, []).append(n)  # type: ignore[arg-type]
                if len(by_group) < need:
                    raise TraceError(f"{subject} has {_count(len(by_group), 'group')}; {why} needs {need}")
                for group, lines in list(by_group.items())[:need]:
                    if len(lines) < G:
                        of = f" of {name}" if trace.has_steps else ""
                        raise TraceError(
                            f"{where}: group {group!r}{of} has {_count(len(lines), 'line')}; trainer.samples_per_task = {G} needs {G}"
                        )
                    groups.append(tuple(lines[:G]))
            else:
                if len(members) < need * G:
                    raise TraceError(
                        f"{subject} has {_count(len(members), 'line')}; trainer.{names} x samples_per_task = "
                        f"{' x '.join(map(str, [*counts, G]))} needs {need * G} (replayed in order)"
                    )
                groups += [tuple(members[j * G : (j + 1) * G]) for j in range(need)]
        return cls(trace, G, tuple(groups))

    @classmethod
    def of(cls, config) -> ReplaySchedule:
        """The schedule of a config with `workload.trace` set (its trainer section gives the shape)."""
        tc = config.trainer
        return cls.build(load_trace(config.workload.trace), tc.steps, tc.tasks_per_step, tc.samples_per_task)

    def line(self, index: int) -> TraceLine:
        """The line the run's `index`-th trajectory replays (index = group x samples_per_task + sample:
        the TaskAssignment's seed in both the sync and the async trainer)."""
        if index < 0:
            raise IndexError(f"trajectory index {index} < 0")
        group, sample = divmod(index, self.samples_per_task)
        return self.trace.lines[self.groups[group % len(self.groups)][sample]]

    def plan(self, index: int) -> TracePlan:
        line = self.line(index)
        profile = PROFILES.get(line.family)
        cap = profile.gen_tokens.hi if profile is not None else 0  # type: ignore[attr-defined]
        return TracePlan(line, int(cap) if math.isfinite(cap) else 0)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _listed(values: list[int], most: int = 6) -> str:
    shown = ", ".join(str(v) for v in values[:most])
    return shown + (", ..." if len(values) > most else "")


@dataclass(slots=True)
class TracePlan:
    """A recorded trajectory as the environment's plan: the same interface as the sampled
    `workloads.TrajectoryPlan`, each value read from the trace instead of drawn. `turn` is the
    turn a value is for (a tool call and its observation: the turn the call follows)."""

    line: TraceLine
    output_cap: int = 0  # the family profile's generation cap, where the family has a profile

    @property
    def family(self) -> str:
        return self.line.family

    @property
    def turns(self) -> int:
        return len(self.line.turns)

    @property
    def prompt_tokens(self) -> int:
        return self.line.turns[0].new_tokens

    @property
    def context_cap_tokens(self) -> int:
        return sys.maxsize  # the trace's turns are what the recorded run did: nothing cuts them short

    def max_output_tokens(self, turn: int = 0) -> int:
        return max(self.output_cap, self.line.turns[turn].output_tokens)

    def gen_tokens(self, turn: int = 0) -> int:
        return self.line.turns[turn].output_tokens

    def obs_tokens(self, turn: int = 0) -> int:
        return self.line.turns[turn + 1].new_tokens

    def tool_latency_s(self, turn: int = 0) -> float:
        return self.line.turns[turn].tool_latency_s

    def reward(self) -> float:
        return self.line.reward


def write_trace(lines: list[TraceLine], path: str | Path) -> None:
    """Write `lines` as a trace file, atomically (a reader never sees half of it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(trace_line_text(line) + "\n" for line in lines))
    os.replace(tmp, path)
