"""What the lifecycle model (forecasting.models.lifecycle) adds up on its fine slot grid: the
expected demand per slot and its variance (`SlotDemand`), the flows a walk of the phase
chain yields (`Flows`), and a block of arrivals that come together (`Block`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from forecasting.empirical import Empirical
from forecasting.live import DEC, PRE, TOOL
from forecasting.models.base import TARGETS
from forecasting.series import TokenCost

COMPOUND = ("prefill_new_tokens", "prefill_miss_tokens", "prefill_engine_s", "decode_tokens", "decode_engine_s")  # the flows


@dataclass(slots=True)
class SlotDemand:
    """Expected demand per fine slot, and its variance."""

    slots: int
    decode_cost: TokenCost  # what a decode of g tokens on a context C costs (series.TokenCost)
    new_tokens: np.ndarray = field(init=False)
    miss_tokens: np.ndarray = field(init=False)  # a prefill's compute when it is done (what the series counts) ...
    engine_s: np.ndarray = field(init=False)
    miss_asked: np.ndarray = field(init=False)  # ... and when it is asked for (queued: what capacity must serve)
    engine_s_asked: np.ndarray = field(init=False)
    decode_tokens: np.ndarray = field(init=False)
    decode_engine_s: np.ndarray = field(init=False)
    decode_active: np.ndarray = field(init=False)
    kv_now: float = 0.0  # the live trajectories' KV now (LiveState.live_context_tokens)
    kv_delta: np.ndarray = field(init=False)  # its expected change in each slot
    var: dict[str, np.ndarray] = field(init=False)  # live_kv_tokens: per slot, of the change
    # flow target -> per source: (expected items per slot, their sizes): a compound Poisson flow
    compound: dict[str, list[tuple[np.ndarray, Empirical]]] = field(init=False)

    def __post_init__(self) -> None:
        self.compound = {t: [] for t in COMPOUND}
        for name in (
            "new_tokens",
            "miss_tokens",
            "engine_s",
            "miss_asked",
            "engine_s_asked",
            "decode_tokens",
            "decode_engine_s",
            "decode_active",
            "kv_delta",
        ):
            setattr(self, name, np.zeros(self.slots))
        self.var = {t: np.zeros(self.slots) for t in TARGETS}

    def add_prefill(self, miss_done: np.ndarray, engine_s_done: np.ndarray, miss_asked: np.ndarray, engine_s_asked: np.ndarray) -> None:
        """Prefill compute per slot, timed when it is done and when it is asked for."""
        self.miss_tokens += miss_done
        self.engine_s += engine_s_done
        self.miss_asked += miss_asked
        self.engine_s_asked += engine_s_asked

    def now(self, amount: float) -> np.ndarray:
        """`amount` in the first slot."""
        return np.eye(1, self.slots)[0] * amount


@dataclass(slots=True)
class Flows:
    arrivals: np.ndarray  # TOOL ends (and trajectory starts): prefills queued
    starts: np.ndarray  # PRE ends: decodes started
    ends: np.ndarray  # DEC ends: decodes completed
    ends_context: np.ndarray  # Σ over those decodes of the context each one reads (tokens)
    finishes: np.ndarray  # the decode ends after which the trajectory finishes
    finish_context: np.ndarray  # Σ over those of the context (the KV the trajectory lets go)

    @staticmethod
    def of(by_phase: np.ndarray, decode_ends: np.ndarray) -> Flows:
        """From the (3, slots) ends per phase, and the (3, slots) decode ends' contexts, the
        finishing ends and their contexts."""
        return Flows(by_phase[TOOL], by_phase[PRE], by_phase[DEC], *decode_ends)

    @staticmethod
    def none(arrivals: np.ndarray) -> Flows:
        """Arrivals alone."""
        zero = np.zeros_like(arrivals)
        return Flows(arrivals, zero, zero, zero, zero, zero)


@dataclass(frozen=True, slots=True)
class Block:
    """`count` items of `sizes` that arrive together, as one item (their sizes scaled)."""

    sizes: Empirical
    count: float

    def values(self) -> np.ndarray:
        return self.sizes.values() * self.count

    def mean(self) -> float:
        return self.sizes.mean() * self.count
