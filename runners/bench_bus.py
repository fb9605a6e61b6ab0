"""The bus under load, on the real nats-server (`python -m runners.bench bus --out DIR`).

1. Lifecycle events per second held with nothing lost: one actor's `LifecyclePublisher`
   (the path every actor logs through: async publishes with Nats-Msg-Id, retried until
   acked) emits N events; the rate is N over the time until every one is acked, and `lost`
   counts emitted events missing from the LIFECYCLE stream afterwards. Twice: fsync off
   (`sync_interval` 2m, NATS's default) and `always` (the launcher's default).
2. Control latency: a forecast published on `prorsa.forecast` → the allocator's hop (a
   stand-in that sends SetRole the moment the forecast arrives: the policy's own decision
   time is the policy benches' business) → a real engine process carries the switch out →
   its ack received; minus the engine's drain and reconfiguration (idle, `instant` regime:
   both 0). Meanwhile a fleet of `--engines` engines sends heartbeats at the run's period.

Writes DIR/bus.json: events_per_s_async, events_per_s_fsync, control_p50_ms,
control_p99_ms, lost (and how each was measured).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgspec

from actors.base.clock import ScaledClock
from actors.base.connection import close, connect, publish_origin
from actors.base.lifecycle import LifecyclePublisher
from actors.config import Config
from bus_schemas import streams, subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import CommandAck, Role, SetRole
from bus_schemas.forecast import DemandForecast
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.status import EngineStatus
from ops.natsserver import EmbeddedNats

LOG = logging.getLogger("prorsa.bench.bus")
REPO = Path(__file__).resolve().parent.parent


async def events_per_s(root: Path, sync_interval: str, n_events: int) -> tuple[float, int]:
    """(events acked per second, events lost) for one server setting."""
    with EmbeddedNats(root, sync_interval=sync_interval) as server:
        nc = await connect(server.url, "bench-events", LOG)
        try:
            js = nc.jetstream()
            await streams.ensure_streams(js)
            counters: Counter = Counter()
            publisher = LifecyclePublisher(js, counters, LOG, ScaledClock(1.0))
            publisher.start()
            started = time.perf_counter()
            for i in range(n_events):
                publisher.emit(LifecycleEvent(event_id=f"bench-{i}", kind=EventKind.PREFILL_DONE, actor_id="e0", at_s=float(i), trajectory_id=f"t{i % 512}", turn=i % 7))
                if i % 1024 == 0:
                    await asyncio.sleep(0)  # let the publisher task run, as an actor's loop would
            await publisher.flush()
            elapsed_s = time.perf_counter() - started
            await publisher.close()
            stored = (await js.stream_info(streams.LIFECYCLE.name)).state.messages
            return n_events / elapsed_s, n_events - stored
        finally:
            await close(nc)


def fleet_status(engine_id: str, at_s: float) -> bytes:
    return encode(
        EngineStatus(
            engine_id=engine_id, at_s=at_s, role=Role.COLOCATED, epoch=0, policy_version=0, backend="emulated",
            waiting_prefill=3, running_decode=40, kv_used_tokens=100_000, kv_capacity_tokens=400_000,
            held_kv_handles=0, busy_fraction=0.8,
        )
    )  # fmt: skip


def forecast(tick: int) -> bytes:
    return encode(
        DemandForecast(
            forecaster_id="bench", model="bench", tick=tick, as_of_s=float(tick), computed_at_s=float(tick), bin_s=1.0,
            horizons_s=[5.0], targets=[], live_trajectories=0, events_total=0,
        )
    )  # fmt: skip


async def control_latency_ms(root: Path, n_switches: int, fleet: int, heartbeat_wall_s: float) -> list[float]:
    """Forecast published → SetRole acked by a real engine process, in wall ms, minus its drain and reconfiguration."""
    config = msgspec.convert({"run": {"name": "bench-bus", "time_scale": 1.0, "heartbeat_wall_s": heartbeat_wall_s}, "engines": {"count": 1}}, Config)
    config_path = root / "config.json"
    root.mkdir(parents=True, exist_ok=True)
    config_path.write_bytes(msgspec.json.encode(config))
    with EmbeddedNats(root / "nats") as server:
        nc = await connect(server.url, "bench-control", LOG)
        engine = subprocess.Popen(
            [sys.executable, "-m", "actors.engine", "--config", str(config_path), "--id", "e0", "--role", "colocated", "--nats-url", server.url],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        beating = None
        try:
            js = nc.jetstream()
            await streams.ensure_streams(js)
            await publish_origin(js, config.run.name)
            up = asyncio.Event()

            async def on_up(msg) -> None:
                up.set()

            sub = await nc.subscribe(subjects.status("engine", "e0"), cb=on_up)
            await asyncio.wait_for(up.wait(), timeout=60)
            await sub.unsubscribe()

            async def heartbeats() -> None:
                while True:
                    now = time.time()
                    for i in range(1, fleet):
                        await nc.publish(subjects.status("engine", f"e{i}"), fleet_status(f"e{i}", now))
                    await asyncio.sleep(heartbeat_wall_s)

            beating = asyncio.create_task(heartbeats())
            sent: dict[int, float] = {}
            latencies_ms: list[float] = []
            acked = asyncio.Event()
            roles = [Role.DECODE, Role.COLOCATED]

            async def on_forecast(msg) -> None:  # the allocator's hop: a forecast in, a SetRole out
                tick = decode(DemandForecast, msg.data).tick
                command = SetRole(role=roles[tick % 2], epoch=tick, drain_deadline_s=0.0)
                ack = decode(CommandAck, (await nc.request(subjects.ctl_engine("e0"), encode(command), timeout=10)).data)
                if not ack.ok:
                    raise RuntimeError(f"engine refused SetRole: {ack.error}")
                latencies_ms.append((time.perf_counter() - sent[tick] - ack.drain_s) * 1e3)  # instant regime: no reconfiguration
                acked.set()

            await nc.subscribe(subjects.forecast(), cb=on_forecast)
            for tick in range(1, n_switches + 1):  # one switch at a time
                acked.clear()
                sent[tick] = time.perf_counter()
                await nc.publish(subjects.forecast(), forecast(tick))
                await asyncio.wait_for(acked.wait(), timeout=30)
            return latencies_ms
        finally:
            if beating is not None:
                beating.cancel()
            engine.terminate()
            engine.wait(timeout=30)
            await close(nc)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def bench(out: Path, n_events: int, n_fsync_events: int, n_switches: int, fleet: int, heartbeat_wall_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-bus-") as tmp:
        root = Path(tmp)
        async_rate, lost_async = await events_per_s(root / "async", "2m", n_events)
        fsync_rate, lost_fsync = await events_per_s(root / "fsync", "always", n_fsync_events)
        latencies = await control_latency_ms(root / "control", n_switches, fleet, heartbeat_wall_s)
    result = {
        "events_per_s_async": round(async_rate),
        "events_per_s_fsync": round(fsync_rate),
        "control_p50_ms": round(percentile(latencies, 0.50), 2),
        "control_p99_ms": round(percentile(latencies, 0.99), 2),
        "lost": lost_async + lost_fsync,
        "measured": {
            "events_async": n_events, "events_fsync": n_fsync_events, "switches": n_switches,
            "fleet_engines": fleet, "heartbeat_wall_s": heartbeat_wall_s, "cpus": os.cpu_count(),
            "events": "one LifecyclePublisher, emit N then flush; rate = N / time to the last ack; lost = N - stored",
            "control": "forecast publish -> SetRole request (allocator stand-in) -> engine process switches and acks, minus drain",
        },
    }  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / "bus.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
