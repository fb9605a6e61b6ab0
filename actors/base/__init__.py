"""Actor runtime: connection, injected clock, typed decoding at the edge, heartbeats,
lifecycle publishing and clean shutdown. Every actor builds on `Actor` and `actor_main`."""

from actors.base.clock import Clock, ScaledClock
from actors.base.runtime import Actor, actor_main

__all__ = ["Actor", "Clock", "ScaledClock", "actor_main"]
