"""What is left of the live trajectories' work (pure): expected turns and model seconds.

A trajectory of a family goes on after its turn m with the family's continuation probability
c[m] (`TurnHazard`), so the turns it is expected to run after turn m are

    S[m] = c[m] (1 + S[m + 1])

One prefilling or decoding its turn n has that turn and S[n] more; one in a tool call after
turn n goes on to turn n + 1, and S[n + 1] after it. Each turn lasts the family's mean turn
as measured in the log (queued prefill, decode and tool call, queueing included: the pace of
the arrangement the fleet runs): the prefill stage an append's (a step's prompts queue
behind each other, the turns after them do not), the decode and tool stages with the turns
still in them counted (`exposure_mean`: the first stages to end are the short ones, so early
in a run the ended ones alone would price the turns left far too short). A live
trajectory's remaining seconds are its turns left times that turn; the figure published is
their mean over the live trajectories, the time the average one still needs (the step lasts
at least that, its longest trajectory longer).

The allocator weighs a role change's saving over this time (docs/allocation.md, "The
evaluator"). Unknown (0) while a family has no prefill or decode measured; a tool call not
yet seen to end counts as none (too short a turn, so a change is bought later, not earlier).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from forecasting.empirical import Empirical
from forecasting.live import DEC, POOLED, PRE, TOOL, LiveState, stage_durations, stat


@dataclass(frozen=True, slots=True)
class Remaining:
    turns: float = 0.0  # expected turns left, summed over the live trajectories
    mean_s: float = 0.0  # mean over the live trajectories of their expected seconds left (0: unknown)
    # a turn's mean seconds queued and prefilling, decoding, and in its tool call, over the
    # live trajectories' families (each family's mean, weighted by its live trajectories)
    stage_s: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # an append's mean cache-missed prefill tokens, over the live trajectories' families as
    # stage_s (0: none measured)
    prefill_tokens: float = 0.0


def turns_after(continue_prob: np.ndarray) -> np.ndarray:
    """S[m], the expected turns after turn m, for every m (none after the last one tracked)."""
    after = np.zeros(len(continue_prob) + 1)
    for m in range(len(continue_prob) - 1, -1, -1):
        after[m] = continue_prob[m] * (1.0 + after[m + 1])
    return after


def exposure_mean(durations: Empirical, elapsed_s: np.ndarray) -> float:
    """A stage's mean duration with the live trajectories still in it counted (`elapsed_s`,
    their time in it so far): the time spent in the stage over the stages that ended, the
    estimate of an exponential duration's mean under right censoring. The stages that end
    first are the short ones, so early in a run the ended ones' mean alone is low; this one
    is exact for a constant hazard and high for a duration with a bound (a decode's token cap).
    Where the samples kept are no longer every one there was (a long run), the ended ones'
    mean: the live ones' time would be set against a window of the ended."""
    if durations.n == 0 or not durations.holds_every_sample():
        return durations.mean()
    return durations.mean() + float(elapsed_s.sum()) / durations.n


def remaining(live: LiveState, now_s: float) -> Remaining:
    """Expected turns and mean seconds left of the live trajectories at `now_s` (module docstring)."""
    alive = np.flatnonzero(live.alive)
    if len(alive) == 0:
        return Remaining()
    pooled = live.stats[POOLED]
    turns_total, seconds_total, timed, prefill_total = 0.0, 0.0, True, 0.0
    stage_total = np.zeros(3)
    family_of = live.family[alive]
    for family in np.flatnonzero(np.bincount(family_of)):
        members = alive[family_of == family]
        stats = live.family_stats(int(family))
        hazard = stat(stats, pooled, "turns")
        after = turns_after(hazard.continue_prob(live.turn[members]))
        turn = live.turn[members]
        in_tool = live.phase[members] == TOOL
        left = 1.0 + after[np.minimum(turn + in_tool, len(after) - 1)]
        durations = stage_durations(stats, pooled)
        timed = timed and all(durations[p].n for p in (PRE, DEC))
        means = stage_means(live, members, durations, stat(stats, pooled, "append_pre_s"), now_s)
        turns_total += float(left.sum())
        seconds_total += float(left.sum()) * float(means.sum())
        stage_total += len(members) * means
        prefill_total += len(members) * stat(stats, pooled, "miss_tokens").mean()
    if not timed:
        return Remaining(turns_total)
    stage_s = stage_total / len(alive)
    stages = (float(stage_s[0]), float(stage_s[1]), float(stage_s[2]))
    return Remaining(turns_total, seconds_total / len(alive), stages, prefill_total / len(alive))


def stage_means(live: LiveState, members: np.ndarray, durations: list[Empirical], append_pre: Empirical, now_s: float) -> np.ndarray:
    """A turn left's mean seconds queued and prefilling (an append's, once one has been timed:
    a step's prompts queue behind each other, the turns after them do not), decoding and in
    its tool call (`exposure_mean`, with `members`' time so far in the stage); an empty
    stage's mean is 0."""
    elapsed_s = np.maximum(now_s - live.entered_s[members], 0.0)
    phase = live.phase[members]
    pre = append_pre.mean() if append_pre.n else durations[PRE].mean()
    return np.array([pre] + [exposure_mean(durations[p], elapsed_s[phase == p]) for p in (DEC, TOOL)])
