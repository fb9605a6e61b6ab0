"""Watching a run's processes (used by `ops.launch`): restart what dies, as `Supervision`
says, bring the embedded server back on its store, turn poison work into dead letters, alert
on a filling lifecycle log; stop everything at the end.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from actors.base.connection import close
from actors.base.tasks import cancel_and_wait
from bus_schemas import subjects
from bus_schemas.codec import decode
from bus_schemas.lifecycle import LifecycleEvent
from ops.bus_guard import DeadLetters, LifecycleFill
from ops.natsserver import EmbeddedNats
from ops.procs import Supervision, exited

if TYPE_CHECKING:
    from ops.launch import ActorSpec, Bus

STOP_GRACE_WALL_S = 15.0
LOG = logging.getLogger("prorsa.launch")
console = Console(stderr=True)


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


async def supervise(
    procs: dict[ActorSpec, asyncio.subprocess.Process],
    logs: Path,
    bus: Bus,
    expected: int,
    interrupted: asyncio.Event,
    supervision: Supervision,
    respawn: Callable[[ActorSpec], Awaitable[asyncio.subprocess.Process]],
    notes: dict,
    server: EmbeddedNats | None = None,
) -> str:
    """Wait for the end of the run; return 'completed', 'failed' or 'interrupted'. A dead actor
    is restarted as `supervision` says (`procs` then holds the new process), or fails the run.
    The embedded `server`, if it dies, is restarted on the same port and store under the same
    rules (the actors reconnect on their own). Meanwhile poison work is dead-lettered and the
    lifecycle log's fill watched (alerts go into `notes`)."""
    started = time.monotonic()
    waits = {asyncio.create_task(p.wait(), name=spec.name): spec for spec, p in procs.items()}
    restarting: dict[asyncio.Task, ActorSpec] = {}  # backoff, then a new process
    stop_wait = asyncio.create_task(interrupted.wait())
    progress = Progress(
        TextColumn("rollout"), BarColumn(), MofNCompleteColumn(), TextColumn("trajectories"), TimeElapsedColumn(), console=console
    )
    bar = progress.add_task("trajectories", total=expected)
    nc = await bus.connect("launcher-watch")

    async def on_finished(msg) -> None:
        try:
            decode(LifecycleEvent, msg.data)
        except msgspec.MsgspecError:
            return
        progress.advance(bar)

    async def restart_after(spec: ActorSpec, delay_s: float) -> asyncio.subprocess.Process:
        await asyncio.sleep(delay_s)
        return await respawn(spec)

    await nc.subscribe(subjects.lifecycle("finished"), cb=on_finished)
    dead = DeadLetters(nc, LOG)
    await dead.start()
    fill = LifecycleFill(nc.jetstream(), lambda line: console.print(f"[red]alert: {line}", highlight=False))
    notes["lifecycle_alerts"] = fill.alerts
    watchers = [asyncio.create_task(fill.watch(), name="lifecycle-fill")]
    fatal_wait = asyncio.create_task(dead.fatal.wait())
    server_wait = asyncio.create_task(exited(server.proc)) if server is not None else None
    try:
        with progress:
            while True:
                done, _ = await asyncio.wait(
                    {*waits, *restarting, stop_wait, fatal_wait, *filter(None, [server_wait])}, return_when=asyncio.FIRST_COMPLETED
                )
                if stop_wait in done:
                    console.print("[yellow]interrupted: stopping every actor")
                    return "interrupted"
                if fatal_wait in done:
                    console.print(f"[red]error: {dead.fatal_reason}; the run cannot complete", highlight=False)
                    return "failed"
                if server_wait in done:  # the bus itself died: bring it back on the same store
                    delay_s, why = supervision.on_death("nats-server", "server", server_wait.result(), time.monotonic() - started)
                    console.print(
                        f"[red]error: nats-server died with exit code {server_wait.result()} ({why}); see {server.log_path}",
                        highlight=False,
                    )
                    if delay_s is None:
                        return "failed"
                    await asyncio.sleep(delay_s)
                    if interrupted.is_set():  # Ctrl-C reached the server first (one process group): no restart
                        console.print("[yellow]interrupted: stopping every actor")
                        return "interrupted"
                    await asyncio.to_thread(server.start)
                    console.print(f"restarted nats-server pid {server.proc.pid} at {server.url}", highlight=False)
                    server_wait = asyncio.create_task(exited(server.proc))
                    continue  # any other task done meanwhile is returned again by the next wait
                for task in done:
                    if task in restarting:  # a restart's new process is up
                        spec = restarting.pop(task)
                        procs[spec] = task.result()
                        waits[asyncio.create_task(procs[spec].wait(), name=spec.name)] = spec
                        console.print(f"restarted {spec.name} pid {procs[spec].pid}", highlight=False)
                        continue
                    spec = waits.pop(task)
                    code = task.result()
                    if spec.kind == "trainer" and code == 0:
                        return "completed"
                    log = logs / f"{spec.kind}-{spec.actor_id}.log"
                    delay_s, why = supervision.on_death(spec.name, spec.kind, code, time.monotonic() - started)
                    console.print(f"[red]error: {spec.name} died with exit code {code} ({why}); last lines of {log}:[/red]\n{tail(log)}")
                    if delay_s is None:
                        return "failed"
                    restarting[asyncio.create_task(restart_after(spec, delay_s), name=f"restart {spec.name}")] = spec
    finally:
        stop_wait.cancel()
        fatal_wait.cancel()
        if server_wait is not None:
            server_wait.cancel()
        for task in waits:
            task.cancel()
        await cancel_and_wait([*restarting, *watchers], LOG)
        notes["dead_letter_errors"] = dead.errors
        await close(nc)


async def stop_all(procs: dict[ActorSpec, asyncio.subprocess.Process]) -> list[str]:
    """SIGTERM every live actor, SIGKILL what is left after the grace period; name those."""
    live = {spec: p for spec, p in procs.items() if p.returncode is None}
    for p in live.values():
        p.send_signal(signal.SIGTERM)
    killed = []
    for spec, p in live.items():
        try:
            await asyncio.wait_for(p.wait(), timeout=STOP_GRACE_WALL_S)
        except TimeoutError:
            p.kill()
            await p.wait()
            killed.append(spec.name)
    return killed
