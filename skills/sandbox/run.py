"""One sandboxed run: a program in, its (capped) output and how it ended out.

The program is handed to bubblewrap in a memfd and appears as `main.py` in the sandbox's empty work
dir; stdout and stderr are memfds too, so a run touches no host file. bwrap is started through the
launcher (`launch.py`), which puts the run in a pids cgroup of its own and gives it a work dir whose
inodes are capped as well as its bytes, where this machine allows. Inside, a short guard sets the
resource limits (CPU time, address space, file size, which also caps the output, open files,
processes and threads, queued signals, no core dumps), tells the parent it started, closes every
other descriptor and runs the program. The parent enforces the wall-clock limit by killing the sandbox's pid-1: the
kernel then kills every process of the pid namespace (session leaders and daemons included) before
bwrap exits, so nothing outlives a run. A run that never reached the guard is the machine's fault
(`SandboxError`), never the program's.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import time
from dataclasses import dataclass

from skillswarm.skills.sandbox import launch, seccomp
from skillswarm.skills.sandbox.bwrap import WORKDIR, command, explain_failure
from skillswarm.skills.sandbox.view import SandboxError, runtime_view


# Runs inside the sandbox before the program: limits, the "started" byte, a clean fd table, the program.
_GUARD = r'''
import os, resource, sys
cpu, mem, fsize, nofile, nproc, status = map(int, sys.argv[1:7])
def limit(res, value, hard=None):
    cur = resource.getrlimit(res)[1]
    cap = lambda v: v if cur == resource.RLIM_INFINITY else min(v, cur)
    resource.setrlimit(res, (cap(value), cap(value if hard is None else hard)))
limit(resource.RLIMIT_CPU, cpu, cpu + 1)
limit(resource.RLIMIT_AS, mem)
limit(resource.RLIMIT_FSIZE, fsize)
limit(resource.RLIMIT_NOFILE, nofile)
limit(resource.RLIMIT_NPROC, nproc)
limit(resource.RLIMIT_SIGPENDING, 64)  # each POSIX timer holds one: else ~100k timers of kernel memory
limit(resource.RLIMIT_CORE, 0)
os.write(status, b"1")
os.closerange(3, 1 << 20)
sys.argv = ["main.py"]
with open("main.py", "rb") as f:
    source = f.read()
del cpu, mem, fsize, nofile, nproc, status, limit, f
try:
    exec(compile(source, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as e:
    import traceback
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    raise SystemExit(1)
'''


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. `output_bytes` is what comes back; `file_bytes` caps every file it writes
    (stdout included); `disk_bytes` caps its work dir's bytes and `disk_files` its inodes (files,
    directories, symlinks, hard links, main.py and the dir itself included; where the launcher can
    mount the work dir, see `launch.py`); `processes` caps its tasks, threads included (its own pids
    cgroup where one can be made, e.g. as root; RLIMIT_NPROC too, which the kernel enforces for a
    non-root caller only; the seccomp filter forbids new processes in any case)."""

    cpu_seconds: int = 2
    wall_seconds: float = 5.0
    memory_bytes: int = 256 << 20
    file_bytes: int = 1 << 20
    output_bytes: int = 2000
    open_files: int = 32
    processes: int = 16
    disk_bytes: int = 16 << 20
    disk_files: int = 4096

    def __post_init__(self) -> None:
        if min(self.cpu_seconds, self.memory_bytes, self.file_bytes, self.output_bytes, self.open_files,
               self.processes, self.disk_bytes) < 1 or self.disk_files < 2 or self.wall_seconds <= 0:
            raise ValueError("sandbox limits must be positive")


@dataclass(frozen=True)
class SandboxResult:
    """How a run ended: its stdout (the first `output_bytes`; `truncated` if there was more), the end of its
    stderr (the last `output_bytes`), exit code, and which limit killed it, if any."""

    stdout: str
    stderr: str
    returncode: int
    killed: str | None
    truncated: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed is None

    def as_dict(self) -> dict[str, object]:
        return {"ok": self.ok, "returncode": self.returncode, "killed": self.killed, "stdout": self.stdout,
                "stderr": self.stderr, "truncated": self.truncated, "seconds": round(self.seconds, 4)}


# bwrap reports a program killed by signal N as exit code 128 + N.
_SIGNALS = {signal.SIGXCPU: "cpu_time", signal.SIGKILL: "cpu_time", signal.SIGXFSZ: "output_size"}


def _memfd(name: str, data: bytes = b"") -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    if data:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read(fd: int, limit: int, tail: bool = False) -> tuple[str, bool]:
    """The first (or, with `tail`, the last) `limit` bytes of a memfd, and whether there was more."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, limit, max(0, size - limit) if tail else 0)
    return data.decode("utf-8", "replace"), size > limit


def _read_pipe(fd: int) -> bytes:
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 65536)
    except BlockingIOError:
        return b""


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait for bwrap to exit, at most `timeout` seconds; whether it did. A pidfd wakes us the moment it
    exits (Popen.wait's timeout polls with sleeps that grow to 50 ms, longer than a whole run)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        deadline = time.monotonic() + timeout
        while not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
            if time.monotonic() >= deadline:
                return False
        proc.wait()
        return True
    finally:
        os.close(pidfd)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return int(f.read().rsplit(b")", 1)[1].split()[1])


def _kill(proc: subprocess.Popen, info: bytes) -> None:
    """Kill the sandbox's pid-1 (the kernel then kills the whole pid namespace), else bwrap's group."""
    found = re.search(rb'"child-pid"\s*:\s*(\d+)', info)
    try:
        pid = int(found.group(1)) if found else 0
        if not pid or _parent(pid) != proc.pid:  # not (or no longer) bwrap's child: never signal a stranger
            raise ProcessLookupError
        os.kill(pid, signal.SIGKILL)
    except (OSError, ValueError, IndexError):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, use_seccomp: bool = True) -> SandboxResult:
    """Run `code` in a fresh sandbox and return how it went. Raises `SandboxError` only when the sandbox
    itself cannot start (missing bubblewrap, namespaces disabled): never because of what the code does."""
    view = runtime_view()
    if use_seccomp and not seccomp.supported():
        raise SandboxError(f"no seccomp filter for this architecture ({seccomp.machine()}); the sandbox supports "
                           "x86_64 and aarch64")
    fds: list[int] = []
    cgroup = None
    try:
        code_fd = _memfd("main.py", code.encode("utf-8", "surrogateescape"))
        out_fd, err_fd = _memfd("stdout"), _memfd("stderr")
        fds += [code_fd, out_fd, err_fd]
        status_r, status_w = os.pipe()
        info_r, info_w = os.pipe()
        fds += [status_r, status_w, info_r, info_w]
        filter_fd = _memfd("seccomp", seccomp.program()) if use_seccomp else None
        if filter_fd is not None:
            fds.append(filter_fd)
        argv = [view.interpreter, "-I", "-S", "-B", "-c", _GUARD, str(limits.cpu_seconds), str(limits.memory_bytes),
                str(limits.file_bytes), str(limits.open_files), str(limits.processes), str(status_w)]
        cmd = command(view, argv, code_fd=code_fd, info_fd=info_w, disk_bytes=limits.disk_bytes, seccomp_fd=filter_fd)
        cgroup = launch.new_pids_cgroup(limits.processes + 2)  # + bwrap and the sandbox's init, both bwrap's
        cmd = launch.launcher(cmd, workdir=WORKDIR, disk_bytes=limits.disk_bytes, disk_files=limits.disk_files,
                              cgroup=cgroup)
        start = time.monotonic()
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out_fd, stderr=err_fd, cwd="/", env={},
                                    start_new_session=True,
                                    pass_fds=[fd for fd in (code_fd, status_w, info_w, filter_fd) if fd is not None])
        except OSError as e:
            raise SandboxError(f"cannot start bubblewrap ({cmd[0]}): {e.strerror}") from e
        os.close(status_w)
        os.close(info_w)
        fds = [fd for fd in fds if fd not in (status_w, info_w)]
        killed = None
        if not _wait(proc, limits.wall_seconds):
            killed = "wall_clock"
            _kill(proc, _read_pipe(info_r))
            proc.wait()
        seconds = time.monotonic() - start
        started = _read_pipe(status_r) == b"1"
        stdout, truncated = _read(out_fd, limits.output_bytes)
        stderr, _ = _read(err_fd, limits.output_bytes, tail=True)  # a traceback ends with what went wrong
    finally:
        for fd in fds:
            os.close(fd)
        if cgroup is not None:
            launch.release(cgroup)
    if not started:
        if killed:
            raise SandboxError(f"the python sandbox did not start within {limits.wall_seconds:g}s (machine overloaded?)")
        raise SandboxError(explain_failure(stderr))
    rc = proc.returncode
    if killed is None and rc > 128 and (rc - 128) in _SIGNALS:
        killed = _SIGNALS[signal.Signals(rc - 128)]
    elif killed is None and stderr.rstrip().endswith("MemoryError"):
        killed = "memory"
    elif killed is None and "[Errno 27]" in stderr:  # EFBIG: python ignores SIGXFSZ, so writes fail instead
        killed = "output_size"
    return SandboxResult(stdout, stderr, rc, killed, truncated, seconds)
