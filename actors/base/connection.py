"""Connecting to the bus: reconnect forever, pings, every disconnect logged; credentials and
TLS files from the caller or the environment (PRORSA_NATS_USER, PRORSA_NATS_PASSWORD;
PRORSA_NATS_TLS_CA, PRORSA_NATS_TLS_CERT, PRORSA_NATS_TLS_KEY). A URL may list several seed
servers of one cluster, comma-separated: the client connects to one of them, learns the rest
of the cluster from it, and fails over to another when its server goes away."""

from __future__ import annotations

import logging
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec
import nats.aio.client
import nats.errors
from nats.aio.client import Client as NATS
from nats.js.client import JetStreamContext
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

from actors.base.clock import wall_now_s
from bus_schemas import streams
from bus_schemas.codec import decode, encode
from bus_schemas.run import ORIGIN_KEY, RUN_BUCKET, RunOrigin

# what a failed bus call raises: nats-py's errors (JetStream's and its timeout among them) and
# socket errors; the in-process bus raises the same types
BUS_ERRORS: tuple[type[BaseException], ...] = (nats.errors.Error, OSError)

NATS_READ_BYTES = 1 << 20  # what nats-py's read loop takes from the socket per turn (its default: 32 KiB)


def widen_nats_reads() -> None:
    """Let nats-py's read loop take up to NATS_READ_BYTES per turn. It reads
    `nats.aio.client.DEFAULT_BUFFER_SIZE` bytes at a time, looked up on every read (and used as
    the stream's buffer limit at the next (re)connect): 32 KiB made a 1 MiB KV reply 32 loop
    turns, each a read, a parser call and a bytearray extend. Process-wide: it is one knob of
    the library, and a larger read only returns what is already there."""
    nats.aio.client.DEFAULT_BUFFER_SIZE = max(nats.aio.client.DEFAULT_BUFFER_SIZE, NATS_READ_BYTES)


# credentials for a server that requires them (the launcher's embedded one does: ops/natsserver.py);
# explicit arguments win, then these environment variables
USER_ENV, PASSWORD_ENV = "PRORSA_NATS_USER", "PRORSA_NATS_PASSWORD"


# TLS: the CA bundle that signs the servers' certificates, and (mutual TLS) this client's own
# certificate and key, all PEM files; explicit arguments win, then these environment variables
TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV = "PRORSA_NATS_TLS_CA", "PRORSA_NATS_TLS_CERT", "PRORSA_NATS_TLS_KEY"


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """What a client needs to speak TLS to the bus: the CA bundle it trusts and, where the
    server verifies clients (mutual TLS), its own certificate and key (both or neither)."""

    ca: str
    cert: str = ""
    key: str = ""

    def __post_init__(self) -> None:
        if not self.ca:
            raise ValueError("TLS needs a CA bundle (the PEM file of the CA that signed the servers' certificates)")
        if bool(self.cert) != bool(self.key):
            raise ValueError("a TLS client certificate needs its key, and a key its certificate")

    def env(self) -> dict[str, str]:
        """The environment a child process reads these from (`from_env`)."""
        return {TLS_CA_ENV: self.ca, TLS_CERT_ENV: self.cert, TLS_KEY_ENV: self.key}

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> TlsFiles | None:
        """The files named in `environ` (default: this process's environment), or None."""
        env = os.environ if environ is None else environ
        ca = env.get(TLS_CA_ENV) or ""
        return TlsFiles(ca, env.get(TLS_CERT_ENV) or "", env.get(TLS_KEY_ENV) or "") if ca else None

    def context(self) -> ssl.SSLContext:
        """A client context that trusts only `ca` and checks the server's name; OSError (one
        line, the file named) where a file is missing or unreadable."""
        try:
            context = ssl.create_default_context(cafile=self.ca)
            if self.cert:
                context.load_cert_chain(self.cert, self.key)
        except (OSError, ssl.SSLError) as err:
            raise OSError(f"TLS files (ca {self.ca!r}, cert {self.cert!r}, key {self.key!r}) unusable: {err}") from err
        return context


def tls_options(tls: TlsFiles | None) -> dict:
    """nats-py's connect options for `tls` (or the environment's; none: plaintext, unless a
    tls:// URL asks nats-py for TLS against the system's CAs)."""
    tls = tls or TlsFiles.from_env()
    return {"tls": tls.context()} if tls else {}


def inbox_prefix(user: str | None) -> str:
    """A user's own reply inbox (the server lets each user subscribe only to its own)."""
    return f"_INBOX_{user}" if user else "_INBOX"


def seed_urls(url: str) -> list[str]:
    """'nats://a:4222,nats://b:4222' -> each URL; an empty entry is an error, not a skip."""
    urls = [part.strip() for part in url.split(",")]
    if not all(urls):
        raise ValueError(f"NATS URL list {url!r} has an empty entry")
    return urls


async def connect(
    url: str, name: str, log: logging.Logger, user: str | None = None, password: str | None = None, tls: TlsFiles | None = None
) -> NATS:
    widen_nats_reads()
    user = user or os.environ.get(USER_ENV) or None
    password = password or os.environ.get(PASSWORD_ENV) or None

    async def on_error(err: Exception) -> None:
        log.warning("nats error: %s", err)

    async def on_disconnect() -> None:
        if not (nc.is_closed or nc.is_draining):
            log.warning("disconnected from %s; reconnecting", url)

    async def on_reconnect() -> None:
        log.info("reconnected to %s", nc.connected_url.geturl() if nc.connected_url else url)

    nc = NATS()
    await nc.connect(
        seed_urls(url),
        name=name,
        allow_reconnect=True,
        max_reconnect_attempts=-1,  # forever
        reconnect_time_wait=0.25,
        ping_interval=5,
        max_outstanding_pings=3,
        connect_timeout=5,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        user=user,
        password=password,
        inbox_prefix=inbox_prefix(user),
        **tls_options(tls),
    )
    return nc


async def close(nc: NATS) -> None:
    """Flush what was published, then close. (Not drain: pull subscriptions make drain wait
    for its full timeout, and every piece of work has been acked or returned by now.)"""
    if nc.is_connected:
        try:
            await nc.flush(timeout=2)
        except BUS_ERRORS as err:  # a flush that fails at exit changes nothing: the close follows
            logging.getLogger("prorsa.connection").warning("flush before close failed: %r", err)
    try:
        await nc.close()
    except BUS_ERRORS as err:  # the server went first (its socket reset while nats-py flushed): closed anyway
        logging.getLogger("prorsa.connection").warning("close found the connection lost: %r", err)


async def run_bucket(js: JetStreamContext, replicas: int = 1):
    """The run's KV bucket; `replicas` ([bus] replicas) applies when this call creates it."""
    try:
        return await js.key_value(RUN_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(bucket=RUN_BUCKET, history=1, replicas=replicas)


async def publish_origin(js: JetStreamContext, run_name: str, origin_wall_s: float | None = None, replicas: int = 1) -> RunOrigin:
    """Set model time 0 for a new run (the launcher does this before starting actors)."""
    origin = RunOrigin(origin_wall_s=wall_now_s() if origin_wall_s is None else origin_wall_s, run_name=run_name)
    kv = await run_bucket(js, replicas)
    await streams.answered(lambda: kv.put(ORIGIN_KEY, encode(origin)))  # a new R3 bucket may not have a leader yet
    return origin


async def read_origin(js: JetStreamContext, run_name: str) -> RunOrigin:
    """The run's origin; an actor started by hand on an empty bus sets it to now."""
    kv = await run_bucket(js)
    try:
        entry = await kv.get(ORIGIN_KEY)
        return decode(RunOrigin, entry.value)
    except KeyNotFoundError:
        origin = RunOrigin(origin_wall_s=wall_now_s(), run_name=run_name)
        try:
            await kv.create(ORIGIN_KEY, encode(origin))
            return origin
        except KeyWrongLastSequenceError:  # another actor won the race
            return decode(RunOrigin, (await kv.get(ORIGIN_KEY)).value)
    except msgspec.DecodeError as err:
        raise RuntimeError(f"run origin in bucket {RUN_BUCKET!r} is malformed: {err}") from err
