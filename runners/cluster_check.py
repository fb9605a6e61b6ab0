"""The loss of a server: a small emulated run over two launchers on a local 3-server cluster.

    python -m runners.cluster_check --out DIR [--steps 2] [--time-scale 50] [--policy colocated] [--no-kill] [--tls]
    python -m runners.cluster_check --capacity --out DIR [--sim-config configs/sim-swe-64.toml]

1. Start a local 3-server JetStream cluster (`ops/cluster.py`) under DIR/cluster (`--tls`:
   clients and routes over TLS, the run's `[bus] tls = "on"` with the cluster's files).
2. Start two launchers, as two hosts would: `--only engines` connected to server n1 (its
   seed URL) into DIR/engines, and `--only control --only environments` connected to n0 into
   DIR/control. Every stream and the run bucket have 3 replicas (`[bus] replicas = 3`).
3. Once the first trajectory has finished, `kill -9` server n1: the engines' host loses its
   server and its clients fail over to n0 or n2 (learnt from the cluster); the streams keep
   a quorum of 2. The server stays dead to the end.
4. Wait for both launchers; write DIR/summary.json: the control host's summary (the usual
   fields) with `servers_killed`, each host's exit code, and `lifecycle_events_missing`
   (events the actors had acked but the exported log lacks). Exit 0 if the run completed with
   nothing lost, 1 otherwise.

`--capacity` measures instead (DIR/capacity.json; docs/deploy.md): what a local 3-server
cluster holds on an R3 file stream (300-byte events/s and 1 MiB chunks' bytes/s, every
publish acked), and what a fleet puts on the bus, per subject: one step of `--sim-config`
simulated (`runners.simulate`, in-process bus) with every publish counted, per model second
and per engine. (Heartbeats are not in the simulator's counts: with nobody listening in a
simulation none is sent; live, each actor sends one per `run.heartbeat_wall_s`.)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from actors.base.connection import TlsFiles, close, connect
from bus_schemas import subjects
from ops.cluster import LocalCluster

REPO = Path(__file__).resolve().parent.parent
LOG = logging.getLogger("prorsa.cluster_check")
FIRST_FINISH_TIMEOUT_WALL_S = 120.0
RUN_TIMEOUT_WALL_S = 300.0
# a launcher past its deadline: SIGTERM, then this long before SIGKILL (its own stop: 15 s for
# its actors, up to 45 s for the other host's final reports, then the export)
STOP_GRACE_WALL_S = 90.0
LOG_TAIL_LINES = 25
KILLED = 1  # the engines' server

CONFIG = """
[run]
name = "cluster-check-{stamp}"
seed = 5
time_scale = {time_scale}
policy = "{policy}"
heartbeat_wall_s = 0.2
ack_wait_wall_s = 5.0

[bus]
replicas = 3
{bus_tls}
[engines]
count = 2
prefill_engines = 1

[environments]
count = 1

[trainer]
steps = {steps}
tasks_per_step = 2
samples_per_task = 2
train_s = 2.0

[workload]
mix = {{ swe = 0.5, math = 0.5 }}

[workload.overrides.swe]
turns_max = 3
tool_latency_scale = 0.2

[workload.overrides.math]
turns_max = 3
gen_scale = 0.3
"""


def write_config(path: Path, cluster: LocalCluster, stamp: str, time_scale: float, steps: int, policy: str) -> None:
    """The run's config (`CONFIG`) for `cluster`: with its TLS files where it speaks TLS."""
    files = cluster.client_tls
    bus_tls = f'tls = "on"\ntls_ca = "{files.ca}"\ntls_cert = "{files.cert}"\ntls_key = "{files.key}"\n' if files else ""
    path.write_text(CONFIG.format(stamp=stamp, time_scale=time_scale, steps=steps, policy=policy, bus_tls=bus_tls))


def control_summary(out: Path) -> dict:
    """The control host's summary.json under `out`, with `lifecycle_events_emitted` (what the
    actors acked) and `lifecycle_events_missing` (acked but absent from the exported log). A
    rerun of a trajectory already reported (its task's ack lost with a server) logs its
    `finished` again under the first one's id, and the stream keeps one (`finished_again`)."""
    path = out / "control" / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {"status": "no summary"}
    actors = summary.get("actors", {}).values()
    emitted = sum(c.get("lifecycle_events", 0) for c in actors)
    stored_once = emitted - sum(c.get("finished_again", 0) for c in actors)
    return summary | {"lifecycle_events_emitted": emitted, "lifecycle_events_missing": max(0, stored_once - summary.get("events", 0))}


def start_launcher(config: Path, out: Path, url: str, groups: list[str]) -> subprocess.Popen:
    only = [arg for group in groups for arg in ("--only", group)]
    log = open(out.with_suffix(".log"), "wb")
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "ops.launch", str(config), "--out", str(out), "--nats-url", url, *only],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "COLUMNS": "200"},
            start_new_session=True,
        )
    finally:
        log.close()


async def first_finish(url: str, timeout_wall_s: float, tls: TlsFiles | None = None) -> None:
    """Return when a trajectory has finished (a lifecycle 'finished' event on the bus)."""
    nc = await connect(url, "cluster-check", LOG, tls=tls)
    try:
        finished = asyncio.Event()

        async def on_finished(_msg) -> None:
            finished.set()

        await nc.subscribe(subjects.lifecycle("finished"), cb=on_finished)
        await nc.flush()
        await asyncio.wait_for(finished.wait(), timeout_wall_s)
    finally:
        await close(nc)


def wait_all(launchers: dict[str, subprocess.Popen], deadline: float) -> dict[str, int]:
    """Each launcher's exit code by `deadline`. Those still running then get SIGTERM together
    (each stops its actors, waits for the other host's reports and exports), and SIGKILL to
    their whole session STOP_GRACE_WALL_S later."""
    codes: dict[str, int] = {}
    for name, proc in launchers.items():
        try:
            codes[name] = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    late = {name: proc for name, proc in launchers.items() if name not in codes}
    for proc in late.values():
        proc.terminate()
    grace_deadline = time.monotonic() + STOP_GRACE_WALL_S
    for name, proc in late.items():
        try:
            codes[name] = proc.wait(timeout=max(0.1, grace_deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            codes[name] = proc.wait()
    return {name: codes[name] for name in launchers}


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    return path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else ["(no log)"]


def run_check(
    out: Path,
    steps: int,
    time_scale: float,
    kill: bool,
    policy: str = "colocated",
    first_finish_timeout_wall_s: float = FIRST_FINISH_TIMEOUT_WALL_S,
    run_timeout_wall_s: float = RUN_TIMEOUT_WALL_S,
    tls: bool = False,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = out / "cluster-check.toml"
    started = time.monotonic()
    with LocalCluster(out / "cluster", tls=tls) as cluster:
        files = cluster.client_tls
        write_config(config, cluster, time.strftime("%Y%m%d-%H%M%S"), time_scale, steps, policy)
        print(f"cluster: {cluster.seed_url}", flush=True)
        engines = start_launcher(config, out / "engines", cluster.urls[KILLED], ["engines"])
        control = start_launcher(config, out / "control", cluster.urls[0], ["control", "environments"])
        killed: list[str] = []
        stalled = False
        try:
            asyncio.run(first_finish(cluster.urls[2], first_finish_timeout_wall_s, files))
            if kill:
                pid = cluster.kill(KILLED)
                killed.append(f"n{KILLED}")
                print(f"killed server n{KILLED} (pid {pid}) at {time.monotonic() - started:.1f} s", flush=True)
        except TimeoutError:
            stalled = True
            print(f"no trajectory finished within {first_finish_timeout_wall_s} s: stopping both launchers", flush=True)
        finally:
            deadline = time.monotonic() + (0.0 if stalled else run_timeout_wall_s)
            codes = wait_all({"control": control, "engines": engines}, deadline)
    summary = control_summary(out)
    engines_path = out / "engines" / "summary.json"
    engines_host = json.loads(engines_path.read_text()) if engines_path.exists() else {}
    summary |= {
        "servers_killed": killed,
        "launcher_exit_codes": codes,
        "engines_host_restarts": engines_host.get("restarts", {}),  # the control host's are in "restarts"
        "check_wall_s": round(time.monotonic() - started, 2),
    }
    if stalled:
        summary["status"] = f"no trajectory finished within {first_finish_timeout_wall_s} s"
    if not passed(summary):  # what each host printed, so a failure explains itself
        summary["launcher_log_tails"] = {name: tail(out / f"{name}.log") for name in ("control", "engines")}
        summary["actor_log_tails"] = {f"{log.parent.parent.name}/{log.name}": tail(log, 10) for log in sorted(out.glob("*/logs/*.log"))}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def passed(summary: dict) -> bool:
    return (
        summary["status"] == "completed"
        and summary["trajectories_lost"] == 0
        and summary["lifecycle_events_missing"] == 0
        and summary["incomplete_trajectories"] == 0
        and all(code == 0 for code in summary["launcher_exit_codes"].values())
    )


CAPACITY_EVENTS = 4000
CAPACITY_EVENT_BYTES = 300  # about one lifecycle event
CAPACITY_CHUNKS = 24
CAPACITY_CHUNK_BYTES = 1 << 20  # a KV hand-off chunk


async def cluster_capacity(url: str) -> dict:
    """Acked publishes per second on an R3 file stream of this cluster."""
    from nats.js import api

    nc = await connect(url, "capacity", LOG)
    js = nc.jetstream(timeout=30)
    await js.add_stream(api.StreamConfig(name="CAPACITY", subjects=["capacity.>"], num_replicas=3, storage=api.StorageType.FILE))
    try:
        figures = {}
        for name, count, size in (("events", CAPACITY_EVENTS, CAPACITY_EVENT_BYTES), ("chunks", CAPACITY_CHUNKS, CAPACITY_CHUNK_BYTES)):
            payload = os.urandom(size)
            t0 = time.perf_counter()
            futures = [await js.publish_async(f"capacity.{name}", payload) for _ in range(count)]
            await asyncio.gather(*futures)
            wall_s = time.perf_counter() - t0
            figures[name] = {
                "count": count,
                "bytes_each": size,
                "msgs_per_s": round(count / wall_s),
                "mb_per_s": round(count * size / wall_s / 1e6, 1),
            }
        return figures
    finally:
        await js.delete_stream("CAPACITY")
        await close(nc)


def subject_class(subject: str) -> str:
    """prorsa.work.prefill.e3 -> prorsa.work.prefill; per-actor and per-kind families -> .*"""
    tokens = subject.split(".")
    if subject.startswith(("_INBOX", "$JS")):
        return "replies and JetStream API"
    if tokens[1] in ("result", "report", "status", "lc", "dead", "kv"):
        return ".".join(tokens[:2]) + ".*"
    return ".".join(tokens[:3])


def fleet_traffic(sim_config: Path, out: Path) -> dict:
    """One simulated step of `sim_config`, every publish on the in-process bus counted."""
    import msgspec

    from actors.base import inproc
    from actors.config import load_config
    from runners import simulate

    counts: dict[str, list[int]] = {}

    def counted(publish):
        async def wrapper(self, subject: str, payload: bytes = b"", *args, **kwargs):
            entry = counts.setdefault(subject_class(subject), [0, 0])
            entry[0] += 1
            entry[1] += len(payload)
            return await publish(self, subject, payload, *args, **kwargs)

        return wrapper

    config = load_config(sim_config)
    config = msgspec.structs.replace(config, trainer=msgspec.structs.replace(config.trainer, steps=1))
    originals = inproc.InProcClient.publish, inproc.InProcJetStream.publish
    inproc.InProcClient.publish, inproc.InProcJetStream.publish = counted(originals[0]), counted(originals[1])
    try:
        summary = simulate.run(config, out / "sim", show_progress=False)
    finally:
        inproc.InProcClient.publish, inproc.InProcJetStream.publish = originals
    model_s = sum(step["rollout_s"] + step["train_s"] for step in summary["steps"])
    engines = config.engines.count
    per_subject = {
        subject: {"msgs_per_model_s_per_engine": n / model_s / engines, "bytes_per_model_s_per_engine": b / model_s / engines}
        for subject, (n, b) in sorted(counts.items(), key=lambda kv: -kv[1][1])
    }
    return {"config": str(sim_config), "engines": engines, "model_s": round(model_s, 1), "per_subject": per_subject}


def capacity(out: Path, sim_config: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with LocalCluster(out / "cluster", sync_interval="always") as cluster:
        result = {"cluster_r3": asyncio.run(cluster_capacity(cluster.seed_url))}
    result["fleet"] = fleet_traffic(sim_config, out)
    (out / "capacity.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.cluster_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--time-scale", type=float, default=50.0)
    parser.add_argument("--no-kill", action="store_true", help="the same run without killing a server")
    parser.add_argument(
        "--policy", default="colocated", help="run.policy (prorsa: the allocator on the control host switches the other host's engines)"
    )
    parser.add_argument("--tls", action="store_true", help="clients and routes over TLS (a local CA), the run with [bus] tls = 'on'")
    parser.add_argument("--capacity", action="store_true", help="measure the cluster's capacity and a fleet's traffic instead")
    parser.add_argument("--sim-config", type=Path, default=REPO / "configs" / "sim-swe-64.toml")
    args = parser.parse_args(argv)
    if args.capacity:
        result = capacity(args.out, args.sim_config)
        print(json.dumps(result["cluster_r3"]), flush=True)
        print(f"wrote {args.out / 'capacity.json'}", flush=True)
        return 0
    summary = run_check(args.out, args.steps, args.time_scale, kill=not args.no_kill, policy=args.policy, tls=args.tls)
    ok = summary.get("status") == "completed" and passed(summary)
    print(
        f"{'passed' if ok else 'FAILED'}: {summary.get('status')}, servers killed {summary['servers_killed']}, "
        f"finished {summary.get('trajectories_finished')}/{summary.get('trajectories_expected')}, "
        f"lost {summary.get('trajectories_lost')}, lifecycle events missing {summary['lifecycle_events_missing']}, "
        f"exit codes {summary['launcher_exit_codes']}, {summary['check_wall_s']} s; wrote {args.out / 'summary.json'}",
        flush=True,
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
