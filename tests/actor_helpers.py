"""The one way tests build actors: the clock and the config run at the same scale.

config = at_scale(tiny_config, 100.0)       # or keep the config's own scale
clock = clock_for(config)                   # share it between the actors of one run
engine = build(EngineActor, "e0", config, bus, Role.COLOCATED, clock=clock)
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

import msgspec

from actors.base.clock import ScaledClock
from actors.config import Config
from bus_schemas import subjects
from bus_schemas.codec import decode
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.work import TurnResult

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


class TurnWatch:
    """A test's view of a weight update mid-decode, from bus subscriptions: the first result
    per trajectory (`got`, with `all_in` set once `expected` are in), every lifecycle event
    (`log`), and `decoding` set once `decoding_on` starts a decode."""

    def __init__(self, expected: int, decoding_on: str) -> None:
        self.expected, self.decoding_on = expected, decoding_on
        self.got: dict[str, TurnResult] = {}
        self.log: list[LifecycleEvent] = []
        self.all_in, self.decoding = asyncio.Event(), asyncio.Event()

    async def subscribe(self, bus, results_subject: str) -> None:
        await bus.subscribe(results_subject, cb=self._on_result)
        await bus.subscribe(subjects.lifecycle_all(), cb=self._on_event)
        await bus.flush()

    async def _on_result(self, msg) -> None:
        r = decode(TurnResult, msg.data)
        self.got.setdefault(r.trajectory_id, r)
        if len(self.got) == self.expected:
            self.all_in.set()

    async def _on_event(self, msg) -> None:
        e = decode(LifecycleEvent, msg.data)
        self.log.append(e)
        if e.kind is EventKind.DECODE_STARTED and e.engine_id == self.decoding_on:
            self.decoding.set()
