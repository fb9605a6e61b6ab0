"""The live view of the rollout the lifecycle model needs: where every trajectory is, since
when, and the per-family distributions learned from what has already happened.

Each live trajectory is in one phase of its turn cycle:

    PRE  prefill_queued (or started, reprefill) → decode_started   queue, prefill, KV hand-off
    DEC  decode_started → decode_done                              decoding the action
    TOOL decode_done → tool_done                                   the tool call (then PRE again)

Every completed phase adds its duration to the family's distribution; tool_done adds the
tool latency and the observation length, decode_done the generation length, finished the
number of turns. Trajectories are kept in flat numpy arrays (one slot each), so the model
reads 10k of them without a Python loop.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import polars as pl

from forecasting.empirical import Empirical, TurnHazard

PRE, DEC, TOOL = 0, 1, 2
PHASES = ("pre", "dec", "tool")
POOLED = "*"  # statistics over every family (used for trajectories not yet assigned)


@dataclass(slots=True)
class FamilyStats:
    stage_s: tuple[Empirical, Empirical, Empirical] = field(default_factory=lambda: (Empirical(500), Empirical(), Empirical()))
    obs_tokens: Empirical = field(default_factory=Empirical)
    gen_tokens: Empirical = field(default_factory=Empirical)
    miss_tokens: Empirical = field(default_factory=Empirical)  # prefill compute of turns > 0
    prompt_miss_tokens: Empirical = field(default_factory=Empirical)  # prefill compute of turn 0
    prompt_tokens: Empirical = field(default_factory=Empirical)
    turns: TurnHazard = field(default_factory=TurnHazard)


_COLUMNS = ("kind", "at_s", "trajectory_id", "turn", "task_family", "new_tokens", "context_tokens",
            "cached_prefix_tokens", "generated_tokens", "duration_s", "step")  # fmt: skip


class LiveState:
    def __init__(self, capacity: int = 1024) -> None:
        self.families: list[str] = []
        self._family_index: dict[str, int] = {}
        self.stats: dict[str, FamilyStats] = {POOLED: FamilyStats()}
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self.family = np.zeros(capacity, np.int32)
        self.phase = np.zeros(capacity, np.int8)
        self.entered_s = np.zeros(capacity)
        self.turn = np.zeros(capacity, np.int32)
        self.prefilled = np.zeros(capacity, bool)  # PRE only: prefill_done seen for this turn
        self.alive = np.zeros(capacity, bool)
        self.step_pending_since_s: float | None = None  # rollout_done seen, next step not started
        self.step_gap_s = Empirical(50)  # rollout_done → next step_started
        self.started_per_step: Counter[int] = Counter()
        self.last_step = -1
        self.events = 0

    # --- reading ---------------------------------------------------------------------------
    def live_count(self) -> int:
        return len(self._slot)

    def family_stats(self, family_index: int) -> FamilyStats:
        return self.stats[self.families[family_index]]

    def last_step_size(self) -> int:
        return self.started_per_step.get(self.last_step, 0)

    # --- ingesting -------------------------------------------------------------------------
    def ingest(self, events: pl.DataFrame) -> None:
        """Apply events in the frame's order (the caller sorts by (at_s, event_id))."""
        for row in events.select(_COLUMNS).iter_rows():
            self._apply(*row)
        self.events += events.height

    def _apply(self, kind, at_s, traj, turn, family, new, context, cached, generated, duration_s, step) -> None:
        if not traj:
            self._fleet_event(kind, at_s, step)
            return
        if kind == "finished":
            self._finish(traj, family, turn)
            return
        slot = self._slot.get(traj)
        if slot is None:
            slot = self._open(traj, family, at_s, turn)
            if kind == "started":
                self.started_per_step[step] += 1
                self.last_step = max(self.last_step, step)
                self._learn(family, "prompt_tokens", new)
        handler = _HANDLERS.get(kind)
        if handler is not None:
            handler(self, slot, family, at_s, turn, new, context, cached, generated, duration_s)

    def _fleet_event(self, kind: str, at_s: float, step: int) -> None:
        if kind == "rollout_done":
            self.step_pending_since_s = at_s
        elif kind == "step_started" and self.step_pending_since_s is not None:
            self.step_gap_s.add(max(0.0, at_s - self.step_pending_since_s))
            self.step_pending_since_s = None

    def _open(self, traj: str, family: str, at_s: float, turn: int) -> int:
        if family not in self._family_index:
            self._family_index[family] = len(self.families)
            self.families.append(family)
            self.stats[family] = FamilyStats()
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._slot[traj] = slot
        self.family[slot] = self._family_index[family]
        self.phase[slot], self.entered_s[slot], self.turn[slot] = PRE, at_s, max(turn, 0)
        self.prefilled[slot], self.alive[slot] = False, True
        return slot

    def _grow(self) -> None:
        old = len(self.alive)
        new = max(1024, 2 * old)
        for name in ("family", "phase", "entered_s", "turn", "prefilled", "alive"):
            array = getattr(self, name)
            grown = np.zeros(new, array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        self._free.extend(range(new - 1, old - 1, -1))

    def _finish(self, traj: str, family: str, turn: int) -> None:
        self._learn_turns(family, turn)
        slot = self._slot.pop(traj, None)
        if slot is not None:
            self.alive[slot] = False
            self._free.append(slot)

    def _learn(self, family: str, what: str, value: float) -> None:
        for key in (family, POOLED):
            if key in self.stats:
                getattr(self.stats[key], what).add(value)

    def _learn_stage(self, family: str, phase: int, duration_s: float) -> None:
        for key in (family, POOLED):
            if key in self.stats:
                self.stats[key].stage_s[phase].add(max(duration_s, 0.0))

    def _learn_turns(self, family: str, last_turn: int) -> None:
        for key in (family, POOLED):
            if key in self.stats:
                self.stats[key].turns.add_finished(last_turn)

    def _enter(self, slot: int, phase: int, at_s: float) -> None:
        self.phase[slot], self.entered_s[slot] = phase, at_s


def _on_prefill_queued(s: LiveState, slot, family, at_s, turn, *_):
    s._enter(slot, PRE, at_s)
    s.turn[slot], s.prefilled[slot] = max(turn, 0), False


def _on_reprefill(s: LiveState, slot, family, at_s, turn, *_):
    s.phase[slot], s.prefilled[slot] = PRE, False  # the turn's queue time goes on


def _on_prefill_done(s: LiveState, slot, family, at_s, turn, new, context, cached, *_):
    s.prefilled[slot] = True
    s._learn(family, "prompt_miss_tokens" if turn == 0 else "miss_tokens", context - cached + new)


def _on_decode_started(s: LiveState, slot, family, at_s, *_):
    if s.phase[slot] == PRE:
        s._learn_stage(family, PRE, at_s - s.entered_s[slot])
    s._enter(slot, DEC, at_s)


def _on_decode_done(s: LiveState, slot, family, at_s, turn, new, context, cached, generated, *_):
    if s.phase[slot] == DEC:
        s._learn_stage(family, DEC, at_s - s.entered_s[slot])
    s._learn(family, "gen_tokens", generated)
    s._enter(slot, TOOL, at_s)


def _on_tool_done(s: LiveState, slot, family, at_s, turn, new, context, cached, generated, duration_s):
    if s.phase[slot] == TOOL:
        s._learn_stage(family, TOOL, at_s - s.entered_s[slot])
    s._learn(family, "obs_tokens", new)
    s._enter(slot, PRE, at_s)
    s.turn[slot], s.prefilled[slot] = turn + 1, False


_HANDLERS = {
    "prefill_queued": _on_prefill_queued,
    "reprefill": _on_reprefill,
    "prefill_done": _on_prefill_done,
    "decode_started": _on_decode_started,
    "decode_done": _on_decode_done,
    "tool_done": _on_tool_done,
}
