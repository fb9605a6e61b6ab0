"""Launch a Prorsa run: one process per actor, over an embedded (or given) NATS server.

    python -m ops.launch CONFIG.toml [--policy colocated|colocated-sticky|static|static-P:D|reactive|prorsa|oracle] [--out DIR] [--nats-url URL]
        [--on-actor-death abort|restart]

1. Validate the config (a typo fails here, before anything starts).
2. Start an embedded nats-server under DIR (unless --nats-url), bound to 127.0.0.1 and
   requiring a password: one user per actor, permissions per role (`ops/access.py`), the
   credentials in DIR/credentials/ (mode 0600) and the monitor's in DIR/bus.json. Create the
   streams, set the run's time origin.
3. Spawn every actor as `python -m actors.<kind> --config DIR/config.json --id <id>`; each
   dies with the launcher (PR_SET_PDEATHSIG), and each can be started by hand the same way.
4. Watch: the run ends when the trainer finishes its steps. An actor that dies first is
   reported (which one, its exit code, the end of its log) and, under `run.on_actor_death =
   "restart"` (the default), started again after a backoff, a bounded number of times
   (counted in the summary); under "abort", or once it has used its restarts, or for the
   trainer, it stops the run with exit 1. The embedded nats-server is watched the same way
   and restarted on its port and store. (`ops/supervise.py`)
5. Stop every actor with SIGTERM (SIGKILL after a grace period), export the lifecycle log
   to DIR/events.parquet and write DIR/summary.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from rich.console import Console

from actors.base.connection import close, connect, publish_origin
from actors.config import POLICIES, Config, ConfigError, initial_roles, load_config, with_policy
from bus_schemas import streams
from ops import access
from ops.export import read_run, write_run
from ops.bus_guard import read_dead_letters
from ops.natsserver import EmbeddedNats
from ops.procs import Supervision, die_with_parent
from ops.supervise import STOP_GRACE_WALL_S, stop_all, supervise

REPO_ROOT = Path(__file__).resolve().parent.parent
LOG = logging.getLogger("prorsa.launch")
console = Console(stderr=True)


@dataclass(frozen=True, slots=True)
class Bus:
    """Where the run's bus is, and (embedded server) every user's credentials."""

    url: str
    users: dict[str, access.User] | None = None  # None: a server we did not start (credentials from the environment)

    async def connect(self, name: str):
        launcher = self.users[access.LAUNCHER] if self.users else None
        return await connect(self.url, name, LOG, user=launcher and launcher.name, password=launcher and launcher.password)

    def actor_env(self, spec: ActorSpec) -> dict[str, str]:
        return access.actor_env(self.users[access.user_name(spec.kind, spec.actor_id)]) if self.users else {}


@dataclass(frozen=True, slots=True)
class ActorSpec:
    kind: str  # engine | environment | trainer
    actor_id: str
    extra: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.kind} {self.actor_id}"


def actor_specs(config: Config) -> list[ActorSpec]:
    roles = initial_roles(config)
    check_real_tasks(config)
    specs = [ActorSpec("engine", e, ("--role", roles[e].value)) for e in config.engine_ids()]
    specs += [ActorSpec("environment", env) for env in config.env_ids()]
    if config.runs_forecaster:
        specs.append(ActorSpec("forecaster", "forecaster"))
    if config.runs_allocator:
        specs.append(ActorSpec("allocator", "allocator"))
    specs.append(ActorSpec("trainer", "trainer"))
    return specs


def check_real_tasks(config: Config) -> None:
    """The torch backend runs real tasks only (actors/environment/tasks.py)."""
    if config.engines.backend != "torch":
        return
    from actors.environment.tasks import TASKS

    wl = config.workload
    families = {f for mix in [wl.mix, *(p.mix for p in wl.phases)] for f, share in mix.items() if share > 0}
    if families - set(TASKS):
        raise ConfigError(
            f"engines.backend = 'torch' runs real tasks only: {', '.join(sorted(families - set(TASKS)))} "
            f"in workload.mix is modelled (real tasks: {', '.join(sorted(TASKS))})"
        )


def prepare_model(config: Config, out: Path) -> Config:
    """torch backend without a checkpoint: build the tiny model once into DIR/model, so every
    process loads identical weights, and point the run's config at it."""
    if config.engines.backend != "torch" or config.model.checkpoint:
        return config
    from actors.engine.torch.model import build_tiny  # late: emulated runs never import torch

    path = build_tiny(config.model, out / "model")
    console.print(f"built the tiny {config.model.architecture} model into {path}", highlight=False)
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, checkpoint=str(path.resolve())))


def lifecycle_limits(config: Config) -> streams.LifecycleLimits:
    bus = config.bus
    return streams.LifecycleLimits(storage=bus.storage, max_bytes=bus.lifecycle_max_bytes, max_msgs=bus.lifecycle_max_msgs)


async def prepare_bus(bus: Bus, config: Config, shared_server: bool) -> None:
    nc = await bus.connect("launcher")
    try:
        js = nc.jetstream()
        await streams.ensure_streams(js, lifecycle_limits(config))
        if shared_server:  # a server we did not start may hold an earlier run
            for stream in streams.ALL_STREAMS:
                await js.purge_stream(stream.name)
        await publish_origin(js, config.run.name)
    finally:
        await close(nc)


async def spawn(spec: ActorSpec, config_path: Path, bus: Bus, logs: Path) -> asyncio.subprocess.Process:
    log = open(logs / f"{spec.kind}-{spec.actor_id}.log", "ab")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])), **bus.actor_env(spec)}
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", f"actors.{spec.kind}", "--config", str(config_path), "--id", spec.actor_id,
            "--nats-url", bus.url, *spec.extra,
            stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT,
            env=env, preexec_fn=die_with_parent,
        )  # fmt: skip
    finally:
        log.close()


async def export(bus: Bus, out: Path, config: Config, status: str, wall_s: float, killed: list[str], supervision: Supervision, notes: dict) -> dict:
    nc = await bus.connect("launcher-export")
    try:
        record = await read_run(nc.jetstream())
        dead_letters = await read_dead_letters(nc.jetstream())
    finally:
        await close(nc)
    summary = write_run(record, out, config, status, wall_s, console)
    summary["killed_at_stop"] = killed
    summary["on_actor_death"] = supervision.mode
    summary["restarts"] = dict(supervision.restarts)  # actor name -> times restarted
    summary["actor_deaths"] = supervision.deaths  # every death: actor, exit code, wall s into the run, restarted
    summary["dead_letters"] = len(dead_letters)  # poison work moved to prorsa.dead.<stream>
    summary["dead_letter_reasons"] = dead_letters
    summary["lifecycle_alerts"] = notes.get("lifecycle_alerts", [])
    summary["publish_failures"] = sum(c.get("publish_failures", 0) for c in summary["actors"].values())
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def print_summary(summary: dict, out: Path) -> None:
    console.print(
        f"[bold]{summary['status']}[/bold]: policy={summary['policy']} backend={summary['backend']} "
        f"finished {summary['trajectories_finished']}/{summary['trajectories_expected']} trajectories, "
        f"lost {summary['trajectories_lost']}, invalid messages {summary['invalid_messages']}, "
        f"{summary['events']} events, {summary['wall_s']} s wall"
    )
    if summary["dead_letters"]:
        console.print(f"  [red]dead letters: {summary['dead_letters']}[/red] (prorsa.dead.<stream>; reasons in summary.json)")
    if summary["restarts"]:
        console.print("  restarted: " + ", ".join(f"{name} x{n}" for name, n in summary["restarts"].items()), highlight=False)
    for s in summary["steps"]:
        console.print(
            f"  step {s['step']}: rollout {s['rollout_s']:.1f} s (model), {s['trajectories']} trajectories, "
            f"prefill {s['prefill_tokens']} tok, decode {s['decode_tokens']} tok, reward {s['mean_reward']:.2f}"
        )
    console.print(f"  wrote {out / 'summary.json'} and {out / 'events.parquet'}")


BUS_FILE = "bus.json"  # the run folder's bus address: {"url": ...}, with the monitor's "user" and "password"


def write_bus_file(out: Path, bus: Bus) -> None:
    """DIR/bus.json: where `ops.monitor --run DIR` connects, as the read-only monitor user
    (mode 0600: it holds a password); the credentials of every user go to DIR/credentials/."""
    record = {"url": bus.url}
    if bus.users:
        access.write_credentials(out / "credentials", bus.users)
        monitor = bus.users[access.MONITOR]
        record |= {"user": monitor.name, "password": monitor.password}
    path = out / BUS_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")
    os.chmod(path, 0o600)


async def launch(config: Config, out: Path, nats_url: str | None) -> int:
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    config_path = out / "config.json"
    config = prepare_model(config, out)
    config_path.write_bytes(msgspec.json.format(msgspec.json.encode(config)))
    if not nats_url and (out / "nats").exists():  # the folder held an earlier run: start clean
        console.print(f"replacing the earlier run in {out}", highlight=False)
        shutil.rmtree(out / "nats")
    users = None if nats_url else access.make_users([(spec.kind, spec.actor_id) for spec in actor_specs(config)])
    server = None if nats_url else EmbeddedNats(out / "nats", sync_interval=config.bus.sync_interval, authorization=access.authorization_block(users))
    procs: dict[ActorSpec, asyncio.subprocess.Process] = {}
    started = time.monotonic()
    interrupted = asyncio.Event()  # Ctrl-C or SIGTERM, at any moment from here on
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)
    status = "interrupted"
    try:
        bus = Bus(nats_url or server.start(), users)
        if server is not None:
            console.print(f"started nats-server pid {server.proc.pid} at {bus.url}", highlight=False)
        await prepare_bus(bus, config, shared_server=nats_url is not None)
        write_bus_file(out, bus)
        console.print(f"bus: {bus.url} (watch: python -m ops.monitor --run {out})", highlight=False)
        for spec in actor_specs(config):
            if interrupted.is_set():
                break
            procs[spec] = await spawn(spec, config_path, bus, logs)
            console.print(f"started {spec.name} pid {procs[spec].pid}", highlight=False)
        rc = config.run
        supervision = Supervision(rc.on_actor_death, rc.max_restarts, rc.restart_backoff_wall_s)
        notes: dict = {}
        if not interrupted.is_set():
            respawn = lambda spec: spawn(spec, config_path, bus, logs)  # noqa: E731
            status = await supervise(procs, logs, bus, config.trajectories_expected(), interrupted, supervision, respawn, notes, server)
        killed = await stop_all(procs)
        for name in killed:
            console.print(f"[red]error: {name} did not stop within {STOP_GRACE_WALL_S} s and was killed")
        if server is not None and server.proc.poll() is not None:  # died and not restarted: its store still holds the log
            await asyncio.to_thread(server.start)
        summary = await export(bus, out, config, status, time.monotonic() - started, killed, supervision, notes)
        print_summary(summary, out)
    finally:
        await stop_all(procs)
        if server is not None:
            server.stop()
    if status == "interrupted":
        return 130
    return 0 if status == "completed" and not killed else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--policy", metavar="POLICY", help=f"overrides run.policy: {', '.join(POLICIES)}, or static-P:D")
    parser.add_argument("--out", type=Path, help="run folder (default runs/<name>-<policy>-<time>)")
    parser.add_argument("--nats-url", help="use this NATS server instead of an embedded one")
    parser.add_argument("--on-actor-death", choices=["abort", "restart"], help="overrides run.on_actor_death")
    args = parser.parse_args(argv)
    try:
        config = with_policy(load_config(args.config), args.policy)
        if args.on_actor_death:
            config = msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, on_actor_death=args.on_actor_death))
        actor_specs(config)  # policy-level checks (e.g. a static split with no decode engine)
    except ConfigError as err:
        console.print(f"error: {err}", highlight=False, markup=False)
        return 2
    out = args.out or Path("runs") / f"{config.run.name}-{config.run.policy}-{time.strftime('%Y%m%d-%H%M%S')}"
    return asyncio.run(launch(config, out, args.nats_url))


if __name__ == "__main__":
    sys.exit(main())
