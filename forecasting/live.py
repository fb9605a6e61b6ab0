"""The live view of the rollout the lifecycle model needs: where every trajectory is, since
when, and the per-family distributions learned from what has already happened.

Each live trajectory is in one phase of its turn cycle:

    PRE  prefill_queued (or started, reprefill) → decode_started   queue, prefill, KV hand-off
    DEC  decode_started → decode_done                              decoding the action
    TOOL decode_done → tool_done                                   the tool call (then PRE again)

Every completed phase adds its duration to the family's distribution (a turn-0 PRE, the
prompt's queue under a step's start burst, to its own); tool_done adds the tool latency and
the observation length, decode_done the generation length, finished the number of turns,
prefill_done the time since the turn was queued with what it computed (`prefill_delays`).
Fleet events give the RL cadence, in either mode (`mode`, read from the events alone):

    sync   rollout_done → step_started (the trainer's gap), step_started → each start (the
           environments' launch spread); a step starts as many as the one before, and none
           follows the rollout_done the trainer marks as the run's last (FINAL_STEP)
    async  no steps (docs/async.md): batch_ready → the next batch_ready (the batches' gap),
           batch_ready → each start of the cycle it opens (the wave the freed room admits:
           at once under drop/partial, after the training time under hold, where the
           published version opens the gate); a cycle starts what a batch consumes

A log is async once it shows a batch_ready or a weight update mid-rollout
(policy_update_started), or a trajectory starts before any step_started; a step_started
makes it sync. `cadence(now_s)` gives the lifecycle model the same view of both.

Trajectories are kept in flat numpy arrays (one slot each), so the model reads 10k of them
without a Python loop, and `ingest` applies a tick's events a chunk at a time: the phase a
trajectory was in before each event is a forward fill over its earlier events in the chunk
(starting from its slot), so no Python code runs per event.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from itertools import repeat

import numpy as np
import polars as pl

from bus_schemas.lifecycle import FINAL_STEP
from forecasting.empirical import Empirical, SizedDelays, TurnHazard
from forecasting.series import UNIT_COST, TokenCost, kind_codes, of_fleet

PRE, DEC, TOOL = 0, 1, 2
PHASES = ("pre", "dec", "tool")
POOLED = "*"  # statistics over every family (used for trajectories not yet assigned)
MISS_COLUMN, ENGINE_COLUMN = 0, 1  # a prefill delay's sizes (FamilyStats.prefill_delays)

# Event kinds the trajectory state machine reads, as small integer codes.
_KINDS = ("started", "prefill_queued", "reprefill", "prefill_done", "decode_started", "decode_done", "tool_done", "finished")
STARTED, QUEUED, REPREFILL, PREFILLED, DEC_STARTED, DEC_DONE, TOOL_DONE, FINISHED = range(len(_KINDS))
# phase an event moves its trajectory into (-1: none), and whether it restarts the phase clock
_SETS_PHASE = np.array([-1, PRE, PRE, -1, DEC, TOOL, PRE, -1], np.int8)
_SETS_CLOCK = np.array([0, 1, 0, 0, 1, 1, 1, 0], bool)
_ENDS = {DEC_STARTED: PRE, DEC_DONE: DEC, TOOL_DONE: TOOL}  # the phase whose duration it completes


@dataclass(slots=True)
class FamilyStats:
    stage_s: tuple[Empirical, Empirical, Empirical] = field(default_factory=lambda: (Empirical(500), Empirical(), Empirical()))
    prompt_pre_s: Empirical = field(default_factory=lambda: Empirical(500))  # PRE of turn 0 (start bursts queue)
    append_pre_s: Empirical = field(default_factory=lambda: Empirical(500))  # PRE of turns > 0
    obs_tokens: Empirical = field(default_factory=Empirical)
    gen_tokens: Empirical = field(default_factory=Empirical)
    decode_engine_s: Empirical = field(default_factory=Empirical)  # a decode's engine-seconds (decode TokenCost)
    miss_tokens: Empirical = field(default_factory=Empirical)  # prefill compute of turns > 0
    prompt_miss_tokens: Empirical = field(default_factory=Empirical)  # prefill compute of turn 0
    engine_s: Empirical = field(default_factory=Empirical)  # prefill engine-seconds of turns > 0 (series.TokenCost)
    cached_share: Empirical = field(default_factory=Empirical)  # turns > 0: cached prefix / context at prefill
    prompt_engine_s: Empirical = field(default_factory=Empirical)  # ... of turn 0
    prompt_tokens: Empirical = field(default_factory=Empirical)
    turns: TurnHazard = field(default_factory=TurnHazard)
    # prefill_queued → prefill_done, with the computed tokens and engine-seconds (columns
    # MISS_COLUMN, ENGINE_COLUMN)
    prefill_delays: SizedDelays = field(default_factory=lambda: SizedDelays(2))  # turns > 0
    prompt_delays: SizedDelays = field(default_factory=lambda: SizedDelays(2))  # turn 0


def stat(stats: FamilyStats, pooled: FamilyStats, name: str):
    """The family's learned statistic `name`, the pooled one where it has no sample yet."""
    own = getattr(stats, name)
    return own if own.n else getattr(pooled, name)


def stage_durations(stats: FamilyStats, pooled: FamilyStats) -> list[Empirical]:
    """The family's PRE, DEC and TOOL durations, pooled ones where it has none yet."""
    return [own if own.n else all_ for own, all_ in zip(stats.stage_s, pooled.stage_s)]


@dataclass(frozen=True, slots=True)
class Cadence:
    """Trajectories still to start, as cycles (sync: RL steps; async: batch cycles): the
    running cycle's pending starts, spread by `offsets` from its anchor, and the next
    cycles', each `gap` after the one before, the first pending for `next_waited_s`."""

    pending: float  # starts of the running cycle still to come, if they come
    pending_chance: float  # the probability that they do
    pending_mix: dict[int, float]  # their families' shares (family index -> share)
    since_anchor_s: float  # time since the running cycle's anchor (step_started / batch_ready)
    offsets: Empirical  # anchor → a start of its cycle
    next_size: float  # starts of a coming cycle, if it brings any (0: none)
    next_chance: float  # the probability that it does
    next_mix: dict[int, float]
    next_waited_s: float | None  # how long the next anchor has been pending (None: not pending)
    gap: Empirical  # pending since → the next anchor
    # async: a cycle's starts come at once (one block), and cycles follow one another without
    # a pause (the one after next too); sync: starts are launched one by one, steps one at a time
    waves: bool


_BATCH_SIZE = re.compile(r"staleness \[([\d, ]*)\]")  # batch_ready's detail: the staleness histogram


def batch_trajectories(detail: str) -> int | None:
    """Trajectories in a batch, from batch_ready's detail (its staleness histogram)."""
    found = _BATCH_SIZE.search(detail or "")
    return sum(int(x) for x in found[1].split(",") if x.strip()) if found else None


_NUMERIC = ("at_s", "turn", "new_tokens", "context_tokens", "cached_prefix_tokens", "generated_tokens", "step")


def _up_to_finish(slot: np.ndarray, code: np.ndarray) -> np.ndarray:
    """Events of live trajectories (slot >= 0) up to their first `finished` in the chunk."""
    keep = slot >= 0
    done = np.flatnonzero((code == FINISHED) & keep)
    if len(done):
        first_done = np.full(int(slot.max()) + 1, len(slot))
        np.minimum.at(first_done, slot[done], done)
        keep &= np.arange(len(slot)) <= first_done[np.maximum(slot, 0)]
    return keep


class LiveState:
    def __init__(self, capacity: int = 1024, cost: TokenCost = UNIT_COST, decode_cost: TokenCost = UNIT_COST) -> None:
        self.cost = cost  # a prefill's (prefill_engine_s)
        self.decode_cost = decode_cost  # a decode's (decode_engine_s)
        self.families: list[str] = []
        self._family_index: dict[str, int] = {}
        self.stats: dict[str, FamilyStats] = {POOLED: FamilyStats()}
        self._slot: dict[str, int] = {}
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._finished: set[str] = set()  # later events of these are strays: ignored
        self.family = np.zeros(capacity, np.int32)
        self.phase = np.zeros(capacity, np.int8)
        self.entered_s = np.zeros(capacity)
        self.turn = np.zeros(capacity, np.int32)
        self.prefilled = np.zeros(capacity, bool)  # prefill_done seen for this turn (reset by a re-prefill)
        self.alive = np.zeros(capacity, bool)
        self.context = np.zeros(capacity)  # tokens before the next prefill's new ones (after a decode: all of the turn's)
        self.queued_new = np.zeros(capacity)  # PRE: the new tokens queued for this turn's prefill
        self.step_pending_since_s: float | None = None  # rollout_done seen, next step not started
        self.final_step_done = False  # the run's last step's rollout_done seen: no step follows
        self.step_gap_s = Empirical(50, tail_weight=0.05)  # rollout_done → next step_started
        self.step_started_s: float | None = None  # the running step's step_started
        self.step = -1  # the running step (from step_started)
        self._step_started_at_s: dict[int, float] = {}
        self.start_offset_s = Empirical(1000)  # step_started → a trajectory of that step started
        self.started_per_step: Counter[int] = Counter()
        self.started_per_step_family: Counter[tuple[int, int]] = Counter()  # (step, family index)
        self.last_step = -1
        self.mode = "sync"  # "async" once the events show it (module docstring)
        self.batch_ready_s: list[float] = []  # async: every batch_ready so far; cycle k starts at the k-th
        self.batch_gap_s = Empirical(50)  # async: batch_ready → the next batch_ready
        self.wave_offset_s = Empirical(1000)  # async: batch_ready → a start of the cycle it opened
        self.last_batch_size: int | None = None  # async: trajectories in the last batch (its detail)
        self.started_per_cycle: Counter[int] = Counter()  # async: starts per cycle (0: before any batch)
        self.started_per_cycle_family: Counter[tuple[int, int]] = Counter()
        self.first_start_s: float | None = None
        self.events = 0

    # --- reading ---------------------------------------------------------------------------
    def live_count(self) -> int:
        return len(self._slot)

    def live_context_tokens(self) -> int:
        """KV tokens the live trajectories hold: each one's context before the turn it is in,
        plus that turn's new tokens once prefilled (decoding, or waiting to), and a turn in a
        tool call all of it. What the fleet must hold to keep every live trajectory's prefix, a
        lower bound (the tokens a turn has generated so far are not in it); a turn sent to
        prefill again (its KV lost) counts its context alone."""
        holds_new = self.alive & self.prefilled & (self.phase != TOOL)  # prefilled: this turn's prefill_done seen
        return int(self.context[self.alive].sum() + self.queued_new[holds_new].sum())

    def family_stats(self, family_index: int) -> FamilyStats:
        return self.stats[self.families[family_index]]

    def last_step_size(self) -> int:
        return self.started_per_step.get(self.last_step, 0)

    def step_mix(self, step: int) -> dict[int, float]:
        """Share of each family (by index) among the trajectories that step started."""
        counts = {f: n for (k, f), n in self.started_per_step_family.items() if k == step}
        total = sum(counts.values())
        return {f: n / total for f, n in sorted(counts.items())} if total else {}

    def cadence(self, now_s: float) -> Cadence:
        """Trajectories still to start, from the cadence of the log's mode."""
        if self.mode == "async":
            return self._async_cadence(now_s)
        running = self.step_started_s is not None
        return Cadence(
            pending=self.pending_starts(),
            pending_chance=1.0,
            pending_mix=self.step_mix(self.step) or self.step_mix(self.step - 1),
            since_anchor_s=max(now_s - self.step_started_s, 0.0) if running else 0.0,
            offsets=self.start_offset_s,
            next_size=self.last_step_size(),
            next_chance=0.0 if self.final_step_done else 1.0,
            next_mix=self.step_mix(self.last_step),
            next_waited_s=None if self.step_pending_since_s is None else max(now_s - self.step_pending_since_s, 0.0),
            gap=self.step_gap_s,
            waves=False,
        )

    def _async_cadence(self, now_s: float) -> Cadence:
        """The running cycle opened at the last batch_ready. A cycle brings a wave with the
        probability q that the cycles before did (none near the run's end, or when the gate
        stays shut), as big as theirs (the first: the batch that opened it); while the
        running cycle's has not come, that chance fades as its offset passes."""
        cycle = len(self.batch_ready_s)
        anchor_s = self.batch_ready_s[-1] if cycle else self.first_start_s
        if anchor_s is None:
            return Cadence(0.0, 0.0, {}, 0.0, self.wave_offset_s, 0.0, 0.0, {}, None, self.batch_gap_s, True)
        done = np.array([self.started_per_cycle[k] for k in range(1, cycle)])
        waves = done[done > 0]
        wave = float(waves.mean()) if len(waves) else float(self.last_batch_size or self.started_per_cycle[0])
        q = (len(waves) + 1.0) / (len(done) + 2.0)  # Laplace: one pseudo-cycle with a wave, one without
        since_s = max(now_s - anchor_s, 0.0)
        started = self.started_per_cycle[cycle]
        pending, chance = (max(wave - started, 0.0), 1.0) if started else (wave, q)
        if cycle == 0:
            pending = 0.0  # the run's first fill comes at once
        elif not started and self.wave_offset_s.n:  # P(a wave | none by now) = q S(t) / (q S(t) + 1 - q)
            late = q * float(self.wave_offset_s.survival(np.array([since_s]))[0])
            chance = late / (late + 1.0 - q)
        mix = self.cycle_mix(cycle - 1) or self.cycle_mix(cycle)
        return Cadence(
            pending=pending,
            pending_chance=chance,
            pending_mix=self.cycle_mix(cycle) or mix,
            since_anchor_s=since_s,
            offsets=self.wave_offset_s,
            next_size=wave,
            next_chance=q,
            next_mix=mix,
            next_waited_s=since_s,
            gap=self.batch_gap_s,
            waves=True,
        )

    def cycle_mix(self, cycle: int) -> dict[int, float]:
        """Async: share of each family among the starts of that cycle."""
        counts = {f: n for (k, f), n in self.started_per_cycle_family.items() if k == cycle}
        total = sum(counts.values())
        return {f: n / total for f, n in sorted(counts.items())} if total else {}

    def pending_starts(self) -> int:
        """Trajectories of the running step not started yet, if it is as big as the one before."""
        if self.step_started_s is None or self.step_pending_since_s is not None:
            return 0
        expected = self.started_per_step.get(self.step - 1, 0)
        return max(expected - self.started_per_step.get(self.step, 0), 0)

    # --- ingesting -------------------------------------------------------------------------
    def learn_from(self, events: pl.DataFrame) -> None:
        """Start from what an earlier run's lifecycle log (`forecaster.prior_log`) teaches of
        each family: its turn counts, token sizes and stage times, learned as `ingest` would
        learn them. None of that run's trajectories or cadence is kept, and this run's own
        samples displace the prior's as they come (each statistic keeps its latest). Call it
        before the first event."""
        if self.events or self.families:
            raise ValueError("a prior is learned before any event of the run")
        prior = LiveState(cost=self.cost, decode_cost=self.decode_cost)
        prior.ingest(events)
        self.families, self._family_index, self.stats = prior.families, prior._family_index, prior.stats

    def ingest(self, events: pl.DataFrame) -> None:
        """Apply events in the frame's order (the caller sorts by (at_s, event_id))."""
        self.events += events.height
        if events.height == 0:
            return
        fleet = np.flatnonzero(of_fleet(events))
        if len(fleet):
            for kind, at_s, step, detail in events[fleet, ["kind", "at_s", "step", "detail"]].iter_rows():
                self._fleet_event(kind, at_s, step, detail)
        code = kind_codes(events, _KINDS)
        rows = np.flatnonzero(code >= 0)
        if len(rows):
            self._ingest_chunk(events, rows, code[rows])

    def _fleet_event(self, kind: str, at_s: float, step: int, detail: str) -> None:
        if kind in ("batch_ready", "policy_update_started"):
            self.mode = "async"
        if kind == "batch_ready":
            if self.batch_ready_s:
                self.batch_gap_s.add(max(0.0, at_s - self.batch_ready_s[-1]))
            self.batch_ready_s.append(at_s)
            self.last_batch_size = batch_trajectories(detail) or self.last_batch_size
        elif kind == "rollout_done":
            self.step_pending_since_s = at_s
            self.final_step_done = detail == FINAL_STEP
        elif kind == "step_started":
            self.mode = "sync"
            if self.step_pending_since_s is not None:
                self.step_gap_s.add(max(0.0, at_s - self.step_pending_since_s))
            self.step_pending_since_s, self.step_started_s, self.step = None, at_s, step
            self._step_started_at_s[step] = at_s

    def _ingest_chunk(self, events: pl.DataFrame, rows: np.ndarray, code: np.ndarray) -> None:
        """Apply the trajectory events at `rows` of the frame (their kind codes: `code`)."""
        ids = (events["trajectory_id"] if len(rows) == events.height else events[rows, "trajectory_id"]).to_list()
        col = {c: events[c].to_numpy()[rows] for c in _NUMERIC}
        slot, opened = self._slots(ids, events["task_family"], rows, col["at_s"], col["turn"])
        keep = _up_to_finish(slot, code)  # not after a trajectory's finish, nor of one finished before
        if not keep.any():
            return
        if not keep.all():
            ids = [ids[i] for i in np.flatnonzero(keep)]
            slot, opened, code = slot[keep], opened[keep], code[keep]
            col = {c: v[keep] for c, v in col.items()}
        self._learn_chunk(code, col, self.family[slot], slot, opened)
        self._close(ids, code)

    def _family(self, name: str) -> int:
        if name not in self._family_index:
            self._family_index[name] = len(self.families)
            self.families.append(name)
            self.stats[name] = FamilyStats()
        return self._family_index[name]

    def _slots(
        self, ids: list[str], families: pl.Series, rows: np.ndarray, at_s: np.ndarray, turn: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Slot of every event (-1: its trajectory has finished), and whether it opened in
        this chunk: a trajectory seen for the first time opens one at its first event."""
        slot = np.fromiter(map(self._slot.get, ids, repeat(-1)), np.int64, len(ids))
        unknown = np.flatnonzero(slot < 0)
        first: dict[str, int] = {}  # trajectory seen for the first time -> its first event
        for i in unknown.tolist():
            if ids[i] not in first and ids[i] not in self._finished:
                first[ids[i]] = i
        opened = np.zeros(len(ids), bool)
        if not first:
            return slot, opened
        while len(self._free) < len(first):
            self._grow()
        f = np.fromiter(first.values(), np.int64, len(first))
        s = np.array([self._free.pop() for _ in first], np.int64)
        self._slot.update(zip(first, s.tolist()))
        self.family[s] = np.fromiter(map(self._family, families[rows[f]].to_list()), np.int32, len(f))
        self.phase[s], self.entered_s[s] = PRE, at_s[f]
        self.turn[s], self.prefilled[s], self.alive[s] = np.maximum(turn[f], 0), False, True
        self.context[s], self.queued_new[s] = 0.0, 0.0  # a reused slot starts with no history
        slot[unknown] = np.fromiter((self._slot.get(ids[i], -1) for i in unknown.tolist()), np.int64, len(unknown))
        opened[unknown] = slot[unknown] >= 0
        return slot, opened

    def _grow(self) -> None:
        old = len(self.alive)
        new = max(1024, 2 * old)
        for name in ("family", "phase", "entered_s", "turn", "prefilled", "alive", "context", "queued_new"):
            array = getattr(self, name)
            grown = np.zeros(new, array.dtype)
            grown[:old] = array
            setattr(self, name, grown)
        self._free = list(range(new - 1, old - 1, -1)) + self._free

    def _learn_chunk(self, code, col, fam, slot, opened) -> None:
        at_s, turn = col["at_s"], col["turn"]
        phase_before, entered_before = self._walk(code, at_s, turn, slot, col)
        for kind, phase in _ENDS.items():
            done = (code == kind) & (phase_before == phase)
            self._learn_stage(fam[done], phase, np.maximum(at_s[done] - entered_before[done], 0.0))
            if kind == DEC_STARTED:
                first = done & (turn == 0)
                self._learn("prompt_pre_s", fam[first], np.maximum(at_s[first] - entered_before[first], 0.0))
                later = done & (turn != 0)
                self._learn("append_pre_s", fam[later], np.maximum(at_s[later] - entered_before[later], 0.0))
        miss = col["context_tokens"] - col["cached_prefix_tokens"] + col["new_tokens"]
        done = code == PREFILLED
        self._learn("prompt_miss_tokens", fam[done & (turn == 0)], miss[done & (turn == 0)])
        self._learn("miss_tokens", fam[done & (turn != 0)], miss[done & (turn != 0)])
        engine_s = self.cost.engine_s(miss.astype(float), col["cached_prefix_tokens"].astype(float))
        self._learn("prompt_engine_s", fam[done & (turn == 0)], engine_s[done & (turn == 0)])
        self._learn("engine_s", fam[done & (turn != 0)], engine_s[done & (turn != 0)])
        delayed = done & (phase_before == PRE)  # from when the turn was queued (a re-send keeps that clock)
        sizes = np.column_stack([miss, engine_s]).astype(float)
        self._learn_delays("prompt_delays", fam, delayed & (turn == 0), at_s - entered_before, sizes)
        self._learn_delays("prefill_delays", fam, delayed & (turn != 0), at_s - entered_before, sizes)
        later = done & (turn != 0) & (col["context_tokens"] > 0)
        self._learn(
            "cached_share", fam[later], np.minimum(col["cached_prefix_tokens"][later] / np.maximum(col["context_tokens"][later], 1), 1.0)
        )
        done = code == DEC_DONE
        self._learn("gen_tokens", fam[done], col["generated_tokens"][done])
        decode_s = self.decode_cost.engine_s(
            col["generated_tokens"][done].astype(float), (col["context_tokens"] + col["new_tokens"])[done].astype(float)
        )
        self._learn("decode_engine_s", fam[done], decode_s)
        done = code == TOOL_DONE
        self._learn("obs_tokens", fam[done], col["new_tokens"][done])
        started = (code == STARTED) & opened
        self._learn("prompt_tokens", fam[started], col["new_tokens"][started])
        steps = col["step"][started]
        self.started_per_step.update(steps.tolist())
        self.started_per_step_family.update(zip(steps.tolist(), fam[started].tolist()))
        if len(steps):
            self.last_step = max(self.last_step, int(steps.max()))
        since = np.array([self._step_started_at_s.get(int(k), np.nan) for k in steps])
        self.start_offset_s.add_many(np.maximum(at_s[started] - since, 0.0)[~np.isnan(since)])
        self._learn_async_starts(at_s[started], fam[started])
        done = code == FINISHED
        for key, members in self._by_family(fam[done]):
            self.stats[key].turns.add_finished_many(turn[done][members])

    def _learn_async_starts(self, at_s: np.ndarray, fam: np.ndarray) -> None:
        """Each start's cycle (batch_ready events before it) and its offset from that cycle's
        anchor. A start before any step_started is async's."""
        if len(at_s) == 0:
            return
        if self.first_start_s is None:
            self.first_start_s = float(at_s.min())
            if self.step_started_s is None:
                self.mode = "async"
        if self.mode != "async":
            return
        anchors = np.array(self.batch_ready_s)
        cycle = np.searchsorted(anchors, at_s, side="right")
        self.started_per_cycle.update(cycle.tolist())
        self.started_per_cycle_family.update(zip(cycle.tolist(), fam.tolist()))
        opened = cycle > 0  # cycle 0 is the run's first fill, not a wave a batch opened
        self.wave_offset_s.add_many(at_s[opened] - anchors[cycle[opened] - 1])

    def _walk(self, code, at_s, turn, slot, col) -> tuple[np.ndarray, np.ndarray]:
        """Phase and phase-entry time of each event's trajectory just before the event; then
        leave every slot in the state after its last event."""
        sets_phase = _SETS_PHASE[code]
        sets_clock = _SETS_CLOCK[code]
        order = np.argsort(slot, kind="stable")  # events grouped by trajectory, in time order
        s, n = slot[order], len(order)
        pos = np.arange(n)
        group_start = np.maximum.accumulate(np.where(np.r_[True, s[1:] != s[:-1]], pos, 0))

        def before(valid: np.ndarray, values: np.ndarray, state: np.ndarray) -> np.ndarray:
            last = np.maximum.accumulate(np.where(valid[order], pos, -1))
            prev = np.r_[-1, last[:-1]]
            out = np.where(prev >= group_start, values[order][np.maximum(prev, 0)], state[s])
            result = np.empty_like(out)
            result[order] = out
            return result

        phase_before = before(sets_phase >= 0, sets_phase, self.phase)
        entered_before = before(sets_clock, at_s, self.entered_s)
        for valid, array, values in (
            (sets_phase >= 0, self.phase, sets_phase),
            (sets_clock, self.entered_s, at_s),
            ((code == QUEUED) | (code == TOOL_DONE), self.turn, np.where(code == TOOL_DONE, turn + 1, np.maximum(turn, 0))),
            (np.isin(code, (QUEUED, REPREFILL, PREFILLED, TOOL_DONE)), self.prefilled, code == PREFILLED),
            # a re-prefill re-sends the queued turn: its context and new tokens stand (older
            # logs carry no token counts on reprefill events)
            (
                np.isin(code, (QUEUED, DEC_DONE)),
                self.context,
                np.where(code == DEC_DONE, col["context_tokens"] + col["new_tokens"] + col["generated_tokens"], col["context_tokens"]),
            ),
            (code == QUEUED, self.queued_new, col["new_tokens"]),
        ):
            array[slot[valid]] = values[valid]  # repeated slots: the last event wins
        return phase_before, entered_before

    def _close(self, ids: list[str], code: np.ndarray) -> None:
        for i in np.flatnonzero(code == FINISHED):
            slot = self._slot.pop(ids[i], None)
            self._finished.add(ids[i])
            if slot is not None:
                self.alive[slot] = False
                self._free.append(slot)

    def _by_family(self, fam: np.ndarray):
        """(stats key, mask) for the pooled statistics and each family present."""
        if len(fam) == 0:
            return
        yield POOLED, np.ones(len(fam), bool)
        for f in np.flatnonzero(np.bincount(fam)):
            yield self.families[f], fam == f

    def _learn(self, what: str, fam: np.ndarray, values: np.ndarray) -> None:
        for key, members in self._by_family(fam):
            getattr(self.stats[key], what).add_many(values[members])

    def _learn_delays(self, what: str, fam: np.ndarray, mask: np.ndarray, delays_s: np.ndarray, sizes: np.ndarray) -> None:
        for key, members in self._by_family(fam[mask]):
            getattr(self.stats[key], what).add_many(delays_s[mask][members], sizes[mask][members])

    def _learn_stage(self, fam: np.ndarray, phase: int, durations_s: np.ndarray) -> None:
        for key, members in self._by_family(fam):
            self.stats[key].stage_s[phase].add_many(durations_s[members])
