"""The actor base class and the shared ``__main__`` entry point.

Shutdown is an explicit state (running → stopping); signal handlers only set it. ``run``
sets up, serves until stopped (or, in burst mode, until there is nothing left to do),
then tears down: background tasks stopped, lifecycle events flushed, the final counters
published as an ActorReport, the connection drained.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import signal
import sys
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any, ClassVar, TypeVar

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from actors.base.clock import Clock, ScaledClock
from actors.base.connection import BUS_ERRORS, close, connect, read_origin
from actors.base.lifecycle import LifecyclePublisher
from actors.base.tasks import CANCEL_WAIT_S, cancel_and_wait
from actors.config import Config, ConfigError, load_config
from bus_schemas import subjects
from bus_schemas.codec import decode, encode
from bus_schemas.lifecycle import LifecycleEvent
from bus_schemas.status import ActorReport
from bus_schemas.streams import ensure_streams

T = TypeVar("T")
SERVE_STOP_WALL_S = 8.0  # a serve loop gets this long to end after a stop request
# a live actor checkpoints its counters this often (when they changed), so a process killed
# outright loses at most this much of its counts from the run's summary (ops/export.py)
REPORT_CHECKPOINT_WALL_S = 2.0


class Actor:
    kind: ClassVar[str] = "actor"

    def __init__(self, actor_id: str, config: Config, nc: NATS, clock: Clock) -> None:
        self.actor_id = actor_id
        self.config = config
        self.nc = nc
        self.js = nc.jetstream()
        self.clock = clock
        self.counters: Counter[str] = Counter()
        self.incarnation = uuid.uuid4().hex  # this process's reports (a restart is a new incarnation)
        self.report_checkpoint_wall_s = REPORT_CHECKPOINT_WALL_S
        self.log = logging.getLogger(f"prorsa.{self.kind}.{actor_id}")
        self.lifecycle = LifecyclePublisher(self.js, self.counters, self.log, clock)
        self.stopping = asyncio.Event()
        self.ready = asyncio.Event()  # set once setup() is done: subscriptions are live
        self.run_tag = f"{clock.origin_wall_s:.6f}"  # scopes Nats-Msg-Id dedup to this run
        self.new_id: Callable[[], str] = lambda: uuid.uuid4().hex  # simulations make ids deterministic
        self.failure: BaseException | None = None
        self._tasks: set[asyncio.Task] = set()

    # --- to override -------------------------------------------------------------------
    async def setup(self) -> None:
        """Subscribe and create consumers. Runs before serve()."""

    async def serve(self, burst: bool) -> None:
        """The actor's work until `stopping` is set (or, in burst mode, until idle)."""
        await self.stopping.wait()

    async def teardown(self) -> None:
        """Hand back in-flight work. Runs after serve(), before the final report."""

    def heartbeat(self) -> msgspec.Struct | None:
        """The status message published every heartbeat, or None for none."""
        return None

    # --- shared machinery --------------------------------------------------------------
    async def run(self, burst: bool = False) -> None:
        await ensure_streams(self.js)
        self.lifecycle.start()
        await self.setup()
        await self.nc.flush()  # the server has our subscriptions before anyone is told we are up
        self.ready.set()
        self.spawn(self._heartbeats(), "heartbeats")
        if getattr(self.nc, "publish_now", None) is None:  # live (a simulation never restarts an actor)
            self.spawn(self._checkpoints(), "report-checkpoints")
        watch_loop = getattr(self.clock, "watch_loop", None)  # a live clock watches its loop
        if watch_loop is not None:
            self.spawn(watch_loop(), "loop-watch")
        serving = asyncio.create_task(self.serve(burst), name="serve")
        stopped = asyncio.create_task(self.stopping.wait(), name="stop-wait")
        try:
            done, _ = await asyncio.wait({serving, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if serving in done:
                serving.result()  # re-raise a crash of the serve loop
            else:
                self.log.info("stop requested")
            self.stopping.set()
            try:
                await asyncio.wait_for(asyncio.shield(serving), timeout=self.clock.loop_s(SERVE_STOP_WALL_S))
            except TimeoutError:  # still hand back work and report: never hang the launcher
                self.counters["slow_stops"] += 1
                self.log.error("serve loop still running %.0f s after the stop request; cancelling it", SERVE_STOP_WALL_S)
                await cancel_and_wait([serving], self.log, self.clock.loop_s(CANCEL_WAIT_S))
        finally:
            stopped.cancel()
            await self._shutdown_tasks()
            await self.teardown()
            await self.lifecycle.close()
            await self._publish_report()
        if self.failure is not None:
            raise self.failure

    def request_stop(self, reason: str = "") -> None:
        if not self.stopping.is_set():
            self.log.info("stopping: %s", reason or "requested")
        self.stopping.set()

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """A background task whose crash stops the actor instead of vanishing."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        err = task.exception()
        self.log.error("task %s crashed: %r", task.get_name(), err, exc_info=err)
        self.failure = self.failure or err
        self.stopping.set()

    async def _shutdown_tasks(self) -> None:
        left = await cancel_and_wait(list(self._tasks), self.log, self.clock.loop_s(CANCEL_WAIT_S))
        if left:
            self.counters["tasks_left_running"] += len(left)

    @contextlib.contextmanager
    def counting_bus_errors(self, counter: str) -> Iterator[None]:
        """Swallow a failed bus call whose failure the protocol already covers (a keep-alive,
        a nak at shutdown: the work is redelivered after its ack wait), but count it under
        `counter` and log the 1st, 10th, 100th ... so it never goes unseen."""
        try:
            yield
        except BUS_ERRORS as err:
            self.counters[counter] += 1
            n = self.counters[counter]
            if n & (n - 1) == 0 or n % 100 == 0:  # 1, 2, 4, 8, ... and every 100th
                self.log.warning("%s (%d so far): %r", counter.replace("_", " "), n, err)

    def decode_or_count(self, message_type: type[T], msg: Msg) -> T | None:
        """Decode at the edge; a malformed message is logged in one line and counted."""
        try:
            return decode(message_type, msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as err:
            self.counters["invalid_messages"] += 1
            name = getattr(message_type, "__name__", str(message_type))
            self.log.error("rejected malformed %s on %s: %s", name, msg.subject, err)
            return None

    async def decode_work(self, message_type: type[T], msg: Msg) -> T | None:
        """Like decode_or_count, for JetStream work: a malformed item is terminated (never redelivered)."""
        item = self.decode_or_count(message_type, msg)
        if item is None:
            await msg.term()
        return item

    def event(self, kind, event_id: str = "", **fields: Any) -> LifecycleEvent:
        """Build, emit and return a lifecycle event stamped with now (`event_id`: an id that
        a rerun of the same work gives again, so the stream stores the event once)."""
        fields.setdefault("at_s", self.clock.now_s())
        event = LifecycleEvent(event_id=event_id or self.new_id(), kind=kind, actor_id=self.actor_id, **fields)
        self.lifecycle.emit(event)
        return event

    async def wait_for_heartbeats(self, actor_kind: str, actor_ids: list[str], timeout_wall_s: float) -> None:
        """Return once every listed actor has published a heartbeat (they are up and serving)."""
        missing = set(actor_ids)
        seen = asyncio.Event()

        async def on_status(msg: Msg) -> None:
            missing.discard(msg.subject.rsplit(".", 1)[-1])
            if not missing:
                seen.set()

        sub = await self.nc.subscribe(subjects.status_of_kind(actor_kind), cb=on_status)
        try:
            await asyncio.wait_for(seen.wait(), timeout=self.clock.loop_s(timeout_wall_s))
        except TimeoutError:
            raise RuntimeError(f"no heartbeat within {timeout_wall_s} s from {actor_kind} {sorted(missing)}") from None
        finally:
            await sub.unsubscribe()

    @functools.cached_property
    def status_subject(self) -> str:
        return subjects.status(self.kind, self.actor_id)

    async def publish_heartbeat(self) -> None:
        status = self._heartbeat_payload()
        if status is not None:
            await self.nc.publish(self.status_subject, status)

    def _heartbeat_payload(self) -> bytes | None:
        """The encoded status to publish now, or None: nobody listens (the in-process bus knows
        every subscriber: a colocated fleet in simulation skips building it), no status, or no
        connection."""
        has_interest = getattr(self.nc, "has_interest", None)
        if has_interest is not None and not has_interest(self.status_subject):
            return None
        status = self.heartbeat()
        if status is not None and self.nc.is_connected:
            return encode(status)
        return None

    def _check_lease(self, now_s: float, last_s: float, lease_s: float) -> None:
        if now_s - last_s > lease_s:  # frozen (SIGSTOP, a stalled host) past the lease
            self.counters["lease_lapses"] += 1
            self.log.warning("no heartbeat for %.1f s (model), past the lease: re-registering", now_s - last_s)
            self.on_lease_lapsed()

    async def _heartbeats(self) -> None:
        lease_s = self.config.run.lease_wall_s * self.clock.time_scale  # model seconds
        publish_now = getattr(self.nc, "publish_now", None)  # the in-process bus
        call_later_wall = getattr(self.clock, "call_later_wall", None)  # virtual time's clock
        if publish_now is not None and call_later_wall is not None:
            await self._heartbeats_on_timers(publish_now, call_later_wall, lease_s)
            return
        last_s = self.clock.now_s()
        while True:
            now_s = self.clock.now_s()
            self._check_lease(now_s, last_s, lease_s)
            last_s = now_s
            await self.publish_heartbeat()
            await self.clock.sleep_wall(self.config.run.heartbeat_wall_s)

    async def _heartbeats_on_timers(
        self, publish_now: Callable[[str, bytes], None], call_later_wall: Callable[..., asyncio.TimerHandle], lease_s: float
    ) -> None:
        """`_heartbeats` on the in-process bus, each beat a plain callback instead of a step of
        this task: a large fleet beats hundreds of thousands of times a run, mostly with nobody
        listening. Step for step as the loop above: a beat's timer is set where the task's
        sleep would set it (`clock.call_later_wall`), and when it fires, the beat is
        queued (`call_soon`) where the sleep's future would queue the task's wake-up, so every
        beat (and its publish) runs at the same point among the loop's callbacks. This task
        only holds the beats' lifetime: cancelling it stops them, as it stops the loop above;
        a beat that raises fails it."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        period_wall_s = self.config.run.heartbeat_wall_s
        done = loop.create_future()  # never set, except to raise a beat's error
        last_s = self.clock.now_s()
        timer: asyncio.TimerHandle | None = None

        def beat() -> None:
            nonlocal last_s, timer
            if task is not None and task.cancelling():  # stopped between the timer and its beat
                return
            try:
                now_s = self.clock.now_s()
                self._check_lease(now_s, last_s, lease_s)
                last_s = now_s
                status = self._heartbeat_payload()
                if status is not None:
                    publish_now(self.status_subject, status)
            except Exception as err:  # as a crash of the loop above: the actor stops
                if not done.done():
                    done.set_exception(err)
                return
            timer = call_later_wall(period_wall_s, loop.call_soon, beat)

        beat()
        try:
            await done
        finally:
            if timer is not None:
                timer.cancel()

    def on_lease_lapsed(self) -> None:
        """Called when this actor's heartbeats stopped for longer than its lease: the others
        have counted it out (an engine re-registers under a new incarnation)."""

    def clock_counters(self) -> None:
        """Copy the clock's keeping-up figures into the counters (a ScaledClock has them)."""
        late_s = getattr(self.clock, "late_s", None)
        if late_s is not None:
            self.counters["late_wakeups"] = self.clock.late_wakeups
            self.counters["late_wakeup_ms"] = round(late_s * 1e3)  # model ms, summed
            self.counters["loop_stalls"] = self.clock.loop_stalls
            self.counters["loop_stall_ms"] = round(self.clock.loop_stall_s * 1e3)  # model ms, summed

    def _report(self, final: bool) -> ActorReport:
        self.clock_counters()
        return ActorReport(
            actor_id=self.actor_id,
            kind=self.kind,
            at_s=self.clock.now_s(),
            counters=dict(self.counters),
            incarnation=self.incarnation,
            final=final,
        )

    async def _checkpoints(self) -> None:
        """Every `report_checkpoint_wall_s`, the counters so far as a checkpoint report (not
        final), when they changed; a failed publish is counted and tried at the next period."""
        last: dict[str, int] | None = None
        while True:
            await self.clock.sleep_wall(self.report_checkpoint_wall_s)
            report = self._report(final=False)
            if report.counters == last or not self.nc.is_connected:
                continue
            try:
                await self.js.publish(subjects.report(self.actor_id), encode(report), timeout=self.clock.loop_s(5.0))
                last = report.counters
            except BUS_ERRORS:
                self.counters["report_checkpoint_failures"] += 1

    async def _publish_report(self) -> None:
        report = self._report(final=True)
        try:
            await self.js.publish(subjects.report(self.actor_id), encode(report), timeout=self.clock.loop_s(5.0))
        except BUS_ERRORS as err:  # the bus may be gone at shutdown; say so, do not hide it
            self.log.error("could not publish the final report: %s", err)


ActorFactory = Callable[[argparse.Namespace, Config, NATS, Clock], Actor | Awaitable[Actor]]


def actor_main(
    kind: str,
    factory: ActorFactory,
    add_args: Callable[[argparse.ArgumentParser], None] | None = None,
    argv: list[str] | None = None,
) -> int:
    """Parse the common flags, connect, run the actor until stopped; return the exit code."""
    parser = argparse.ArgumentParser(prog=f"python -m actors.{kind}")
    parser.add_argument("--config", required=True, help="run config (TOML)")
    parser.add_argument("--id", required=True, help="this actor's id, e.g. e0 or env1")
    parser.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    parser.add_argument("--burst", action="store_true", help="exit once there is nothing left to do")
    parser.add_argument("--log-level", default="INFO")
    if add_args is not None:
        add_args(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s {kind}.{args.id} %(message)s",
        stream=sys.stderr,
    )
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        subjects.status(kind, args.id)  # refuse ids that break the subject hierarchy
    except ValueError as err:
        print(f"error: --id: {err}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_amain(kind, factory, args, config))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Exception as err:
        logging.getLogger(f"prorsa.{kind}").exception("actor failed: %s", err)
        return 1
    return 0


async def _amain(kind: str, factory: ActorFactory, args: argparse.Namespace, config: Config) -> None:
    log = logging.getLogger(f"prorsa.{kind}.{args.id}")
    nc = await connect(args.nats_url, f"{kind}.{args.id}", log)
    try:
        origin = await read_origin(nc.jetstream(), config.run.name)
        clock = ScaledClock(config.run.time_scale, origin.origin_wall_s)
        actor = factory(args, config, nc, clock)
        if asyncio.iscoroutine(actor):
            actor = await actor
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, actor.request_stop, signal.Signals(sig).name)
        await actor.run(burst=args.burst)
    finally:
        await close(nc)
