"""A local 3-server JetStream cluster (ops/cluster.py) and replicated streams on it: every
stream and the run's KV bucket on 3 servers; work published and consumed exactly once while
the stream's leader is `kill -9`ed and restarted; `python -m ops.cluster` serves and stops."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import nats
import nats.errors
import pytest
from nats.js import api

from actors.base.connection import BUS_ERRORS, close, connect, publish_origin, seed_urls
from actors.config import BusSection
from bus_schemas import streams, subjects
from bus_schemas.run import RUN_BUCKET
from ops.cluster import LocalCluster
from ops.natsserver import MAX_PAYLOAD_BYTES, EmbeddedNats, PortInUseError
from tests.subproc import read_until

pytestmark = pytest.mark.bus
REPO = Path(__file__).resolve().parent.parent
DEADLINE_WALL_S = 30.0
LOG = logging.getLogger("test.cluster")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as c:
        yield c


async def retry(call, what: str):
    """A JetStream call, retried while the cluster elects a new leader (it answers nothing,
    or 'not ready', for a few seconds after the loss of one)."""
    deadline = time.monotonic() + DEADLINE_WALL_S
    while True:
        try:
            return await call()
        except BUS_ERRORS as err:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} still failing after {DEADLINE_WALL_S} s: {err!r}") from err
            await asyncio.sleep(0.1)  # barrier-ok: the pause between retries of a call the cluster cannot answer yet (deadline above)


def test_seed_urls_and_bad_settings():
    assert seed_urls("nats://a:1, nats://b:2") == ["nats://a:1", "nats://b:2"]
    with pytest.raises(ValueError, match="empty entry"):
        seed_urls("nats://a:1,,nats://b:2")
    with pytest.raises(ValueError, match="at least 3 servers"):
        LocalCluster(Path("/nonexistent"), servers=2)
    with pytest.raises(msgspec.ValidationError, match="bus.replicas must be 1 to 5"):
        msgspec.convert({"replicas": 7}, BusSection)


async def test_streams_and_the_run_bucket_have_three_replicas(cluster):
    nc = await connect(cluster.seed_url, "test-replicas", LOG)
    try:
        assert nc.max_payload == MAX_PAYLOAD_BYTES  # KV and weight chunks (<= 7 MiB) pass every server
        js = nc.jetstream(timeout=10)
        await retry(lambda: streams.ensure_streams(js, replicas=3), "ensure_streams")
        await retry(lambda: publish_origin(js, "replicated", replicas=3), "publish_origin")
        await streams.ensure_streams(js)  # an actor's call (no replicas given) keeps the 3
        for stream in streams.ALL_STREAMS:
            info = await js.stream_info(stream.name)
            assert info.config.num_replicas == 3, stream.name
            assert len(info.cluster.replicas) == 2, stream.name  # a leader and two followers
        kv_info = await js.stream_info(f"KV_{RUN_BUCKET}")
        assert kv_info.config.num_replicas == 3
    finally:
        await close(nc)


async def test_work_is_consumed_exactly_once_through_the_loss_of_the_stream_leader(cluster):
    """20 work items; 10 consumed and acked; the WORK_PREFILL leader is killed (SIGKILL); the
    other 10 consumed through the failover; the server restarted: nothing redelivered, the
    queue empty on the restarted server too."""
    nc = await connect(cluster.seed_url, "test-failover", LOG)
    try:
        js = nc.jetstream(timeout=5)
        await retry(lambda: streams.ensure_streams(js, replicas=3), "ensure_streams")
        await js.purge_stream(streams.WORK_PREFILL.name)
        items = [f"turn-{i}".encode() for i in range(20)]
        for i, item in enumerate(items):
            await js.publish(subjects.work_prefill(), item, headers={"Nats-Msg-Id": f"failover-{i}"})
        sub = await streams.pull_subscription(js, streams.prefill_consumer(), ack_wait_s=60.0)
        seen: list[bytes] = []

        async def take(n: int) -> None:
            deadline = time.monotonic() + DEADLINE_WALL_S
            while len(seen) < n:
                assert time.monotonic() < deadline, f"only {len(seen)} of {n} work items consumed"
                try:
                    msgs = await sub.fetch(n - len(seen), timeout=1.0)
                except BUS_ERRORS:
                    continue  # a timeout, or no leader yet: ask again
                for msg in msgs:
                    seen.append(msg.data)
                    await retry(msg.ack_sync, "ack")  # acked means the replicated consumer recorded it

        await take(10)
        leader = (await js.stream_info(streams.WORK_PREFILL.name)).cluster.leader
        killed = int(leader.removeprefix("n"))
        cluster.kill(killed)
        await take(20)
        await asyncio.to_thread(cluster.restart, killed)
        assert sorted(seen) == sorted(items)  # each once: no loss, no duplicate
        with pytest.raises(nats.errors.TimeoutError):
            await sub.fetch(1, timeout=1.0)
        direct = await connect(cluster.urls[killed], "test-restarted", LOG)
        try:  # the restarted server caught up: its copy holds no acked work
            info = await retry(lambda: direct.jetstream(timeout=5).stream_info(streams.WORK_PREFILL.name), "stream_info")
            assert info.state.messages == 0
            assert info.config.retention == api.RetentionPolicy.WORK_QUEUE
        finally:
            await close(direct)
    finally:
        await close(nc)


def test_the_cluster_command_prints_its_urls_and_stops_on_sigterm(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops.cluster", "--servers", "3", "--out", str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        try:  # three servers' pids, then the seed url
            lines = read_until(proc, lambda seen: len(seen) == 4, 2 * DEADLINE_WALL_S)
        except AssertionError as e:
            lines = ["", "", "", str(e)]
        if not lines[3].startswith("seed url: "):  # say why it did not serve: its stderr and the servers' logs
            proc.kill()
            logs = {log.parent.name: log.read_text()[-600:] for log in sorted(tmp_path.glob("n*/nats-server.log"))}
            pytest.fail(f"stdout {lines}; stderr {proc.communicate()[1][-2000:]!r}; logs {logs}")
        urls = json.loads((tmp_path / "cluster.json").read_text())["urls"]
        assert len(urls) == 3 and all(u.startswith("nats://127.0.0.1:") and u in lines[3] for u in urls)
        pids = [int(line.split(" pid ")[1]) for line in lines[:3]]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=DEADLINE_WALL_S) == 0
        for pid in pids:  # every server gone (reaped by the command, so kill(0) fails)
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_two_runs_in_two_accounts_share_the_cluster_without_crosstalk(tmp_path):
    """Same stream names, same subjects: each run's account sees only its own messages."""
    with LocalCluster(tmp_path, accounts=("run-a", "run-b")) as c:
        creds = json.loads((tmp_path / "accounts" / "run-a.json").read_text())
        assert creds["user"] == "run-a" and oct((tmp_path / "accounts" / "run-a.json").stat().st_mode)[-3:] == "600"
        runs = {}
        for i, account in enumerate(c.accounts.values()):  # each run on its own server
            runs[account.name] = await connect(c.urls[i], f"test-{account.name}", LOG, user=account.name, password=account.password)
        try:
            for name, nc in runs.items():
                js = nc.jetstream(timeout=10)
                await retry(lambda js=js: streams.ensure_streams(js, replicas=3), "ensure_streams")
                heard: list[bytes] = []

                async def on_event(msg, heard=heard) -> None:
                    heard.append(msg.data)

                await nc.subscribe(subjects.lifecycle_all(), cb=on_event)
                runs[name] = (nc, js, heard)
            for name, (nc, js, _) in runs.items():
                await nc.flush()
                for i in range(3):
                    await js.publish(subjects.work_prefill(), f"{name}-turn-{i}".encode())
                await js.publish(subjects.lifecycle("finished"), name.encode())
            for name, (nc, js, heard) in runs.items():
                sub = await streams.pull_subscription(js, streams.prefill_consumer(), ack_wait_s=30.0)
                got = await retry(lambda sub=sub: sub.fetch(10, timeout=2.0), "fetch")  # a new R3 consumer elects its leader
                assert sorted(m.data for m in got) == [f"{name}-turn-{i}".encode() for i in range(3)]
                await nc.flush()
                assert heard == [name.encode()]
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):  # no credentials: refused
                await nats.connect(c.urls[0], allow_reconnect=False, connect_timeout=2)
        finally:
            for nc, _, _ in runs.values():
                await close(nc)


def occupy(port: int) -> socket.socket:
    """Listen on `port`, as another process that took it between our pick and the server's bind."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", port))
    sock.listen()
    return sock


def test_a_server_whose_picked_port_was_taken_starts_on_another(tmp_path):
    server = EmbeddedNats(tmp_path / "picked")
    taken = server.port
    with occupy(taken), server:
        assert server.port != taken and server.proc.poll() is None
        assert b"address already in use" in server.log_path.read_bytes()  # the first try failed, and said why


def test_a_server_given_a_taken_port_says_so(tmp_path):
    with occupy(0) as sock:
        port = sock.getsockname()[1]
        with pytest.raises(PortInUseError, match="address already in use"):
            EmbeddedNats(tmp_path / "given", port=port).start()


def test_a_cluster_whose_route_port_was_taken_starts_on_new_ports(tmp_path):
    """A taken route port makes its server exit (a PortInUseError for a port that is not its
    client port): the cluster stops every server, picks every port again and starts."""
    cluster = LocalCluster(tmp_path)
    taken = cluster.route_ports[1]
    with occupy(taken), cluster:
        assert taken not in cluster.route_ports
        assert all(cluster.pid(i) is not None for i in range(3))
        assert b"address already in use" in cluster.servers[1].log_path.read_bytes()
