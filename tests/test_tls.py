"""TLS on the bus: a server that requires it refuses a plaintext client, a client that trusts
another CA, and (mutual TLS) a client without a certificate its CA signed; a client with the
run's files talks to it; a whole run completes over TLS, on one embedded server and on a
3-server cluster whose routes run over TLS too."""

from __future__ import annotations

import asyncio
import json
import socket
import ssl
from pathlib import Path

import nats
import pytest
import trustme

from actors.base.connection import TlsFiles, close, connect
from actors.config import load_config
from ops.launch import check_bus
from ops.natsserver import EmbeddedNats
from ops.tls import make_local_pki
from runners.cluster_check import passed, run_check
from tests.conftest import write_tiny_config

pytestmark = pytest.mark.bus

LOG = __import__("logging").getLogger("test_tls")


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    """An embedded server that requires TLS with client certificates, and the run's files."""
    root = tmp_path_factory.mktemp("tls")
    pki = make_local_pki(root / "tls")
    server = EmbeddedNats(root / "nats", tls=pki.server)
    server.start()
    yield server, pki
    server.stop()


def _plaintext_exchange(port: int) -> bytes:
    """What the server answers a client that sends CONNECT and PING in plaintext, up to the
    end of the connection or of its first line."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        info = sock.recv(4096)
        assert info.startswith(b"INFO ") and b'"tls_required":true' in info
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false,"tls_required":false}\r\nPING\r\n')
        answer = b""
        while b"\r\n" not in answer:
            chunk = sock.recv(4096)
            if not chunk:
                break
            answer += chunk
        return answer


def test_a_plaintext_client_is_refused(tls_server):
    server, _ = tls_server
    assert server.url.startswith("tls://")
    answer = _plaintext_exchange(server.port)  # the server closes the connection (or says why, then closes)
    assert b"PONG" not in answer and (answer == b"" or answer.startswith(b"-ERR")), answer


async def test_a_client_that_trusts_another_ca_is_refused(tls_server, tmp_path):
    server, pki = tls_server
    other = trustme.CA()
    other.cert_pem.write_to_path(str(tmp_path / "other-ca.pem"))
    wrong = TlsFiles(str(tmp_path / "other-ca.pem"), pki.client.cert, pki.client.key)
    with pytest.raises((ssl.SSLError, nats.errors.NoServersError, OSError)):
        await asyncio.wait_for(_connect_once(server.url, wrong), 20)


async def test_a_client_without_a_certificate_is_refused_under_mutual_tls(tls_server):
    server, pki = tls_server
    with pytest.raises((ssl.SSLError, nats.errors.NoServersError, nats.errors.Error, OSError)):
        nc = await asyncio.wait_for(_connect_once(server.url, TlsFiles(pki.client.ca)), 20)
        await nc.flush(timeout=5)  # a TLS 1.3 server's refusal of the client's certificate arrives after the handshake


async def test_a_client_with_the_runs_files_talks_over_tls(tls_server):
    server, pki = tls_server
    nc = await connect(server.url, "tls-ok", LOG, tls=pki.client)
    try:
        sub = await nc.subscribe("prorsa.test.tls")
        await nc.publish("prorsa.test.tls", b"over tls")
        msg = await sub.next_msg(timeout=5)
        assert msg.data == b"over tls" and nc.connected_url.scheme == "tls"
    finally:
        await close(nc)


async def _connect_once(url: str, tls: TlsFiles):
    """One attempt, no reconnects: a refusal surfaces as an exception."""
    nc = nats.NATS()
    await nc.connect(url, tls=tls.context(), allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5)
    return nc


def test_tls_settings_that_do_not_fit_the_bus_are_refused_in_one_line(tmp_path):
    config = write_tiny_config(tmp_path / "tiny.toml")
    text = config.read_text()
    local = tmp_path / "local.toml"
    local.write_text(text + '\n[bus]\ntls = "local"\n')
    with pytest.raises(Exception, match="for a server given with --nats-url use 'on'"):
        check_bus(load_config(local), "tls://127.0.0.1:4222")
    on = tmp_path / "on.toml"
    on.write_text(text + f'\n[bus]\ntls = "on"\ntls_ca = "{tmp_path / "missing.pem"}"\n')
    with pytest.raises(Exception, match="the embedded server makes its own"):
        check_bus(load_config(on), None)
    with pytest.raises(Exception, match="no such file"):
        check_bus(load_config(on), "tls://127.0.0.1:4222")
    half = tmp_path / "half.toml"
    half.write_text(text + '\n[bus]\ntls = "on"\ntls_ca = "ca.pem"\ntls_cert = "c.pem"\n')
    with pytest.raises(Exception, match="tls_cert and bus.tls_key go together"):
        load_config(half)


@pytest.mark.e2e
def test_a_whole_run_completes_over_tls_on_the_embedded_server(tmp_path: Path):
    from ops.launch import main

    config = write_tiny_config(tmp_path / "tiny.toml", policy="prorsa")
    config.write_text(config.read_text() + '\n[bus]\ntls = "local"\n')
    out = tmp_path / "run"
    assert main([str(config), "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    bus = json.loads((out / "bus.json").read_text())
    assert bus["url"].startswith("tls://") and Path(bus["tls_ca"]).is_file() and Path(bus["tls_cert"]).is_file()
    assert summary["status"] == "completed" and summary["trajectories_lost"] == 0
    assert summary["trajectories_finished"] == summary["trajectories_expected"] > 0
    assert "TLS" in (out / "nats" / "nats-server.log").read_text()  # the server did serve TLS


@pytest.mark.e2e
def test_a_whole_run_completes_over_tls_on_a_three_server_cluster(tmp_path):
    summary = run_check(
        tmp_path, steps=1, time_scale=50.0, kill=False, first_finish_timeout_wall_s=90.0, run_timeout_wall_s=120.0, tls=True
    )
    assert passed(summary), json.dumps(summary, indent=1)
    assert summary["trajectories_finished"] == summary["trajectories_expected"] == 4
    config = (tmp_path / "cluster-check.toml").read_text()
    assert 'tls = "on"' in config
    assert all(url.startswith("tls://") for url in json.loads((tmp_path / "control" / "bus.json").read_text())["url"].split(","))


async def test_one_attempt_with_the_runs_files_connects(tls_server):
    """The refusals above are the server's: the same one-attempt connect with the run's own
    files succeeds."""
    server, pki = tls_server
    nc = await asyncio.wait_for(_connect_once(server.url, pki.client), 20)
    try:
        await nc.flush(timeout=5)
        assert nc.is_connected
    finally:
        await nc.close()
