"""A sandboxed python tool for model-written code.

Each run is a fresh subprocess: an isolated interpreter (`python -I -S -B`: no site-packages, no
environment variables, no bytecode writes) in a new temp dir, with a stripped environment and its own
session. Before the model's code runs, the child sets its own resource limits (CPU time, address
space, file size - which caps its output -, open files, no core dumps) and installs an audit hook
that denies file access outside its temp dir (stdlib reads excepted, for imports), sockets, process
creation and native-code escape hatches (ctypes). The parent enforces the wall-clock limit and kills
the whole process group. Limits are set in the child, not in a `preexec_fn`, because preexec_fn is
unsafe in a parent with threads (torch has many); the model's code still never runs unlimited.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from skillswarm.skills.tools import ToolInputError

# Runs in the child before the model's code: limits, pre-imports, the audit hook, then the code.
_GUARD = r'''
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
def _limit(res, soft, hard=None):
    try:
        resource.setrlimit(res, (soft, soft if hard is None else hard))
    except (ValueError, OSError):
        pass
_limit(resource.RLIMIT_CPU, cfg["cpu_seconds"], cfg["cpu_seconds"] + 1)
_limit(resource.RLIMIT_AS, cfg["memory_bytes"])
_limit(resource.RLIMIT_FSIZE, cfg["file_bytes"])
_limit(resource.RLIMIT_NOFILE, cfg["open_files"])
_limit(resource.RLIMIT_CORE, 0)
import collections, decimal, fractions, functools, itertools, math, random, re, statistics, string, traceback
ROOT = os.path.realpath(os.getcwd())
STDLIB = tuple(os.path.realpath(p) + os.sep for p in {os.path.dirname(os.__file__), os.path.dirname(json.__file__)})
with open("main.py") as f:
    code = compile(f.read(), "main.py", "exec")
DENY = ("socket.", "subprocess.", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system",
        "os.kill", "os.killpg", "os.chroot", "os.setuid", "pty.", "ctypes.", "resource.setrlimit", "resource.prlimit",
        "mmap.", "winreg.")
DENY_MODULES = {"ctypes", "_ctypes", "_posixsubprocess", "subprocess", "socket", "_socket", "multiprocessing",
                "_multiprocessing", "pty", "_xxsubinterpreters", "_interpreters", "signal", "_signal"}
PATH_EVENTS = {"os.listdir", "os.scandir", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown",
               "os.symlink", "os.link", "os.truncate", "os.utime", "os.chdir", "glob.glob", "shutil.copyfile",
               "shutil.rmtree", "shutil.move", "shutil.copytree", "os.chflags", "os.lchmod", "os.lchown"}
LIST_EVENTS = {"os.listdir", "os.scandir", "glob.glob"}
def _inside(path, read_only):
    if isinstance(path, int):
        return True
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    real = os.path.realpath(os.path.join(ROOT, str(path)))
    return real == ROOT or real.startswith(ROOT + os.sep) or (read_only and real.startswith(STDLIB))
def _hook(event, args):
    if event == "open":
        path, mode, flags = args
        read_only = set(mode) <= set("rbt") if isinstance(mode, str) else (flags & 3) == 0
        if path is not None and not _inside(path, read_only):
            raise PermissionError(f"sandbox: access to {path!r} outside the sandbox dir is denied")
    elif event.startswith(DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
    elif event == "import" and args[0].split(".")[0] in DENY_MODULES:
        raise PermissionError(f"sandbox: import {args[0]} is not allowed")
    elif event in PATH_EVENTS:
        for p in args[:2]:
            if isinstance(p, (str, bytes, os.PathLike)) and not _inside(p, event in LIST_EVENTS):
                raise PermissionError(f"sandbox: {event} on {p!r} outside the sandbox dir is denied")
sys.addaudithook(_hook)
del _hook
try:
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:
    sys.stderr.write("".join(traceback.format_exception_only(type(e), e)))
    sys.stderr.flush()
    os._exit(1)
'''


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. `output_bytes` is what comes back; `file_bytes` caps every file it writes."""

    cpu_seconds: int = 2
    wall_seconds: float = 5.0
    memory_bytes: int = 256 << 20
    file_bytes: int = 1 << 20
    output_bytes: int = 2000
    open_files: int = 32


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended: its (truncated) stdout and stderr, exit code, and which limit killed it, if any."""

    stdout: str
    stderr: str
    returncode: int
    killed: str | None
    truncated: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed is None


_SIGNALS = {signal.SIGXCPU: "cpu_time", signal.SIGKILL: "cpu_time", signal.SIGXFSZ: "output_size"}


def _read(path: Path, limit: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data[:limit].decode("utf-8", "replace"), len(data) > limit


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` in a fresh sandbox and return how it went. Raises OSError only if the sandbox
    itself cannot start (infrastructure), never because of what the code does."""
    work = Path(tempfile.mkdtemp(prefix="skillswarm-sandbox-"))
    io_dir = Path(tempfile.mkdtemp(prefix="skillswarm-sandbox-io-"))
    try:
        (work / "main.py").write_text(code)
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(work), "TMPDIR": str(work)}
        cmd = [sys.executable, "-I", "-S", "-B", "-c", _GUARD, json.dumps(asdict(limits))]
        start = time.monotonic()
        with open(io_dir / "out", "wb") as out, open(io_dir / "err", "wb") as err:
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, close_fds=True)
            killed = None
            try:
                proc.wait(timeout=limits.wall_seconds)
            except subprocess.TimeoutExpired:
                killed = "wall_clock"
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            else:
                try:  # nothing the code started may outlive it
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        seconds = time.monotonic() - start
        stdout, truncated = _read(io_dir / "out", limits.output_bytes)
        stderr, _ = _read(io_dir / "err", limits.output_bytes)
        if killed is None and proc.returncode < 0:
            killed = _SIGNALS.get(-proc.returncode, f"signal {-proc.returncode}")
        elif killed is None and stderr.rstrip().endswith("MemoryError"):
            killed = "memory"
        elif killed is None and "[Errno 27]" in stderr:  # EFBIG: python ignores SIGXFSZ, so writes fail instead
            killed = "output_size"
        return SandboxResult(stdout, stderr, proc.returncode, killed, truncated, seconds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(io_dir, ignore_errors=True)


_KILLED = {
    "cpu_time": "killed: CPU time limit exceeded",
    "wall_clock": "killed: wall-clock limit exceeded",
    "output_size": "killed: output size limit exceeded",
    "memory": "MemoryError: memory limit exceeded",
}


class PythonSandbox:
    """`python`: run the input as a Python program in the sandbox; its stdout is the result."""

    name = "python"
    description = "run a Python program (stdlib only, no files outside its dir, no network); returns its stdout"

    def __init__(self, limits: SandboxLimits = SandboxLimits()) -> None:
        self.limits = limits

    def __call__(self, input: str) -> str:
        result = run_python(input, self.limits)
        if result.killed:
            raise ToolInputError(_KILLED.get(result.killed, f"killed: {result.killed}"))
        if result.returncode != 0:
            last = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.returncode}"]
            raise ToolInputError(last[0])
        return result.stdout.rstrip("\n") + (" ...[truncated]" if result.truncated else "")
