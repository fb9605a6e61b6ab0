"""Run every actor of a config in one process, on the in-process bus, in virtual time.

    python -m runners.simulate CONFIG.toml [--policy colocated|colocated-sticky|static|static-P:D|reactive|prorsa|oracle] [--out DIR]

The same actor classes as a live run (`ops.launch`), on `actors.base.inproc` instead of a
nats-server and under `actors.base.virtual.VirtualTimeLoop`: time jumps to the next timer
whenever every actor waits, so a run costs only the CPU time of its logic. Writes the same
`summary.json` and `events.parquet` as a live run. Ids are drawn from counters instead of
random UUIDs, so the same config and seed give byte-identical outputs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import logging
import shlex
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from threadpoolctl import threadpool_limits

from actors.allocator.actor import AllocatorActor
from actors.base import Actor
from actors.base.inproc import InProcServer
from actors.base.virtual import LoopClock, VirtualTimeLoop
from actors.config import POLICIES, Config, ConfigError, initial_roles, load_config, with_policy
from actors.engine.actor import EngineActor
from actors.environment.actor import EnvironmentActor
from actors.forecaster.actor import ForecasterActor
from actors.trainer.actor import TrainerActor
from bus_schemas import streams, subjects
from ops.export import DecisionRecorder, read_run, write_run

console = Console(stderr=True)
STOP_TIMEOUT_S = 60.0  # model seconds the other actors get to stop once the trainer is done
VIRTUAL_DECODE_STEP_S = 30.0  # a decode-only step ends at the next finish, new work, or this
GC_YOUNG_OBJECTS = 50_000  # allocations between two young-generation collections (Python's default: 700)


def build_actors(config: Config, server: InProcServer) -> list[Actor]:
    if config.engines.backend != "emulated":
        raise ConfigError(f"simulation runs the emulated backend only (config has engines.backend = {config.engines.backend!r})")
    # wall periods (pulls, heartbeats) span what they do live
    clock = LoopClock(config.run.time_scale, loop=asyncio.get_running_loop())
    roles = initial_roles(config)
    engines = [EngineActor(e, config, server.connect(e), clock, roles[e]) for e in config.engine_ids()]
    for engine in engines:  # no wall clock to keep up with: a decode step runs to the next event
        engine.max_decode_step_s = VIRTUAL_DECODE_STEP_S
    actors: list[Actor] = [*engines]
    actors += [EnvironmentActor(env, config, server.connect(env), clock) for env in config.env_ids()]
    if config.runs_forecaster:
        actors.append(ForecasterActor("forecaster", config, server.connect("forecaster"), clock))
    if config.runs_allocator:
        actors.append(AllocatorActor("allocator", config, server.connect("allocator"), clock))
    actors.append(TrainerActor("trainer", config, server.connect("trainer"), clock))
    for actor in actors:
        counter = itertools.count()
        actor.new_id = lambda a=actor.actor_id, c=counter: f"{a}-{next(c):09d}"
    return actors


async def simulate(config: Config, out: Path, progress: Progress | None = None) -> dict:
    started_wall = time.monotonic()
    server = InProcServer()
    control = server.connect("simulate")
    await streams.ensure_streams(control.jetstream())
    actors = build_actors(config, server)
    trainer = actors[-1]
    tasks = {asyncio.create_task(a.run(), name=a.actor_id): a for a in actors}
    bar = progress.add_task("trajectories", total=config.trajectories_expected()) if progress else None

    async def on_finished(msg) -> None:
        if progress is not None:
            progress.update(bar, advance=1, description=f"model {asyncio.get_running_loop().time():,.0f} s")

    await control.subscribe(subjects.lifecycle("finished"), cb=on_finished)
    recorder = DecisionRecorder()
    await recorder.start(control)
    trainer_task = next(t for t, a in tasks.items() if a is trainer)
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    failed = [tasks[t].actor_id for t in done if t is not trainer_task or t.exception() is not None]
    status = "failed" if failed else "completed"
    for actor in actors:
        actor.request_stop("simulation over")
    results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=STOP_TIMEOUT_S)
    for actor, result in zip(tasks.values(), results):
        if isinstance(result, BaseException):
            console.print(f"[red]error: {actor.kind} {actor.actor_id} failed: {result!r}")
            status = "failed"
    out.mkdir(parents=True, exist_ok=True)
    with no_collections():  # the export builds hundreds of thousands of objects that all stay alive until it ends
        record = await read_run(control.jetstream())
        server.drop_messages()  # all in `record` now
        summary = write_run(record, out, config, status, time.monotonic() - started_wall, console)
        recorder.write(out)
    summary_model_s = asyncio.get_running_loop().time()
    console.print(
        f"[bold]{status}[/bold]: simulated {summary_model_s:,.0f} model s in {summary['wall_s']} s wall; "
        f"finished {summary['trajectories_finished']}/{summary['trajectories_expected']} trajectories, "
        f"{summary['events']} events"
    )
    return summary


@contextlib.contextmanager
def fewer_collections():
    """Garbage collection tuned to a simulation: the objects alive at its start (modules,
    classes, the config) are frozen out of every collection, and the young generation is
    collected every GC_YOUNG_OBJECTS allocations instead of 700. A simulation allocates
    millions of short-lived objects (futures, timer handles, events) that reference
    counting frees; at the default threshold the collector ran thousands of times and its
    full collections, walking every live object, took a fifth of the run. Nothing here
    changes what a run computes; cycles are still collected, only less often."""
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_OBJECTS, *thresholds[1:])
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


@contextlib.contextmanager
def no_collections():
    """No garbage collection inside: for a stretch that allocates much and frees little."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def run(config: Config, out: Path, show_progress: bool = True) -> dict:
    """One BLAS thread: numpy's OpenBLAS otherwise keeps a thread per core, and on the
    forecaster's small matrices those threads spin waiting for the next product. They
    doubled a DeepSeek bench row's CPU seconds and took the core of the bench's other job;
    one thread gives the same products."""
    with fewer_collections(), threadpool_limits(limits=1, user_api="blas"):
        return _run(config, out, show_progress)


def _run(config: Config, out: Path, show_progress: bool) -> dict:
    loop = VirtualTimeLoop()
    try:
        if not show_progress:
            return loop.run_until_complete(simulate(config, out))
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} trajectories"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as progress:
            return loop.run_until_complete(simulate(config, out, progress))
    finally:
        leftovers = [t for t in asyncio.all_tasks(loop) if not t.done()]  # subscriptions, timers
        for task in leftovers:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        loop.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runners.simulate", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", type=Path)
    parser.add_argument("--policy", metavar="POLICY", help=f"overrides run.policy: {', '.join(POLICIES)}, or static-P:D")
    parser.add_argument("--out", type=Path, help="output folder (default runs/sim-<name>-<policy>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    try:
        config = with_policy(load_config(args.config), args.policy)
        initial_roles(config)
        out = args.out or Path("runs") / f"sim-{config.run.name}-{config.run.policy}"
        summary = run(config, out)
        console.print(
            f"run folder: {out}  (report: python -m ops.report {shlex.quote(str(out))})", highlight=False, markup=False, soft_wrap=True
        )
    except ConfigError as err:
        console.print(f"error: {err}", highlight=False, markup=False)
        return 2
    return 0 if summary["status"] == "completed" else 1


if __name__ == "__main__":
    sys.exit(main())
