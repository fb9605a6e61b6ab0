"""The one way tests build actors: the clock and the config run at the same scale.

    config = at_scale(tiny_config, 100.0)       # or keep the config's own scale
    clock = clock_for(config)                   # share it between the actors of one run
    engine = build(EngineActor, "e0", config, bus, Role.COLOCATED, clock=clock)
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from actors.base.clock import ScaledClock
from actors.config import Config

A = TypeVar("A")


def at_scale(config: Config, time_scale: float) -> Config:
    """`config` with `run.time_scale` at `time_scale` (every other field, the heartbeat period included, kept)."""
    return msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, time_scale=time_scale))


def clock_for(config: Config) -> ScaledClock:
    return ScaledClock(config.run.time_scale)


def build(cls: type[A], actor_id: str, config: Config, nc, *args, clock: ScaledClock | None = None, **kwargs) -> A:
    """`cls(actor_id, config, nc, clock, *args)` with a clock at the config's scale."""
    clock = clock or clock_for(config)
    if clock.time_scale != config.run.time_scale:
        raise ValueError(f"clock at {clock.time_scale}x, config at {config.run.time_scale}x: build both from one scale")
    return cls(actor_id, config, nc, clock, *args, **kwargs)
