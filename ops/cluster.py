"""A local JetStream cluster: N nats-servers on loopback, for tests and trials.

    python -m ops.cluster [--servers 3] --out DIR [--sync-interval always|2m] [--accounts run-a,run-b] [--tls]

Each server is the project's own `nats-server` binary (`ops/natsserver.py`), configured by a
generated file: its client port and route port on 127.0.0.1, a store folder DIR/n<i>/jetstream,
the same `max_payload` as the embedded server, and routes to every other server (a full
mesh, one cluster name). Without `--accounts` anyone on this host may connect. With them,
each name is a NATS account with JetStream and one user (the account's name, a fresh random
password in DIR/accounts/<name>.json, mode 0600): one account per run, so runs sharing the
cluster see neither each other's messages nor streams (same subjects, same stream names).
Run each run's launchers with PRORSA_NATS_USER / PRORSA_NATS_PASSWORD set to its account's.
With `--tls` a fresh CA under DIR/tls signs the servers' certificate (`ops/tls.py`): clients
must speak TLS (tls:// URLs) with a client certificate the CA signed (mutual TLS), and the
routes between the servers run over TLS too; the command prints the `[bus]` settings a run's
launchers take (tls = "on", tls_ca, tls_cert, tls_key).
The command prints the client URLs (and writes them to DIR/cluster.json), then serves until
Ctrl-C or SIGTERM, and stops every server.

`LocalCluster` is the same thing for tests: start, stop, `kill(i)` (SIGKILL, the loss of a
server) and `restart(i)` (same port, same store: it rejoins and catches up); for the chaos
soak (`runners/chaos_soak.py`) also `freeze(i)` / `thaw(i)` (SIGSTOP / SIGCONT), `revive(i)`
(a restart that does not wait for a metadata leader), and the Raft elections won, read from
the servers' logs (`leader_changes`, `meta_leader`).

Below it, how launchers on several hosts share one run (`ops.launch --only`): the host that
starts `control` creates the streams and the run's origin; the others wait for that origin
(`wait_for_run`). When the trainer is done, the control host writes the run's end to the run
bucket (`announce_end`); the others see it (`watch_end`), stop their actors (each publishes
its final report) and exit; the control host waits for every actor's report
(`wait_for_reports`), then exports the log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import secrets
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import msgspec
from nats.js import api
from nats.js.client import JetStreamContext

from actors.base.connection import BUS_ERRORS, TlsFiles, close, connect
from bus_schemas import streams, subjects
from bus_schemas.codec import decode
from bus_schemas.run import ORIGIN_KEY, RUN_BUCKET, RunOrigin
from bus_schemas.status import ActorReport
from ops.access import User, write_credentials
from ops.natsserver import PORT_TRIES, EmbeddedNats, PortInUseError, exited_error, free_port
from ops.tls import make_local_pki

CLUSTER_NAME = "prorsa"
READY_STREAM = "CLUSTER_READY"  # created on every server, then deleted, before start() returns
LOG = logging.getLogger("prorsa.cluster")
MIN_SERVERS = 3  # JetStream keeps a quorum (and its R3 streams) through the loss of one server
META_LEADER_TIMEOUT_WALL_S = 30.0
META_LEADER_LINES = (b"Self is new JetStream cluster metadata leader", b"JetStream cluster new metadata leader")
# what the winner of a Raft election logs (only the winner: a follower's "new metadata leader: nX"
# is not one), by the group's kind; the group is the stream ('ACCOUNT > STREAM') or consumer
# ('ACCOUNT > STREAM > CONSUMER'), "_meta_" for the metadata group
ELECTED = re.compile(
    r"^\[\d+\] (?P<ts>\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+) \[INF\] "
    r"(?:(?P<meta>Self is new JetStream cluster metadata leader)|JetStream cluster new (?P<kind>stream|consumer) leader for '(?P<group>[^']*)')"
)
LOG_TIME_FORMAT = "%Y/%m/%d %H:%M:%S.%f"  # nats-server's log time: local time, microseconds


def accounts_block(users: dict[str, User]) -> str:
    """The config's `accounts` block: one account per user, named after it, with JetStream."""
    accounts = {name: {"jetstream": "enabled", "users": [{"user": u.name, "password": u.password}]} for name, u in users.items()}
    return "accounts: " + json.dumps(accounts, indent=1) + "\n"


class LeaderChange(msgspec.Struct, frozen=True):
    """One Raft election won, as its winner logged it."""

    wall_s: float  # Unix time, from the log line's local time
    server: int  # the winner, n<server>
    kind: str  # meta | stream | consumer
    group: str  # "_meta_", the stream ('$G > LIFECYCLE') or the consumer ('$G > TASKS > environments')


def parse_leader_change(line: str, server: int) -> LeaderChange | None:
    """The election a log line reports won by `server`, or None if it reports none."""
    m = ELECTED.match(line)
    if m is None:
        return None
    wall_s = datetime.strptime(m["ts"], LOG_TIME_FORMAT).timestamp()
    return LeaderChange(wall_s, server, "meta", "_meta_") if m["meta"] else LeaderChange(wall_s, server, m["kind"], m["group"])


class LocalCluster:
    def __init__(
        self,
        root: Path,
        servers: int = 3,
        sync_interval: str = "always",
        name: str = CLUSTER_NAME,
        accounts: tuple[str, ...] = (),
        tls: bool = False,
    ) -> None:
        if servers < MIN_SERVERS:
            raise ValueError(f"a JetStream cluster needs at least {MIN_SERVERS} servers to survive the loss of one, not {servers}")
        for account in accounts:
            if not re.fullmatch(r"[A-Za-z0-9_-]+", account):
                raise ValueError(f"account name {account!r}: use letters, digits, '-' and '_'")
        self.root = Path(root)
        # account name -> its one user (same name, fresh password); empty: no authorization
        self.accounts = {a: User(a, secrets.token_urlsafe(24), (">",), (">",)) for a in accounts}
        self.name, self.sync_interval, self.n_servers = name, sync_interval, servers
        self.pki = make_local_pki(self.root / "tls") if tls else None  # clients and routes over TLS
        self.servers: list[EmbeddedNats] = []
        self.route_ports: list[int] = []
        self.configure()

    def configure(self) -> None:
        """Pick each server's route port and build its server (which picks its own client port);
        nothing is written yet (start() writes the configs)."""
        auth = accounts_block(self.accounts) if self.accounts else ""
        self.route_ports = [free_port() for _ in range(self.n_servers)]
        self.servers = []
        for i, route_port in enumerate(self.route_ports):
            routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for j, p in enumerate(self.route_ports) if j != i)
            route_tls = self.pki.server.block() if self.pki else ""
            block = f'cluster {{\n  name: "{self.name}"\n  listen: "127.0.0.1:{route_port}"\n  routes: [{routes}]\n{route_tls}}}\n'
            self.servers.append(
                EmbeddedNats(
                    self.root / f"n{i}",
                    sync_interval=self.sync_interval,
                    authorization=auth,
                    server_name=f"n{i}",
                    cluster=block,
                    tls=self.pki and self.pki.server,
                )
            )

    @property
    def client_tls(self) -> TlsFiles | None:
        """What a client of this cluster trusts and shows (None: plaintext)."""
        return self.pki.client if self.pki else None

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def seed_url(self) -> str:
        """Every server's URL, comma-separated: what `--nats-url` takes."""
        return ",".join(self.urls)

    def pid(self, i: int) -> int | None:
        proc = self.servers[i].proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> list[str]:
        if self.accounts:
            write_credentials(self.root / "accounts", self.accounts)
        for attempt in range(PORT_TRIES):
            offsets = [self._log_size(s) for s in self.servers]
            try:
                for server in self.servers:
                    server.start()
                self._wait_meta_leader(offsets)
                with ThreadPoolExecutor(1) as pool:  # its own event loop: a caller may be inside one
                    pool.submit(asyncio.run, self._wait_replicated_stream()).result()
                return self.urls
            except PortInUseError as err:
                self.stop()
                if attempt == PORT_TRIES - 1:
                    raise
                LOG.warning("%s; picking new ports", err)
                self.configure()  # a route port taken between our pick and the server's bind
            except BaseException:
                self.stop()
                raise
        raise AssertionError("unreachable")

    def kill(self, i: int) -> int:
        """SIGKILL server i (no shutdown, no flush): the loss of a machine. Returns its pid."""
        proc = self.servers[i].proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"server n{i} is not running")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return proc.pid

    def restart(self, i: int) -> str:
        """Start server i again on its port and store; it rejoins the cluster."""
        offset = self._log_size(self.servers[i])
        url = self.servers[i].start()
        self._wait_meta_leader([offset if j == i else None for j in range(len(self.servers))])
        return url

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def freeze(self, i: int) -> int:
        """SIGSTOP server i: a server that hangs (its sockets open, nothing answered, no Raft
        heartbeat sent) until `thaw(i)`. Returns its pid."""
        pid = self.pid(i)
        if pid is None:
            raise RuntimeError(f"server n{i} is not running")
        os.kill(pid, signal.SIGSTOP)
        return pid

    def thaw(self, i: int) -> int:
        """SIGCONT server i (frozen by `freeze`): it goes on where it stopped. Returns its pid."""
        pid = self.pid(i)
        if pid is None:
            raise RuntimeError(f"server n{i} is not running")
        os.kill(pid, signal.SIGCONT)
        return pid

    def revive(self, i: int) -> str:
        """Start server i again on its port and store, and return once it takes clients,
        without waiting for a metadata leader (`restart` waits for one: while the cluster
        elects, that is a wait for the election's end). As with `start` and `restart`, call it
        from a thread that outlives the server: the server gets SIGTERM when the thread that
        started it exits (`ops.procs.die_with_parent`), a worker thread included."""
        return self.servers[i].start()

    def leader_changes(self, since_wall_s: float = 0.0, until_wall_s: float = float("inf")) -> list[LeaderChange]:
        """Every Raft election won in [since_wall_s, until_wall_s) (Unix time), read from the
        servers' logs (restarts append to them), oldest first."""
        changes = []
        for i, server in enumerate(self.servers):
            if not server.log_path.exists():
                continue
            for line in server.log_path.read_text(errors="replace").splitlines():
                change = parse_leader_change(line, i)
                if change is not None and since_wall_s <= change.wall_s < until_wall_s:
                    changes.append(change)
        return sorted(changes, key=lambda c: c.wall_s)

    def leaders(self) -> dict[str, int]:
        """Each Raft group's leader as the logs last tell it ('_meta_', '$G > LIFECYCLE', ...
        -> server index). A group deleted since stays in it; a frozen leader stays until a
        new one is elected."""
        return {c.group: c.server for c in self.leader_changes()}

    def meta_leader(self) -> int | None:
        """The running server that last won the metadata group's election (from the logs), or
        None if no running server has."""
        won = [c.server for c in self.leader_changes() if c.kind == "meta" and self.pid(c.server) is not None]
        return won[-1] if won else None

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @staticmethod
    def _log_size(server: EmbeddedNats) -> int:
        return server.log_path.stat().st_size if server.log_path.exists() else 0

    def _wait_meta_leader(self, offsets: list[int | None]) -> None:
        """Until every server given an offset has logged, after it, that it knows the JetStream
        metadata leader (before that, stream requests fail with 'JetStream not ready')."""
        deadline = time.monotonic() + META_LEADER_TIMEOUT_WALL_S
        waiting = {i for i, offset in enumerate(offsets) if offset is not None}
        while waiting and time.monotonic() < deadline:
            for i in list(waiting):
                proc = self.servers[i].proc
                if proc is not None and proc.poll() is not None:  # exited after "ready": say why now, not after the timeout
                    raise exited_error(proc, self.servers[i].log_path, offsets[i])
                tail = self.servers[i].log_path.read_bytes()[offsets[i] :]
                if any(line in tail for line in META_LEADER_LINES):
                    waiting.discard(i)
            time.sleep(0.05)
        if waiting:
            names = ", ".join(f"n{i}" for i in sorted(waiting))
            raise RuntimeError(
                f"no JetStream metadata leader seen by {names} after {META_LEADER_TIMEOUT_WALL_S} s; see {self.root}/n*/nats-server.log"
            )

    async def _wait_replicated_stream(self) -> None:
        """Until a stream replicated on every server can be created (and is deleted again):
        a known metadata leader is not yet a cluster whose peers all answer, and a run
        started earlier finds its R3 streams waiting on a peer."""
        user = next(iter(self.accounts.values()), None)
        nc = await connect(
            self.seed_url, "cluster-ready", LOG, user=user and user.name, password=user and user.password, tls=self.client_tls
        )
        js = nc.jetstream(timeout=5)
        probe = api.StreamConfig(
            name=READY_STREAM, subjects=[f"_prorsa.{READY_STREAM}"], num_replicas=len(self.servers), storage=api.StorageType.MEMORY
        )
        deadline = time.monotonic() + META_LEADER_TIMEOUT_WALL_S
        try:
            while True:
                try:
                    await js.add_stream(probe)
                    await js.delete_stream(READY_STREAM)
                    return
                except BUS_ERRORS as err:
                    if time.monotonic() > deadline:
                        raise RuntimeError(
                            f"no stream on all {len(self.servers)} servers after {META_LEADER_TIMEOUT_WALL_S} s ({err!r}); see {self.root}/n*/nats-server.log"
                        ) from err
                    await asyncio.sleep(POLL_WALL_S)
        finally:
            await close(nc)


# --- one run, launchers on several hosts ---------------------------------------------------
END_KEY = "end"  # in the run bucket: the control host's RunEnd
POLL_WALL_S = 0.25


class RunEnd(msgspec.Struct, frozen=True, kw_only=True):
    """The end of a run, as the control host saw it."""

    origin_wall_s: float  # which run (its RunOrigin): a stale end of an earlier run is ignored
    status: str  # completed | failed | interrupted


async def _wait(stop: asyncio.Event, timeout_wall_s: float) -> None:
    try:
        await asyncio.wait_for(stop.wait(), timeout_wall_s)
    except TimeoutError:
        pass


async def wait_for_run(js: JetStreamContext, run_name: str, stop: asyncio.Event) -> RunOrigin | None:
    """The origin of the run named `run_name`, once its control host has created the streams
    and published it; None if `stop` is set first. (Give each run its own name: an earlier
    run of the same name on the same cluster is indistinguishable.)"""
    while not stop.is_set():
        try:
            origin = decode(RunOrigin, (await (await js.key_value(RUN_BUCKET)).get(ORIGIN_KEY)).value)
            if origin.run_name == run_name:
                await js.stream_info(streams.ALL_STREAMS[-1].name)  # the last one ensure_streams creates
                return origin
        except BUS_ERRORS:  # no bucket, no key, no stream yet, or the cluster electing a leader
            pass
        await _wait(stop, POLL_WALL_S)
    return None


async def announce_end(js: JetStreamContext, origin: RunOrigin, status: str, timeout_wall_s: float = 30.0) -> None:
    """Write the run's end, retried while the cluster elects a new leader (after the loss of a server)."""
    end = msgspec.json.encode(RunEnd(origin_wall_s=origin.origin_wall_s, status=status))
    deadline = asyncio.get_running_loop().time() + timeout_wall_s
    while True:
        try:
            await (await js.key_value(RUN_BUCKET)).put(END_KEY, end)
            return
        except BUS_ERRORS:
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(POLL_WALL_S)


async def watch_end(js: JetStreamContext, origin: RunOrigin, stop: asyncio.Event) -> str | None:
    """The status the control host gave this run's end; None if `stop` is set first."""
    while not stop.is_set():
        try:
            end = msgspec.json.decode((await (await js.key_value(RUN_BUCKET)).get(END_KEY)).value, type=RunEnd)
            if end.origin_wall_s == origin.origin_wall_s:
                return end.status
        except BUS_ERRORS:  # no end yet, or the cluster electing a leader
            pass
        await _wait(stop, POLL_WALL_S)
    return None


async def wait_for_reports(js: JetStreamContext, actor_ids: list[str], timeout_wall_s: float) -> list[str]:
    """Wait until every actor has published its final report; return those still missing."""
    missing = list(actor_ids)
    deadline = asyncio.get_running_loop().time() + timeout_wall_s
    while missing:
        for actor_id in list(missing):
            try:
                last = await js.get_last_msg(streams.REPORTS.name, subjects.report(actor_id))
            except BUS_ERRORS:  # not there yet
                continue
            try:
                final = decode(ActorReport, last.data).final  # a checkpoint of a running actor is not its final report
            except msgspec.DecodeError:
                final = True  # something is there; the export counts what does not decode
            if final:
                missing.remove(actor_id)
        if not missing or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(POLL_WALL_S)
    return missing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", type=int, default=3, help=f"how many servers (at least {MIN_SERVERS})")
    parser.add_argument("--out", type=Path, required=True, help="folder for the servers' configs, logs and stores")
    parser.add_argument("--sync-interval", default="always", help="JetStream fsync: 'always' (default) or a period such as '2m'")
    parser.add_argument("--accounts", default="", help="comma-separated account names, one per run (default: no authorization)")
    parser.add_argument(
        "--tls", action="store_true", help="a local CA under DIR/tls; clients and routes over TLS, clients with certificates"
    )
    args = parser.parse_args(argv)
    try:
        accounts = tuple(filter(None, args.accounts.split(",")))
        cluster = LocalCluster(args.out, args.servers, args.sync_interval, accounts=accounts, tls=args.tls)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start()
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    tls = cluster.client_tls
    record = {"urls": cluster.urls, "seed_url": cluster.seed_url} | ({"tls": tls.env()} if tls else {})
    (args.out / "cluster.json").write_text(json.dumps(record) + "\n")
    for i, url in enumerate(cluster.urls):
        print(f"n{i} {url} pid {cluster.pid(i)}", flush=True)
    for account in cluster.accounts:
        print(f"account {account}: credentials in {args.out / 'accounts' / (account + '.json')}", flush=True)
    if tls:
        print(f'[bus] settings of a run on it: tls = "on", tls_ca = "{tls.ca}", tls_cert = "{tls.cert}", tls_key = "{tls.key}"', flush=True)
    print(f"seed url: {cluster.seed_url}  (Ctrl-C stops the cluster)", flush=True)
    rc = 0
    while not stop.wait(0.5):
        dead = [f"n{i}" for i in range(len(cluster.servers)) if cluster.pid(i) is None]
        if dead:
            print(f"error: {', '.join(dead)} exited; see {args.out}", file=sys.stderr)
            rc = 1
            break
    cluster.stop()
    print("cluster stopped", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
