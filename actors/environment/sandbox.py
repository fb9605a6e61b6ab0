"""Run untrusted Python in a subprocess with time, memory and output limits, no network and a
scratch folder of its own (the `code` environment's tool).

    write main.py to a fresh scratch folder
      └▶ [unshare -rn] python -I -c BOOTSTRAP      (an empty network namespace where the kernel
           │  setrlimit: CPU s, address space,       allows unprivileged user namespaces)
           │  file size, open files, no core
           │  audit hook: no sockets, no subprocesses, no ctypes,
           │  no change to files outside the scratch folder
           └▶ runpy main.py, stdout / stderr to files in the scratch folder
      wall timeout: the whole process group is killed; the folder is removed afterwards

The limits are set inside the child before the user's code runs, hard limit = soft limit, so
the code cannot raise them. The audit hook is a second line, not a boundary (Python's audit
hooks can be got round by native code); the network namespace and the rlimits are the
boundary. Nothing is read from the child but its two output files, each cut at
`Limits.output_bytes`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

BOOTSTRAP = r"""
import resource, runpy, sys
cpu_s, memory_bytes, file_bytes = (int(x) for x in sys.argv[1:4])
for what, value in ((resource.RLIMIT_CPU, cpu_s), (resource.RLIMIT_AS, memory_bytes),
                    (resource.RLIMIT_FSIZE, file_bytes), (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(what, (value, value))
import os
BLOCKED = ("socket.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.kill", "ctypes.")
CHANGES = ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.symlink",
           "os.link", "os.utime", "shutil.")
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
SCRATCH = os.path.realpath(".")
def inside(path):
    return isinstance(path, int) or os.path.realpath(os.fsdecode(path)).startswith(SCRATCH + os.sep)
def refuse(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    writes = event == "open" and ((args[1] is not None and any(c in args[1] for c in "wax+")) or (args[2] or 0) & WRITE_FLAGS)
    if (writes or event.startswith(CHANGES)) and args and not inside(args[0]):
        raise PermissionError(f"sandbox: {event} {args[0]!r}: only the scratch folder may be changed")
sys.addaudithook(refuse)
sys.argv = ["main.py", *sys.argv[4:]]
runpy.run_path("main.py", run_name="__main__")
"""


@dataclass(frozen=True, slots=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 << 20  # address space (the interpreter itself takes ~20 MiB)
    file_bytes: int = 1 << 20  # any one file the code writes, its output included
    output_bytes: int = 4096  # read back from each of stdout and stderr


@dataclass(frozen=True, slots=True)
class RunResult:
    stdout: str
    stderr: str
    exit_code: int  # negative: killed by that signal
    timed_out: bool  # the wall limit ran out

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@functools.cache
def network_namespace_prefix() -> tuple[str, ...]:
    """`unshare -rn` where this kernel lets an unprivileged process have an empty network
    namespace, else nothing (the audit hook still refuses sockets)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    try:
        probe = subprocess.run([unshare, "-rn", "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ()
    return (unshare, "-rn") if probe.returncode == 0 else ()


async def run_python(code: str, limits: Limits = Limits(), files: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> RunResult:
    """Run `code` as a script (`main.py`, with `args`) in a fresh scratch folder holding
    `files` (name -> text), under `limits`."""
    scratch = Path(tempfile.mkdtemp(prefix="prorsa-sandbox-"))
    try:
        for name, text in {**(files or {}), "main.py": code}.items():
            (scratch / Path(name).name).write_text(text)
        argv = [*network_namespace_prefix(), sys.executable, "-I", "-c", BOOTSTRAP]
        argv += [str(limits.cpu_s), str(limits.memory_bytes), str(limits.file_bytes), *args]
        env = {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "TMPDIR": str(scratch), "PYTHONDONTWRITEBYTECODE": "1"}
        with open(scratch / ".stdout", "wb") as out, open(scratch / ".stderr", "wb") as err:
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=scratch, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True
            )
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), limits.wall_s)
        except TimeoutError:
            timed_out = True
        finally:
            _kill_group(proc.pid)  # the code's own children too
            await proc.wait()
        return RunResult(_head(scratch / ".stdout", limits), _head(scratch / ".stderr", limits), proc.returncode, timed_out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # already gone


def _head(path: Path, limits: Limits) -> str:
    with open(path, "rb") as f:
        data = f.read(limits.output_bytes + 1)
    text = data[: limits.output_bytes].decode("utf-8", errors="replace")
    return text + "\n[output cut]" if len(data) > limits.output_bytes else text
