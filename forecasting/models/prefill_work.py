"""The prefill work the live trajectories will ask for (the lifecycle model's pricing:
forecasting.models.lifecycle): each one's next prefill priced on its own context, the
prefills queued now and not computed yet, and a run's opening read as a queue before any
phase has ended."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from forecasting.live import POOLED, PRE, FamilyStats, LiveState, stat


def next_prefill(
    live: LiveState, stats: FamilyStats, pooled: FamilyStats, members: np.ndarray, new, new_squared
) -> tuple[np.ndarray, np.ndarray]:
    """Expected engine-seconds and cache-missed tokens of each member's next prefill: `new`
    tokens (mean, and mean square) on its context C, of which a share ρ is cached (the
    family's learned ρ). With n = C(1-ρ) + new missed on a prefix ρC (series.TokenCost):
    E[n] = C(1 - E[ρ]) + E[new];
    E[cost] = t·E[n] + k·(C²(1 - E[ρ²])/2 + C·E[new] + E[new²]/2)."""
    context = live.context[members]
    share = stat(stats, pooled, "cached_share")
    r1, r2 = (share.mean(), share.second_moment()) if share.n else (1.0, 1.0)  # none seen: all cached
    miss = context * (1.0 - r1) + new
    pairs = context * context * (1.0 - r2) / 2.0 + context * new + new_squared / 2.0
    return live.cost.per_token_s * miss + live.cost.per_token_pair_s * pairs, miss


def waiting(live: LiveState, pre: np.ndarray) -> np.ndarray:
    """Those of `pre` (trajectories in PRE) whose queued prefill is not computed yet."""
    return pre[~live.prefilled[pre]]


def waiting_prefills(live: LiveState, stats: FamilyStats, pooled: FamilyStats, queued: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Engine-seconds and cache-missed tokens of the prefills `queued` trajectories wait for
    (those not computed yet: `waiting`)."""
    new = live.queued_new[queued]
    return next_prefill(live, stats, pooled, queued, new, new * new)


@dataclass(frozen=True, slots=True)
class Opening:
    """A run's opening, before any decode has started (`opening`)."""

    drain_s: float  # until the prefill queue is empty
    queued: int  # prompts in it, prefilled or not: they start decoding then
    waiting_engine_s: float  # the prefill work still to do
    waiting_miss_tokens: float
    waiting_new_tokens: float  # the prompts not prefilled yet (KV the fleet will hold once they are)


def opening(live: LiveState, now_s: float) -> Opening | None:
    """Before any decode starts no phase has ended, and the phase durations are unknown; but
    the burst is a queue. It drains at the rate it has drained since the first prompt was
    queued (the prefills done so far, at their mean engine-seconds, per second), and the
    prompts prefilled but not decoding wait for it to empty: a colocated engine runs its
    prefills first (SGLang's default). On the bench's DeepSeek SWE row the first of 1,024
    decodes starts at 20.1 s and all are decoding at 22 s. None until a prefill is done, and
    for a run joined after its opening (a live trajectory decoding or in a tool call)."""
    pooled = live.stats[POOLED]
    pre = np.flatnonzero(live.alive & (live.phase == PRE))
    done = int(live.prefilled[pre].sum())
    elapsed_s = now_s - float(live.entered_s[pre].min()) if len(pre) else 0.0
    if done == 0 or pooled.prompt_engine_s.mean() <= 0.0 or elapsed_s <= 0.0 or len(pre) < int(live.alive.sum()):
        return None
    queued = waiting(live, pre)
    engine_s, miss = waiting_prefills(live, pooled, pooled, queued)
    rate = done * pooled.prompt_engine_s.mean() / elapsed_s  # engine-seconds of prefill per second
    waiting_new = float(live.queued_new[queued].sum())
    return Opening(float(engine_s.sum()) / rate, len(pre), float(engine_s.sum()), float(miss.sum()), waiting_new)
