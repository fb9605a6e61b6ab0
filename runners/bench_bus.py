"""The bus under load, on the real nats-server (`python -m runners.bench bus --out DIR`).

1. Lifecycle events per second held with nothing lost: one actor's `LifecyclePublisher`
   (the path every actor logs through: publishes with Nats-Msg-Id, at most a window in
   flight, retried until acked) emits N events; the rate is N over the time until every one
   is acked. After each run every emitted id is looked up in the LIFECYCLE stream: `lost`
   counts those missing, `duplicated` those stored twice. Each setting runs `repeats` times
   on a fresh server and reports the median (a shared machine is noisy; every run is in
   `measured`, with the client's and the server's CPU per event). Twice: fsync off
   (`sync_interval` 2m, NATS's default) and `always` (the launcher's default); the disk's
   own small-write fsync rate is measured next to it (`disk_fsyncs_per_s`), since with
   `always` the server syncs what it stores before it acks and the disk sets the pace.
2. Control latency: a forecast published on `prorsa.forecast` → the allocator's hop (a
   stand-in that sends SetRole the moment the forecast arrives: the policy's own decision
   time is the policy benches' business) → a real engine process carries the switch out →
   its ack received; minus the engine's drain and reconfiguration (idle, `instant` regime:
   both 0). Meanwhile a fleet of `--engines` engines sends heartbeats at the run's period.

Writes DIR/bus.json: events_per_s_async, events_per_s_fsync, control_p50_ms,
control_p99_ms, lost, duplicated (and how each was measured).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import msgspec

from actors.base.clock import ScaledClock
from actors.base.connection import TlsFiles, close, connect, publish_origin
from actors.base.lifecycle import LifecyclePublisher
from actors.config import Config
from bus_schemas import streams, subjects
from bus_schemas.codec import decode, encode
from bus_schemas.control import CommandAck, Role, SetRole
from bus_schemas.forecast import DemandForecast
from bus_schemas.lifecycle import EventKind, LifecycleEvent
from bus_schemas.status import EngineStatus
from ops.export import read_stream
from ops.natsserver import EmbeddedNats
from ops.tls import make_local_pki

LOG = logging.getLogger("prorsa.bench.bus")
REPO = Path(__file__).resolve().parent.parent


def process_cpu_s(pid: int | None = None) -> float:
    """User + system CPU seconds a process has used (this one by default); Linux /proc."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def disk_fsyncs_per_s(folder: Path, duration_s: float = 0.5) -> float:
    """Small appends each followed by fsync, per second, in `folder`: how fast this disk
    syncs at this moment (the pace `sync_interval: always` follows; the server groups some)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    n, started = 0, time.perf_counter()
    try:
        while time.perf_counter() - started < duration_s:
            os.write(fd, b"x" * 200)
            os.fsync(fd)
            n += 1
    finally:
        os.close(fd)
        path.unlink()
    return n / (time.perf_counter() - started)


def bench_event(i: int) -> LifecycleEvent:
    return LifecycleEvent(
        event_id=f"bench-{i}", kind=EventKind.PREFILL_DONE, actor_id="e0", at_s=float(i), trajectory_id=f"t{i % 512}", turn=i % 7
    )


def bench_server(root: Path, tls: bool, sync_interval: str = "always") -> tuple[EmbeddedNats, TlsFiles | None]:
    """A fresh server under `root` and what its clients need: with `tls`, a local CA's
    certificates (mutual TLS, as a launched run with `[bus] tls = "local"`)."""
    pki = make_local_pki(root / "tls") if tls else None
    return EmbeddedNats(root / "nats", sync_interval=sync_interval, tls=pki and pki.server), pki and pki.client


async def events_per_s(root: Path, sync_interval: str, n_events: int, tls: bool = False) -> dict:
    """One run on a fresh server: events acked per second, and every emitted id checked
    against the stream afterwards (lost: missing; duplicated: stored more than once)."""
    server, client_tls = bench_server(root, tls, sync_interval)
    with server:
        nc = await connect(server.url, "bench-events", LOG, tls=client_tls)
        try:
            js = nc.jetstream()
            await streams.ensure_streams(js)
            counters: Counter = Counter()
            publisher = LifecyclePublisher(js, counters, LOG, ScaledClock(1.0))
            publisher.start()
            cpu_s, server_cpu_s = process_cpu_s(), process_cpu_s(server.proc.pid)
            started = time.perf_counter()
            for i in range(n_events):
                publisher.emit(bench_event(i))
                if i % 1024 == 0:
                    await asyncio.sleep(0)  # let the publisher task run, as an actor's loop would
            await publisher.flush()
            elapsed_s = time.perf_counter() - started
            cpu_s, server_cpu_s = process_cpu_s() - cpu_s, process_cpu_s(server.proc.pid) - server_cpu_s
            await publisher.close()
            stored = Counter(e.event_id for e in await read_stream(js, streams.LIFECYCLE, subjects.lifecycle_all(), LifecycleEvent))
            emitted = {f"bench-{i}" for i in range(n_events)}
            return {
                "events_per_s": n_events / elapsed_s,
                "seconds": round(elapsed_s, 3),
                "lost": len(emitted - stored.keys()),
                "duplicated": sum(n - 1 for n in stored.values()),
                "client_cpu_us_per_event": round(cpu_s / n_events * 1e6, 1),
                "server_cpu_us_per_event": round(server_cpu_s / n_events * 1e6, 1),
                "retries": counters["lifecycle_publish_retries"],
                "peak_in_flight": publisher.peak_in_flight,
            }
        finally:
            await close(nc)


async def events_median(root: Path, sync_interval: str, n_events: int, repeats: int, tls: bool = False) -> tuple[float, list[dict]]:
    """(the median rate over `repeats` runs, each run's figures): a shared machine is noisy."""
    name = f"{sync_interval}{'-tls' if tls else ''}"
    runs = [await events_per_s(root / f"{name}-{k}", sync_interval, n_events, tls) for k in range(repeats)]
    return statistics.median(r["events_per_s"] for r in runs), runs


def fleet_status(engine_id: str, at_s: float) -> bytes:
    return encode(
        EngineStatus(
            engine_id=engine_id,
            at_s=at_s,
            role=Role.COLOCATED,
            epoch=0,
            policy_version=0,
            backend="emulated",
            waiting_prefill=3,
            running_decode=40,
            kv_used_tokens=100_000,
            kv_capacity_tokens=400_000,
            held_kv_handles=0,
            busy_fraction=0.8,
        )
    )


def forecast(tick: int) -> bytes:
    return encode(
        DemandForecast(
            forecaster_id="bench",
            model="bench",
            tick=tick,
            as_of_s=float(tick),
            computed_at_s=float(tick),
            bin_s=1.0,
            horizons_s=[5.0],
            targets=[],
            live_trajectories=0,
            events_total=0,
        )
    )


async def control_latency_ms(root: Path, n_switches: int, fleet: int, heartbeat_wall_s: float, tls: bool = False) -> list[float]:
    """Forecast published → SetRole acked by a real engine process, in wall ms, minus its drain and reconfiguration."""
    config = msgspec.convert(
        {"run": {"name": "bench-bus", "time_scale": 1.0, "heartbeat_wall_s": heartbeat_wall_s}, "engines": {"count": 1}}, Config
    )
    config_path = root / "config.json"
    root.mkdir(parents=True, exist_ok=True)
    config_path.write_bytes(msgspec.json.encode(config))
    server, client_tls = bench_server(root, tls)
    with server:
        nc = await connect(server.url, "bench-control", LOG, tls=client_tls)
        engine = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "actors.engine",
                "--config",
                str(config_path),
                "--id",
                "e0",
                "--role",
                "colocated",
                "--nats-url",
                server.url,
            ],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(REPO), **(client_tls.env() if client_tls else {})},
        )
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


async def bench(
    out: Path, n_events: int, n_fsync_events: int, n_switches: int, fleet: int, heartbeat_wall_s: float, repeats: int = 3
) -> dict:
    with tempfile.TemporaryDirectory(prefix="bench-bus-") as tmp:
        root = Path(tmp)
        async_rate, async_runs = await events_median(root, "2m", n_events, repeats)
        disk_fsyncs = disk_fsyncs_per_s(root / "probe")
        fsync_rate, fsync_runs = await events_median(root, "always", n_fsync_events, repeats)
        latencies = await control_latency_ms(root / "control", n_switches, fleet, heartbeat_wall_s)
        tls_rate, tls_runs = await events_median(root, "2m", n_events, repeats, tls=True)
        tls_latencies = await control_latency_ms(root / "control-tls", n_switches, fleet, heartbeat_wall_s, tls=True)
    runs = async_runs + fsync_runs + tls_runs
    result = {
        "events_per_s_async": round(async_rate),
        "events_per_s_fsync": round(fsync_rate),
        "control_p50_ms": round(percentile(latencies, 0.50), 2),
        "control_p99_ms": round(percentile(latencies, 0.99), 2),
        # the same over TLS (mutual TLS, a local CA's certificates; as `[bus] tls = "local"`)
        "events_per_s_async_tls": round(tls_rate),
        "control_p50_ms_tls": round(percentile(tls_latencies, 0.50), 2),
        "control_p99_ms_tls": round(percentile(tls_latencies, 0.99), 2),
        "lost": sum(r["lost"] for r in runs),
        "duplicated": sum(r["duplicated"] for r in runs),
        "measured": {
            "events_async": n_events,
            "events_fsync": n_fsync_events,
            "repeats": repeats,
            "switches": n_switches,
            "fleet_engines": fleet,
            "heartbeat_wall_s": heartbeat_wall_s,
            "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
            "disk_fsyncs_per_s": round(disk_fsyncs),
            "runs_async": async_runs,
            "runs_fsync": fsync_runs,
            "runs_async_tls": tls_runs,
            "events": "per run: a fresh server, one LifecyclePublisher, emit N then flush; rate = N / time to the last ack (the median of the runs); "
            "lost / duplicated = emitted ids missing from / stored more than once in the LIFECYCLE stream, read back after each run",
            "control": "forecast publish -> SetRole request (allocator stand-in) -> engine process switches and acks, minus drain",
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "bus.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
