"""Watch a Prorsa run live, from bus subscriptions only.

    python -m ops.monitor (--run RUN_DIR | --nats-url URL) [--json] [--once] [--prometheus PORT]

A terminal dashboard (rich): every engine (role, backend, epoch, queue, running sequences,
KV use, tokens/s, heartbeat age), the fleet's P:D split over the last minutes, trajectories
by lifecycle phase and the event rate, the latest forecast against measured demand, role
switches as they happen with their cost, and health: malformed messages, dead letters,
stream fill, and alerts (an engine silent past its lease, a switch not acked, dead letters,
the lifecycle stream near full).

* `--run DIR` attaches to a run `ops.launch` started: the bus URL (and credentials, where
  the run has them) from `DIR/bus.json`, heartbeat period, lease and time scale from
  `DIR/config.json`. It waits for the folder's `bus.json` if the run is not up yet.
* `--nats-url URL` watches any deployment, read-only; credentials from `NATS_USER` /
  `NATS_PASSWORD` or `NATS_CREDS` where set.
* `--json` prints the same state as one JSON object per line, every `--interval` seconds;
  `--once` prints one snapshot (after `--wait` seconds of listening) and exits.
* `--prometheus PORT` serves the state as Prometheus metrics on :PORT/metrics (with the
  dashboard or `--json`, or alone when the output is not a terminal).

Bad input (no run folder, no server, no Prorsa traffic) is one line on stderr: the monitor
waits for it to change, or with `--once` exits with status 1.

The state is `ops.monitor_state.MonitorState`, the bus side `ops.monitor_bus`, the drawing
`ops.monitor_view`, the metrics `ops.monitor_prom`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from pathlib import Path

from rich.console import Console

from ops.monitor_bus import BusMonitor, BusTarget, MonitorInputError, run_prefill_cost, target_from_run, target_from_url
from ops.monitor_state import MonitorState
from ops.monitor_view import dashboard, render_text, status_line

RETRY_WALL_S = 2.0


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_state(target: BusTarget, args: argparse.Namespace) -> MonitorState:
    hints = target.hints
    return MonitorState(
        lease_wall_s=args.lease or hints.get("lease_wall_s"),
        heartbeat_wall_s=hints.get("heartbeat_wall_s"),
        time_scale=hints.get("time_scale"),
        expected_engines=hints.get("expected_engines", ()),
        initial_roles=hints.get("initial_roles", {}),
        window_s=args.window,
    )


async def resolve_target(args: argparse.Namespace, stop: asyncio.Event) -> BusTarget | None:
    """The bus to watch; with --run, wait (one line said) until DIR/bus.json is there, unless --once."""
    if args.nats_url:
        return target_from_url(args.nats_url)
    said = ""
    while not stop.is_set():
        try:
            return target_from_run(args.run)
        except MonitorInputError as err:
            if args.once:
                raise
            if str(err) != said:
                say(f"monitor: {err}; waiting (Ctrl-C to stop)")
                said = str(err)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
    return None


async def attach(target: BusTarget, state: MonitorState, args: argparse.Namespace, stop: asyncio.Event) -> BusMonitor | None:
    """Connect and subscribe; without --once, wait (one line said) for a server to answer."""
    said = ""
    while not stop.is_set():
        bus = BusMonitor(state, target, history=not args.no_history, commands=not args.no_commands)
        try:
            await bus.start()
            if said:
                say(f"monitor: connected to {target.url}")
            return bus
        except MonitorInputError as err:
            await bus.close()
            if args.once:
                raise
            if str(err) != said:
                say(f"monitor: {err}; retrying every {RETRY_WALL_S:g} s (Ctrl-C to stop)")
                said = str(err)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=RETRY_WALL_S)
    return None


def run_ended(target: BusTarget, started_wall_s: float) -> bool:
    """--run: the launcher wrote the run's summary after the monitor started (the run is over)."""
    if target.run_dir is None:
        return False
    summary = target.run_dir / "summary.json"
    return summary.exists() and summary.stat().st_mtime >= started_wall_s


async def main_async(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    started_wall_s = time.time()
    try:
        target = await resolve_target(args, stop)
        if target is None:  # stopped (Ctrl-C, SIGTERM) while waiting: a normal end
            return 0
        state = build_state(target, args)
        bus = await attach(target, state, args, stop)
        if bus is None:
            return 0
    except MonitorInputError as err:
        say(f"monitor: {err}")
        return 1
    cost = None  # --run: the run's prefill cost, for measuring prefill_engine_s (loading the config takes a moment)
    if target.run_dir is not None and (target.run_dir / "config.json").exists():
        cost = asyncio.create_task(asyncio.to_thread(run_prefill_cost, target.run_dir))
        cost.add_done_callback(lambda t: setattr(state, "prefill_cost", None if t.cancelled() or t.exception() else t.result()))
    try:
        if args.once:
            if cost is not None:
                await asyncio.wait({cost}, timeout=30)
            return await once(bus, state, args)
        return await watch(bus, state, target, args, stop, started_wall_s)
    finally:
        await bus.close()


async def once(bus: BusMonitor, state: MonitorState, args: argparse.Namespace) -> int:
    heartbeat = state.heartbeat_wall_s or 0.5
    await bus.settle(min_wall_s=max(args.wait, 2.5 * heartbeat), timeout_wall_s=max(args.wait, 2.5 * heartbeat) + 30.0)
    snapshot = state.snapshot(time.time())
    if not snapshot["traffic"]:
        say(f"monitor: connected to {bus.target.url}, but no Prorsa traffic there (no heartbeat, no lifecycle stream)")
        return 1
    if args.json:
        print(json.dumps(snapshot, separators=(",", ":")), flush=True)
    else:
        width = Console().width if sys.stdout.isatty() else args.width
        sys.stdout.write(render_text(snapshot, width))
        sys.stdout.flush()
    return 0


async def watch(
    bus: BusMonitor, state: MonitorState, target: BusTarget, args: argparse.Namespace, stop: asyncio.Event, started_wall_s: float
) -> int:
    collector = None
    if args.prometheus is not None:
        from ops.monitor_prom import serve

        try:
            collector, _server = serve(args.prometheus, args.prometheus_addr)
        except OSError as err:
            say(f"monitor: cannot serve metrics on port {args.prometheus}: {err.strerror or err}")
            return 1
        say(f"monitor: Prometheus metrics on http://{args.prometheus_addr}:{args.prometheus}/metrics")
    tty = sys.stdout.isatty()
    mode = "json" if args.json else ("dashboard" if tty else ("quiet" if collector is not None else "lines"))
    live = None
    if mode == "dashboard":
        from rich.live import Live

        console = Console()
        live = Live(console=console, screen=True, auto_refresh=False, redirect_stderr=False)
        live.start()
    said_no_traffic = False
    attached_wall_s = time.time()
    ticks = 0
    try:
        while not stop.is_set():
            snapshot = state.snapshot(time.time())
            if collector is not None:
                collector.update(snapshot)
            if not snapshot["traffic"] and not said_no_traffic and mode != "dashboard" and time.time() - attached_wall_s > 2.0:
                say(f"monitor: connected to {target.url}, no Prorsa traffic yet; waiting")
                said_no_traffic = True
            if mode == "json":
                print(json.dumps(snapshot, separators=(",", ":")), flush=True)
            elif mode == "dashboard":
                live.update(dashboard(snapshot, live.console.width), refresh=True)
            elif mode == "lines" and ticks % max(1, round(5.0 / args.interval)) == 0:
                print(status_line(snapshot), flush=True)
            ticks += 1
            if not snapshot["bus"].get("connected") and run_ended(target, started_wall_s):
                if live is not None:
                    live.stop()
                    live = None
                say(f"monitor: the run in {target.run_dir} has ended (summary.json written)")
                return 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=args.interval)
    finally:
        if live is not None:
            live.stop()
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m ops.monitor", description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--run", type=Path, metavar="RUN_DIR", help="a run folder ops.launch writes (DIR/bus.json)")
    where.add_argument("--nats-url", metavar="URL", help="any NATS server (credentials: NATS_USER/NATS_PASSWORD or NATS_CREDS)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line per interval instead of the dashboard")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--prometheus", type=int, metavar="PORT", help="serve Prometheus metrics on this port")
    parser.add_argument("--prometheus-addr", default="0.0.0.0", metavar="ADDR", help="address the metrics server binds (default 0.0.0.0)")
    parser.add_argument("--interval", type=float, default=1.0, metavar="S", help="wall seconds between updates (default 1)")
    parser.add_argument(
        "--wait", type=float, default=2.0, metavar="S", help="--once: wall seconds to listen before the snapshot (default 2)"
    )
    parser.add_argument("--window", type=float, default=300.0, metavar="S", help="model seconds of P:D history (default 300)")
    parser.add_argument(
        "--lease", type=float, metavar="S", help="wall seconds of silence before an engine is flagged (default: the run's lease)"
    )
    parser.add_argument("--no-history", action="store_true", help="follow new lifecycle events only (no replay from the stream's start)")
    parser.add_argument(
        "--no-commands",
        action="store_true",
        help="do not watch SetRole commands on prorsa.ctl.engine.* (switches still show from the log; no 'not acked' alerts)",
    )
    parser.add_argument("--width", type=int, default=140, help="text width of --once without --json when not a terminal (default 140)")
    args = parser.parse_args(argv)
    if args.interval <= 0 or args.wait < 0 or args.window <= 0:
        parser.error("--interval and --window must be > 0, --wait >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return asyncio.run(main_async(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
