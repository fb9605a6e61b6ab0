"""Launch a Prorsa run: one process per actor, over an embedded (or given) NATS server.

    python -m ops.launch CONFIG.toml [--policy colocated|colocated-sticky|static|static-P:D|reactive|prorsa|oracle] [--out DIR] [--nats-url URL]
        [--on-actor-death abort|restart] [--only GROUP ...]

One run over several hosts: each host runs `--only GROUP` (engines, engines:e0-e3, environments,
environments:env0-env1, control = trainer + forecaster + allocator; repeatable) with
`--nats-url` the cluster's seed URLs, comma-separated. The host that starts `control` does
steps 2 and 5 (streams, origin, export); the others wait for the run to exist, serve, and stop
when the control host announces its end (`ops/cluster.py`; docs/deploy.md).

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
import shlex
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
from rich.console import Console

from actors.base.connection import BUS_ERRORS, TlsFiles, close, connect, publish_origin
from actors.config import POLICIES, Config, ConfigError, initial_roles, load_config, with_policy
from bus_schemas import streams
from ops import access
from ops.bus_guard import read_dead_letters
from ops.cluster import announce_end, wait_for_reports, wait_for_run, watch_end
from ops.export import DecisionRecorder, read_run, write_run
from ops.natsserver import EmbeddedNats
from ops.procs import Supervision, die_with_parent
from ops.supervise import STOP_GRACE_WALL_S, stop_all, supervise
from ops.tls import make_local_pki

REPO_ROOT = Path(__file__).resolve().parent.parent
LOG = logging.getLogger("prorsa.launch")
console = Console(stderr=True)


@dataclass(frozen=True, slots=True)
class Bus:
    """Where the run's bus is, and (embedded server) every user's credentials."""

    url: str
    users: dict[str, access.User] | None = None  # None: a server we did not start (credentials from the environment)
    tls: TlsFiles | None = None  # what every client trusts and shows ([bus] tls); None: plaintext

    async def connect(self, name: str):
        launcher = self.users[access.LAUNCHER] if self.users else None
        return await connect(self.url, name, LOG, user=launcher and launcher.name, password=launcher and launcher.password, tls=self.tls)

    def actor_env(self, spec: ActorSpec) -> dict[str, str]:
        env = access.actor_env(self.users[access.user_name(spec.kind, spec.actor_id)]) if self.users else {}
        return env | (self.tls.env() if self.tls else {})


@dataclass(frozen=True, slots=True)
class ActorSpec:
    kind: str  # engine | environment | trainer
    actor_id: str
    extra: tuple[str, ...] = ()
    module: str = ""  # the process's `python -m` module; empty: actors.<kind>

    @property
    def name(self) -> str:
        return f"{self.kind} {self.actor_id}"

    @property
    def main_module(self) -> str:
        return self.module or f"actors.{self.kind}"


def actor_specs(config: Config) -> list[ActorSpec]:
    roles = initial_roles(config)
    check_real_tasks(config)
    specs = [ActorSpec("engine", e, ("--role", roles[e].value)) for e in config.engine_ids()]
    env_module = "ops.gateway" if config.gateway.enabled else ""  # each environment serves the OpenAI API
    specs += [ActorSpec("environment", env, module=env_module) for env in config.env_ids()]
    if config.runs_forecaster:
        specs.append(ActorSpec("forecaster", "forecaster"))
    if config.runs_allocator:
        specs.append(ActorSpec("allocator", "allocator"))
    specs.append(ActorSpec("trainer", "trainer"))
    if config.trainer.update == "external":  # the user's trainer, beside ours
        specs.append(ActorSpec("updater", "updater", module=config.trainer.update_module))
    return specs


CONTROL_KINDS = ("trainer", "forecaster", "allocator", "updater")
GROUP_KINDS = {"engines": "engine", "environments": "environment"}


def select_actors(specs: list[ActorSpec], groups: list[str]) -> list[ActorSpec]:
    """The actors `--only` names: `control`, `engines`, `environments`, or one id or an
    inclusive range of ids of a group (`engines:e2`, `engines:e0-e3`)."""
    chosen: list[ActorSpec] = []
    for group in groups:
        name, _, ids = group.partition(":")
        if name == "control" and not ids:
            picked = [s for s in specs if s.kind in CONTROL_KINDS]
        elif name in GROUP_KINDS:
            picked = [s for s in specs if s.kind == GROUP_KINDS[name]]
            if ids:
                names = [s.actor_id for s in picked]
                first, _, last = ids.partition("-")
                if first not in names or (last or first) not in names or names.index(last or first) < names.index(first):
                    raise ConfigError(f"--only {group}: not an id or a range of ids among {name} {names[0]}..{names[-1]}")
                picked = picked[names.index(first) : names.index(last or first) + 1]
        else:
            raise ConfigError(f"--only {group}: not a group (control, engines[:ID[-ID]], environments[:ID[-ID]])")
        chosen += [s for s in picked if s not in chosen]
    return chosen


def check_real_tasks(config: Config) -> None:
    """The real-compute backends (torch, vllm) run environments (actors/environment/envs/, or
    `environments.entrypoint`, imported here so a bad one fails before anything starts); the
    emulated backend runs modelled families only. vllm's tiny model (built when no checkpoint
    is given) needs a head size vLLM's CPU attention takes, and its [vllm] section what this
    host has (`check_config`: NIXL, TP)."""
    entrypoint = config.environments.entrypoint
    if config.gateway.enabled:  # outside harnesses drive every trajectory, whatever its family
        return
    if config.engines.backend not in ("torch", "vllm"):
        if entrypoint:
            raise ConfigError(
                f"environments.entrypoint runs on real backends (torch, vllm), not engines.backend = '{config.engines.backend}'"
            )
        return
    mc = config.model
    if config.engines.backend == "vllm" and not (mc.checkpoint or config.vllm.model) and mc.hidden_size // mc.heads < 32:
        raise ConfigError(
            f"engines.backend = 'vllm' needs a head size >= 32 (model.hidden_size / model.heads = {mc.hidden_size // mc.heads})"
        )
    if config.engines.backend == "vllm":  # NIXL or TP this host cannot run: one line before any engine starts
        from actors.engine.vllm.engine import check_config

        check_config(config.vllm)
    from actors.environment.envs import BUILTIN, entrypoint_for
    from actors.environment.interface import EntrypointError, load_class

    wl = config.workload
    families = {f for mix in [wl.mix, *(p.mix for p in wl.phases)] for f, share in mix.items() if share > 0}
    unknown = sorted(f for f in families if entrypoint_for(f, entrypoint) is None)
    if unknown:
        raise ConfigError(
            f"engines.backend = '{config.engines.backend}' runs environments: {', '.join(unknown)} in workload.mix is modelled "
            f"(built-in environments: {', '.join(sorted(BUILTIN))}; or set environments.entrypoint)"
        )
    for target in sorted({entrypoint_for(f, entrypoint) for f in families}):
        try:
            load_class(target)
        except EntrypointError as e:
            raise ConfigError(str(e)) from None


def prepare_model(config: Config, out: Path) -> Config:
    """torch or vllm backend without a checkpoint: build the tiny model once into DIR/model, so
    every process loads identical weights, and point the run's config at it. For vllm it is
    untied (vLLM's in-place weight reload needs that)."""
    backend, mc = config.engines.backend, config.model
    if backend not in ("torch", "vllm") or mc.checkpoint:
        return config
    if backend == "vllm" and config.vllm.model:  # the trainer and environments load the engines' checkpoint
        return msgspec.structs.replace(config, model=msgspec.structs.replace(mc, checkpoint=config.vllm.model))
    from actors.engine.torch.model import build_tiny  # late: emulated runs never import torch

    path = build_tiny(mc, out / "model", tie_embeddings=backend == "torch")
    console.print(f"built the tiny {config.model.architecture} model into {path}", highlight=False)
    return msgspec.structs.replace(config, model=msgspec.structs.replace(config.model, checkpoint=str(path.resolve())))


def lifecycle_limits(config: Config) -> streams.LifecycleLimits:
    bus = config.bus
    return streams.LifecycleLimits(storage=bus.storage, max_bytes=bus.lifecycle_max_bytes, max_msgs=bus.lifecycle_max_msgs)


async def prepare_bus(bus: Bus, config: Config, shared_server: bool):
    """Create the streams (`[bus] replicas` each), empty them on a shared server, set the origin."""
    nc = await bus.connect("launcher")
    try:
        js = nc.jetstream()
        await streams.ensure_streams(js, lifecycle_limits(config), config.bus.replicas)
        if shared_server:  # a server we did not start may hold an earlier run
            for stream in streams.ALL_STREAMS:
                await js.purge_stream(stream.name)
        return await publish_origin(js, config.run.name, replicas=config.bus.replicas)
    finally:
        await close(nc)


async def spawn(spec: ActorSpec, config_path: Path, bus: Bus, logs: Path) -> asyncio.subprocess.Process:
    log = open(logs / f"{spec.kind}-{spec.actor_id}.log", "ab")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])), **bus.actor_env(spec)}
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            spec.main_module,
            "--config",
            str(config_path),
            "--id",
            spec.actor_id,
            "--nats-url",
            bus.url,
            *spec.extra,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=log,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            preexec_fn=die_with_parent,
        )
    finally:
        log.close()


async def export(
    bus: Bus, out: Path, config: Config, status: str, wall_s: float, killed: list[str], supervision: Supervision, notes: dict
) -> dict:
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
    console.print(f"  run folder: {out}  (report: python -m ops.report {shlex.quote(str(out))})", highlight=False)


BUS_FILE = "bus.json"  # the run folder's bus address: {"url": ...}, with the monitor's "user" and "password"


def write_bus_file(out: Path, bus: Bus) -> None:
    """DIR/bus.json: where `ops.monitor --run DIR` connects, as the read-only monitor user
    (mode 0600: it holds a password); the credentials of every user go to DIR/credentials/."""
    record = {"url": bus.url}
    if bus.tls:
        record |= {"tls_ca": bus.tls.ca, "tls_cert": bus.tls.cert, "tls_key": bus.tls.key}
    if bus.users:
        access.write_credentials(out / "credentials", bus.users)
        monitor = bus.users[access.MONITOR]
        record |= {"user": monitor.name, "password": monitor.password}
    path = out / BUS_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(record) + "\n")
    os.chmod(path, 0o600)


async def launch(config: Config, out: Path, nats_url: str | None, only: list[str] | None = None) -> int:
    """Run every actor (or, with `only`, this host's share of a run on the cluster at `nats_url`)."""
    specs = actor_specs(config)
    mine = select_actors(specs, only) if only else specs
    control = any(spec.kind == "trainer" for spec in mine)  # this host creates, ends and exports the run
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    config_path = out / "config.json"
    config = prepare_model(config, out)
    config_path.write_bytes(msgspec.json.format(msgspec.json.encode(config)))
    if not nats_url and (out / "nats").exists():  # the folder held an earlier run: start clean
        console.print(f"replacing the earlier run in {out}", highlight=False)
        shutil.rmtree(out / "nats")
    users = None if nats_url else access.make_users([(spec.kind, spec.actor_id) for spec in specs])
    pki = make_local_pki(out / "tls") if config.bus.tls == "local" else None
    server = (
        None
        if nats_url
        else EmbeddedNats(
            out / "nats",
            sync_interval=config.bus.sync_interval,
            authorization=access.authorization_block(users),
            tls=pki and pki.server,
        )
    )
    tls = pki.client if pki else client_tls(config)
    procs: dict[ActorSpec, asyncio.subprocess.Process] = {}
    started = time.monotonic()
    interrupted = asyncio.Event()  # Ctrl-C or SIGTERM, at any moment from here on
    stop = asyncio.Event()  # interrupted, or (a host without control) the run ended elsewhere
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: (interrupted.set(), stop.set()))
    loop.add_signal_handler(signal.SIGUSR1, dump_tasks)  # `kill -USR1 <launcher>`: what is it waiting for?
    status = "interrupted"
    join = ender = None  # a host of a run over several hosts: its connection, the watch for the end
    recording = None  # the control host's connection that records decisions and forecasts
    recorder = DecisionRecorder()
    try:
        bus = Bus(nats_url or server.start(), users, tls)
        if server is not None:
            console.print(f"started nats-server pid {server.proc.pid} at {bus.url}", highlight=False)
        join = await bus.connect("launcher-join") if only else None
        if control:
            try:
                origin = await prepare_bus(bus, config, shared_server=nats_url is not None)
            except BUS_ERRORS as err:  # the other hosts keep waiting for the run: say so
                console.print(f"error: could not create run {config.run.name!r} on {bus.url} (no actor started): {err!r}", highlight=False)
                return 1
        else:
            console.print(f"waiting for run {config.run.name!r} on {bus.url}", highlight=False)
            origin = await wait_for_run(join.jetstream(), config.run.name, stop)
            if origin is None:  # interrupted while waiting
                return 130
            ender = asyncio.create_task(watch_end(join.jetstream(), origin, stop))
            ender.add_done_callback(lambda _: stop.set())
        write_bus_file(out, bus)
        if control:
            recording = await bus.connect("launcher-record")
            await recorder.start(recording)
        console.print(f"bus: {bus.url} (watch: python -m ops.monitor --run {out})", highlight=False)
        for spec in mine:
            if stop.is_set():
                break
            procs[spec] = await spawn(spec, config_path, bus, logs)
            console.print(f"started {spec.name} pid {procs[spec].pid}", highlight=False)
        rc = config.run
        supervision = Supervision(rc.on_actor_death, rc.max_restarts, rc.restart_backoff_wall_s)
        notes: dict = {}
        if not stop.is_set():
            respawn = lambda spec: spawn(spec, config_path, bus, logs)
            status = await supervise(procs, logs, bus, config.trajectories_expected(), stop, supervision, respawn, notes, server)
        if ender is not None and ender.done() and ender.result() is not None:
            status = ender.result()  # the control host's word on the run
            console.print(f"the control host ended the run: {status}", highlight=False)
        if control and only:  # the other hosts stop their actors now, in parallel with ours
            await announce_end(join.jetstream(), origin, status)
        killed = await stop_all(procs)
        for name in killed:
            console.print(f"[red]error: {name} did not stop within {STOP_GRACE_WALL_S} s and was killed")
        if not control:
            write_host_summary(out, status, mine, killed, supervision)
        else:
            if server is not None and server.proc.poll() is not None:  # died and not restarted: its store still holds the log
                await asyncio.to_thread(server.start)
            others = [spec.actor_id for spec in specs if spec not in mine]
            missing = await wait_for_reports(join.jetstream(), others, STOP_GRACE_WALL_S + 30.0) if others else []
            if missing:
                console.print(f"[red]error: no final report from {', '.join(missing)}", highlight=False)
            summary = await export(bus, out, config, status, time.monotonic() - started, killed, supervision, notes)
            recorder.write(out)
            print_summary(summary, out)
    finally:
        if ender is not None:
            stop.set()
            await asyncio.gather(ender, return_exceptions=True)
        for nc in (join, recording):
            if nc is not None:
                await close(nc)
        await stop_all(procs)
        if server is not None:
            server.stop()
    if status == "interrupted":
        return 130
    return 0 if status == "completed" and not killed else 1


def client_tls(config: Config) -> TlsFiles | None:
    """The clients' TLS files given in [bus] (tls = "on"), or None."""
    bus = config.bus
    return TlsFiles(bus.tls_ca, bus.tls_cert, bus.tls_key) if bus.tls == "on" else None


def check_bus(config: Config, nats_url: str | None) -> None:
    """ConfigError (one line) where [bus] tls does not fit where the bus is: "local" makes the
    embedded server's certificates, "on" trusts a server given with --nats-url."""
    if config.bus.tls == "local" and nats_url:
        raise ConfigError("bus.tls = 'local' makes the embedded server's certificates; for a server given with --nats-url use 'on'")
    if config.bus.tls == "on" and not nats_url:
        raise ConfigError("bus.tls = 'on' trusts a server given with --nats-url; the embedded server makes its own with 'local'")
    for path in filter(None, (config.bus.tls_ca, config.bus.tls_cert, config.bus.tls_key)):
        if not Path(path).is_file():
            raise ConfigError(f"bus TLS file {path!r}: no such file")


def dump_tasks() -> None:
    """Every asyncio task's stack, on stderr: what a launcher that seems stuck awaits."""
    for task in asyncio.all_tasks():
        print(f"--- task {task.get_name()}", file=sys.stderr, flush=True)
        task.print_stack(file=sys.stderr)


def write_host_summary(out: Path, status: str, mine: list[ActorSpec], killed: list[str], supervision: Supervision) -> None:
    """A host without control: what ran here (the run's summary is the control host's)."""
    summary = {
        "status": status,
        "actors": [spec.name for spec in mine],
        "killed_at_stop": killed,
        "restarts": dict(supervision.restarts),
        "actor_deaths": supervision.deaths,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"[bold]{status}[/bold]: {len(mine)} actors on this host; wrote {out / 'summary.json'}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.launch", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--policy", metavar="POLICY", help=f"overrides run.policy: {', '.join(POLICIES)}, or static-P:D")
    parser.add_argument("--out", type=Path, help="run folder (default runs/<name>-<policy>-<time>)")
    parser.add_argument("--nats-url", help="use this NATS server instead of an embedded one")
    parser.add_argument("--on-actor-death", choices=["abort", "restart"], help="overrides run.on_actor_death")
    parser.add_argument(
        "--only",
        action="append",
        metavar="GROUP",
        help="run only these actors of a run on --nats-url: control, engines[:ID[-ID]], environments[:ID[-ID]] (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.only and not args.nats_url:
        console.print("error: --only joins a run on an external NATS cluster: give --nats-url", highlight=False)
        return 2
    try:
        config = with_policy(load_config(args.config), args.policy)
        if args.on_actor_death:
            config = msgspec.structs.replace(config, run=msgspec.structs.replace(config.run, on_actor_death=args.on_actor_death))
        specs = actor_specs(config)  # policy-level checks (e.g. a static split with no decode engine)
        check_bus(config, args.nats_url)
        if args.only and not select_actors(specs, args.only):
            raise ConfigError(f"--only {' '.join(args.only)}: no actor of this run")
    except ConfigError as err:
        console.print(f"error: {err}", highlight=False, markup=False)
        return 2
    out = args.out or Path("runs") / f"{config.run.name}-{config.run.policy}-{time.strftime('%Y%m%d-%H%M%S')}"
    return asyncio.run(launch(config, out, args.nats_url, args.only))


if __name__ == "__main__":
    sys.exit(main())
