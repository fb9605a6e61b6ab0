"""The monitor's bus adapter: where to connect, and subscriptions that feed a MonitorState.

Read-only: it publishes nothing. What it subscribes to:

| subject | what it gives |
| --- | --- |
| `prorsa.status.>` | engine heartbeats (role, epoch, queues, KV), other actors' counters |
| `prorsa.lc.*`, through an ordered JetStream consumer from the start of LIFECYCLE | trajectories by phase, event rate, role switches, measured demand |
| `prorsa.forecast` | the forecaster's DemandForecast each tick |
| `prorsa.allocation` | the allocator's AllocationDecision each tick: why it holds or changes the split |
| `prorsa.ctl.engine.*` and the commander's reply inbox | SetRole commands and their acks |
| `prorsa.train.step`, `prorsa.report.*` | RL step reports, actors' final counters |
| `prorsa.dead.*` | dead letters as they are moved (the DEAD stream's count comes from stream info) |
| `$JS.EVENT.ADVISORY.CONSUMER.{MSG_TERMINATED,MAX_DELIVERIES}.>` | work items JetStream gave up on: refused as malformed, or past max_deliver |

plus a stream-info request every few seconds (queue depths, how full LIFECYCLE is). Where
the server refuses JetStream to this user (a read-only role), lifecycle events come from a
plain subscription (live only) and stream fullness is unknown.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import api
from nats.js.errors import NotFoundError

from actors import config_schema as schema
from actors.base.connection import TlsFiles
from actors.base.tasks import cancel_and_wait
from bus_schemas import streams, subjects
from bus_schemas.codec import decode
from bus_schemas.run import ORIGIN_KEY, RUN_BUCKET, RunOrigin
from ops.bus_guard import REASON_HEADER, SUBJECT_HEADER
from ops.monitor_state import MonitorState

LOG = logging.getLogger("prorsa.monitor")
BUS_FILE = "bus.json"  # what ops.launch writes into the run folder: {"url": ..., optional "user"/"password" or "creds"}
STREAM_POLL_WALL_S = 2.0
# NATS's own advisories when a consumer gives up on a message: an actor terminated it (malformed), or max_deliver ran out
DEAD_LETTER_ADVISORIES = ("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.>", subjects.max_deliveries_advisory())
_PRORSA_STREAMS = {s.name for s in streams.ALL_STREAMS}


class MonitorInputError(Exception):
    """Bad input for the monitor, said in one line (no traceback)."""


@dataclass(slots=True)
class BusTarget:
    url: str
    user: str | None = None
    password: str | None = None
    creds: str | None = None  # a NATS .creds file
    tls: TlsFiles | None = None  # the CA bundle (and client certificate) of a bus that speaks TLS
    source: str = ""  # how it was found, for the header: "run runs/x" or "--nats-url"
    run_dir: Path | None = None
    hints: dict = field(default_factory=dict)  # from the run's config: lease_wall_s, heartbeat_wall_s, time_scale, expected_engines


def target_from_run(run_dir: Path) -> BusTarget:
    """The bus of a run `ops.launch` started: DIR/bus.json (url, credentials), DIR/config.json (hints)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise MonitorInputError(f"{run_dir}: no such run folder")
    path = run_dir / BUS_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise MonitorInputError(f"{path}: not there yet (ops.launch writes it once the bus is up)") from None
    except (OSError, ValueError) as err:
        raise MonitorInputError(f"{path}: not readable as JSON: {err}") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("url"), str) or not raw["url"]:
        raise MonitorInputError(f'{path}: no "url" in it')
    creds = raw.get("creds")
    if creds:
        creds = str((run_dir / creds) if not Path(creds).is_absolute() else Path(creds))
    return BusTarget(
        url=raw["url"],
        user=raw.get("user") or None,
        password=raw.get("password") or None,
        creds=creds or None,
        tls=TlsFiles(raw["tls_ca"], raw.get("tls_cert", ""), raw.get("tls_key", "")) if raw.get("tls_ca") else None,
        source=f"run {run_dir}",
        run_dir=run_dir,
        hints=run_hints(run_dir),
    )


def run_hints(run_dir: Path) -> dict:
    """What the run's config.json says about heartbeats, leases, the time scale and the
    engines (empty where unknown). Read as plain JSON: validating the whole Config imports
    the cost model, seconds of start-up for four numbers."""
    try:
        raw = json.loads((Path(run_dir) / "config.json").read_text())
        run, engines = raw.get("run", {}), raw.get("engines", {})
    except (OSError, ValueError, AttributeError):
        return {}
    hints: dict = {}
    scale = run.get("time_scale")
    if isinstance(scale, (int, float)) and scale > 0:
        hints["time_scale"] = float(scale)
    heartbeat = run.get("heartbeat_wall_s") or (1.0 / scale if hints.get("time_scale") else None)
    if isinstance(heartbeat, (int, float)) and heartbeat > 0:
        hints["heartbeat_wall_s"] = float(heartbeat)
    lease = run.get("lease_wall_s")
    if isinstance(lease, (int, float)) and lease > 0:
        hints["lease_wall_s"] = float(lease)
    count = engines.get("count") if isinstance(engines, dict) else None
    if isinstance(count, int) and count > 0:
        hints["expected_engines"] = [f"e{i}" for i in range(count)]  # as actors.config.Config.engine_ids names them
    try:  # the schema alone (no cost model): the role each engine starts in
        config = msgspec.convert(raw, schema.Config)
        hints["initial_roles"] = {engine_id: role.value for engine_id, role in schema.initial_roles(config).items()}
    except (msgspec.ValidationError, ValueError):
        pass
    return hints


def run_prefill_cost(run_dir: Path):
    """The run's prefill cost coefficients (what the forecaster weighs prefill_engine_s by), or
    None. Slow (the config's validation imports the cost model): call it off the event loop."""
    from actors.config import ConfigError, load_config  # late: --nats-url never needs them
    from actors.forecaster.actor import prefill_cost

    try:
        return prefill_cost(load_config(Path(run_dir) / "config.json"))
    except (ConfigError, ValueError, KeyError):
        return None


def target_from_url(url: str, environ: dict | None = None) -> BusTarget:
    """Any deployment: credentials from NATS_USER / NATS_PASSWORD or NATS_CREDS, and TLS files
    from PRORSA_NATS_TLS_CA / _CERT / _KEY, where set."""
    env = os.environ if environ is None else environ
    return BusTarget(
        url=url,
        user=env.get("NATS_USER") or None,
        password=env.get("NATS_PASSWORD") or None,
        creds=env.get("NATS_CREDS") or None,
        tls=TlsFiles.from_env(env),
        source="--nats-url",
    )


def _connect_options(target: BusTarget) -> dict:
    options: dict = {"name": "prorsa-monitor"}
    if target.creds:
        if not Path(target.creds).exists():
            raise MonitorInputError(f"{target.creds}: no such credentials file")
        options["user_credentials"] = target.creds
    elif target.user:
        options["user"] = target.user
        options["password"] = target.password or ""
    if target.tls:
        try:
            options["tls"] = target.tls.context()
        except OSError as err:
            raise MonitorInputError(str(err)) from None
    return options


def _why(err: BaseException) -> str:
    text = str(err) or type(err).__name__
    if isinstance(err, ssl.SSLError):  # an OSError too, but the server did answer
        return f"the TLS handshake failed ({getattr(err, 'reason', None) or text})"
    if isinstance(err, (OSError, nats.errors.NoServersError, TimeoutError, asyncio.TimeoutError)):
        return "no NATS server answers there"
    if "authorization" in text.lower() or "authentication" in text.lower():
        return f"the server refused these credentials ({text.removeprefix('nats: ').strip()})"
    return text


async def probe(target: BusTarget, timeout_s: float = 2.0) -> None:
    """One connection attempt, no retries; MonitorInputError in one line if it fails."""
    options = _connect_options(target)

    async def quiet(err: Exception) -> None:
        return None

    nc = NATS()
    try:
        await asyncio.wait_for(
            nc.connect(target.url, allow_reconnect=False, connect_timeout=timeout_s, error_cb=quiet, **options), timeout=timeout_s + 1.0
        )
    except Exception as err:  # every failure becomes one line
        raise MonitorInputError(f"cannot connect to {target.url}: {_why(err)}") from None
    finally:
        if not nc.is_closed:
            await nc.close()


class BusMonitor:
    """Connects, subscribes, and feeds `state` until closed. `wall` is the wall clock."""

    def __init__(
        self, state: MonitorState, target: BusTarget, *, history: bool = True, commands: bool = True, wall: Callable[[], float] = time.time
    ) -> None:
        self.state = state
        self.target = target
        self.history = history
        self.commands = commands  # watch prorsa.ctl.engine.* (a subscriber there turns a dead engine's "no responders" into a timeout)
        self.wall = wall
        self.nc: NATS | None = None
        self._inboxes: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self._lifecycle_target_seq = 0  # the stream's last sequence when the replay began
        self.lifecycle_ready = asyncio.Event()  # the replay reached the stream's end as it was at the start
        self.lifecycle_mode = ""  # "stream", "live", or "" (no LIFECYCLE stream yet)
        self.optional_failures: Counter[str] = Counter()  # optional reads that failed (origin, stream info, ...)

    def _optional_failed(self, what: str, err: BaseException) -> None:
        """An optional read failed (no bucket yet, no permission, disconnected): counted, and
        logged the first time for each kind, so the dashboard goes on without it."""
        self.optional_failures[what] += 1
        if self.optional_failures[what] == 1:
            LOG.info("%s unavailable (%s); counted, not retried until the next round", what, _why(err))

    async def start(self) -> None:
        await probe(self.target)
        state = self.state

        async def on_error(err: Exception) -> None:
            state.on_bus(error=_why(err))

        async def on_disconnect() -> None:
            state.on_bus(connected=False)

        async def on_reconnect() -> None:
            state.on_bus(connected=True, error="")

        self.nc = NATS()
        await self.nc.connect(
            self.target.url,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=1.0,
            connect_timeout=2,
            ping_interval=5,
            max_outstanding_pings=3,
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            **_connect_options(self.target),
        )
        state.on_bus(url=self.target.url, source=self.target.source, connected=True, error="")
        nc = self.nc
        for subject in (subjects.status_all(), subjects.forecast(), subjects.allocation(), subjects.train_step(), subjects.report_all()):
            await nc.subscribe(subject, cb=self._on_msg)
        await nc.subscribe(subjects.dead_letter_all(), cb=self._on_dead_letter)
        if self.commands:
            await nc.subscribe(subjects.ctl_engine("x").rsplit(".", 1)[0] + ".*", cb=self._on_command)
        for advisory in DEAD_LETTER_ADVISORIES:
            await nc.subscribe(advisory, cb=self._on_advisory)
        await nc.flush()
        await self._read_origin()
        self._tasks.append(asyncio.create_task(self._lifecycle(), name="monitor-lifecycle"))
        self._tasks.append(asyncio.create_task(self._poll_streams(), name="monitor-streams"))

    async def close(self) -> None:
        await cancel_and_wait(self._tasks, LOG)  # its stream polls are requests: a cancel may be swallowed
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.close()
            except Exception as err:  # closing a broken connection: nothing left to do
                self._optional_failed("close", err)

    # --- callbacks -------------------------------------------------------------------------
    async def _on_msg(self, msg: Msg) -> None:
        self.state.ingest(msg.subject, msg.data, self.wall())

    async def _on_dead_letter(self, msg: Msg) -> None:
        headers = msg.headers or {}
        self.state.on_dead_letter(
            stream=msg.subject.rsplit(".", 1)[-1],
            reason=headers.get(REASON_HEADER, ""),
            subject=headers.get(SUBJECT_HEADER, msg.subject),
            wall_s=self.wall(),
        )

    async def _on_lifecycle(self, msg: Msg) -> None:
        self.state.ingest(msg.subject, msg.data, self.wall())
        try:
            seq = msg.metadata.sequence.stream
        except nats.errors.NotJSMessageError:  # the plain live subscription: nothing to catch up with
            return
        if seq >= self._lifecycle_target_seq:
            self.lifecycle_ready.set()

    async def _on_command(self, msg: Msg) -> None:
        self.state.ingest(msg.subject, msg.data, self.wall())
        tokens = (msg.reply or "").split(".")
        if len(tokens) >= 3:  # a muxed request inbox (`_INBOX.<id>.<n>`): its acks arrive on `_INBOX.<id>.*`
            inbox = ".".join(tokens[:-1]) + ".*"
            if inbox not in self._inboxes and self.nc is not None:
                self._inboxes.add(inbox)
                try:
                    await self.nc.subscribe(inbox, cb=self._on_ack)
                except nats.errors.Error as err:  # a read-only role may not: heartbeats settle switches instead
                    LOG.info("cannot watch the command inbox %s: %s", inbox, err)

    async def _on_ack(self, msg: Msg) -> None:
        self.state.ingest_ack(msg.subject, msg.data, self.wall())

    async def _on_advisory(self, msg: Msg) -> None:
        try:
            advisory = json.loads(msg.data)
            stream = str(advisory.get("stream", ""))
        except (ValueError, AttributeError):
            self.state.on_invalid(msg.subject, "advisory not JSON", self.wall())
            return
        if stream not in _PRORSA_STREAMS:
            return
        kind = "terminated" if "MSG_TERMINATED" in msg.subject else "max_deliveries"
        deliveries = advisory.get("deliveries", 0)
        self.state.on_advisory(
            kind=kind,
            stream=stream,
            consumer=str(advisory.get("consumer", "")),
            deliveries=deliveries if isinstance(deliveries, int) else 0,
            wall_s=self.wall(),
        )

    # --- JetStream -------------------------------------------------------------------------
    async def _read_origin(self) -> None:
        try:
            kv = await self.nc.jetstream(timeout=1.0).key_value(RUN_BUCKET)
            entry = await kv.get(ORIGIN_KEY)
            self.state.on_bus(run_name=decode(RunOrigin, entry.value).run_name)
        except Exception as err:  # optional (no bucket yet, no permission): the header goes without
            self._optional_failed("run origin", err)

    async def _lifecycle(self) -> None:
        """Replay LIFECYCLE from its start, then follow it; wait for the stream to exist; fall
        back to a plain live subscription where JetStream is not allowed."""
        js = self.nc.jetstream()
        said_waiting = False
        while True:
            try:
                info = await js.stream_info(streams.LIFECYCLE.name)
                break
            except NotFoundError:
                if not said_waiting:
                    self.state.on_bus(lifecycle="waiting for the LIFECYCLE stream")
                    self.lifecycle_ready.set()  # nothing to catch up with
                    said_waiting = True
                await asyncio.sleep(1.0)
            except Exception as err:  # no JetStream or no permission: live events only
                await self._live_lifecycle(f"live only (no JetStream access: {_why(err)})")
                return
        self._lifecycle_target_seq = info.state.last_seq if self.history else 0
        if self._lifecycle_target_seq == 0:
            self.lifecycle_ready.set()
        try:
            await js.subscribe(
                subjects.lifecycle_all(),
                stream=streams.LIFECYCLE.name,
                cb=self._on_lifecycle,
                ordered_consumer=True,
                deliver_policy=api.DeliverPolicy.ALL if self.history else api.DeliverPolicy.NEW,
            )
        except Exception as err:
            await self._live_lifecycle(f"live only (no consumer allowed: {_why(err)})")
            return
        self.lifecycle_mode = "stream"
        self.state.on_bus(lifecycle="LIFECYCLE stream, from its start" if self.history else "LIFECYCLE stream, new events")

    async def _live_lifecycle(self, why: str) -> None:
        await self.nc.subscribe(subjects.lifecycle_all(), cb=self._on_lifecycle)
        self.lifecycle_mode = "live"
        self.lifecycle_ready.set()
        self.state.on_bus(lifecycle=why)

    async def poll_streams_once(self) -> None:
        js = self.nc.jetstream(timeout=2.0)
        for stream in streams.ALL_STREAMS:
            try:
                info = await js.stream_info(stream.name)
            except NotFoundError:
                continue
            except Exception as err:  # no permission / disconnected: try again next round
                self._optional_failed("stream info", err)
                return
            c, s = info.config, info.state
            self.state.on_stream_info(
                stream.name,
                messages=s.messages,
                bytes_=s.bytes,
                max_msgs=c.max_msgs or -1,
                max_bytes=c.max_bytes or -1,
                discard=str(getattr(c.discard, "value", c.discard) or ""),
                wall_s=self.wall(),
            )
        try:
            account = await js.account_info()
            self.state.on_account_info(
                storage_bytes=account.storage, max_storage_bytes=account.limits.max_storage or -1, wall_s=self.wall()
            )
        except Exception as err:  # no permission / disconnected: try again next round
            self._optional_failed("account info", err)

    async def _poll_streams(self) -> None:
        while True:
            if self.nc is not None and self.nc.is_connected:
                await self.poll_streams_once()
            await asyncio.sleep(STREAM_POLL_WALL_S)

    async def settle(self, min_wall_s: float, timeout_wall_s: float) -> None:
        """Wait `min_wall_s` (heartbeats to come in) and for the lifecycle replay to catch up,
        at most `timeout_wall_s` in all."""
        start = time.monotonic()
        await asyncio.sleep(min_wall_s)
        left = timeout_wall_s - (time.monotonic() - start)
        if left > 0:
            try:
                await asyncio.wait_for(self.lifecycle_ready.wait(), timeout=left)
            except TimeoutError:
                pass
        if self.nc is not None and self.nc.is_connected:
            await self.poll_streams_once()
