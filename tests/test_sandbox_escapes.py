"""The escape corpus: real attacks on the python tool, each run through the tool as a model would call it.

Every attack is a program that asserts it reached its goal (read a secret, reached the network, left a
process or a file behind...), so a program that ends without an error means the attack got through.
Each must fail inside the sandbox, come back to the episode as a tool failure (outcome `tool_error`,
reward 0: kept for training, never dropped), leave no secret in its output, and, where the host can
check, leave the host untouched (no file written, no connection made, no signal delivered, no process
left). The first attack is the one that defeated the old audit-hook guard.
"""

from __future__ import annotations

import ast
import errno
import glob
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import pytest

from skillswarm.protocol.identity import Identity
from skillswarm.protocol.paths import default_key_path
from skillswarm.skills.environment import Environment
from skillswarm.skills.nano.build import cached_path
from skillswarm.skills.sandbox import PythonSandbox, SandboxError, SandboxLimits, SandboxResult, launch, run_python
from skillswarm.skills.sandbox.bwrap import bwrap_path
from skillswarm.skills.sandbox.seccomp import DENIED, machine
from tests.net_helpers import wait_for
from skillswarm.skills.taskbank import Task
from skillswarm.skills.toolcall import format_call
from tests.conftest import ROOT

LIMITS = SandboxLimits(cpu_seconds=1, wall_seconds=3.0, output_bytes=4000)
SYS = DENIED.get(machine(), DENIED["x86_64"])
SECRET_ENV = "SKILLSWARM_ATTACK_SECRET"

# name -> program. {placeholders} are filled with the host's real paths, ports and pids (see `Host`).
ATTACKS: dict[str, str] = {
    "sys.modules bypass of the old guard, then /etc/passwd": (
        "import sys\ng = sys.modules['__main__']; g.ROOT = ''; g.DENY = (); g.DENY_MODULES = set()\n"
        "print(open('/etc/passwd').read())"),
    "read a host file by its path": "print(open({secret!r}).read())",
    "path traversal out of the work dir": "print(open('../' * 30 + {secret!r}.lstrip('/')).read())",
    "read another user's key": "print(open({other_key!r}).read())",
    "read the node's identity key": "print(open({node_key!r}, 'rb').read())",
    "read the model weights": (
        "import glob\nprint(open({weights!r}, 'rb').read()[:64])\n"
        "found = glob.glob('/**/*.safetensors', recursive=True)\nassert found, 'no weights anywhere'"),
    "import the project": "import sys\nsys.path[:0] = [{root!r}, {site!r}]\nimport skillswarm.protocol.identity\nprint('imported')",
    "write outside the work dir": "open({outside!r}, 'w').write('escaped')",
    "write into the Python runtime": "import os\nopen(os.__file__, 'a').write('# planted')",
    "write into the project (code the host imports)": "open({root!r} + '/skills/__init__.py', 'a').write('# planted')",
    "write to /dev/shm": "open('/dev/shm/{marker}', 'w').write('x')",
    "LD_PRELOAD: plant /etc/ld.so.preload": "open('/etc/ld.so.preload', 'w').write('/sandbox/evil.so')",
    "LD_PRELOAD: re-exec with a host library preloaded": (
        "import os, sys\nos.environ['LD_PRELOAD'] = {site!r} + '/torch/lib/libtorch.so'\n"
        "os.execv(sys.executable, [sys.executable, '-c', 'import os; print(open({secret!r}).read())'])"),
    "symlink out of the work dir": "import os\nos.symlink({secret!r}, 'link')\nprint(open('link').read())",
    "symlink race": (
        "import os, threading\nopen('safe', 'w').write('safe')\nos.symlink('safe', 'link')\nstop = False\n"
        "def flip():\n    while not stop:\n        for target in ({secret!r}, 'safe'):\n"
        "            os.symlink(target, 'tmp'); os.replace('tmp', 'link')\n"
        "t = threading.Thread(target=flip); t.start()\nseen = set()\n"
        "for _ in range(2000):\n    try:\n        seen.add(open('link').read())\n    except OSError:\n        pass\n"
        "stop = True; t.join()\nassert seen - {{'safe'}}, 'only ever read the safe file'"),
    "hard link to a host file": "import os\nos.link({secret!r}, 'h')\nprint(open('h').read())",
    "run a program (id)": "import subprocess\nprint(subprocess.run(['id'], capture_output=True, text=True).stdout)",
    "os.system": "import os\nassert os.system('id > out') == 0, 'os.system failed'",
    "exec a shell": "import os\nos.execv('/bin/sh', ['sh', '-c', 'id'])",
    "fork bomb": "import os\nwhile True:\n    os.fork()",
    "setsid daemon that outlives the run": (
        "import os, sys\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])\n"
        "    os._exit(0)\nprint('daemon started')"),
    "signal the parent and the worker": (
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill({host_pid}, signal.SIGUSR1)"),
    "kill every process it can see": "import os, signal\nos.kill(-1, signal.SIGKILL)\nos.kill({canary_pid}, signal.SIGKILL)",
    "read /proc/<ppid>/environ": (
        "import os\nread = []\nfor pid in (os.getppid(), {host_pid}, 1):\n    try:\n"
        "        read.append(open(f'/proc/{{pid}}/environ').read())\n    except OSError as e:\n        print(e)\n"
        "assert read, 'no environment read'"),
    "mount a fresh /proc": (
        "import ctypes, os\nos.mkdir('p')\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.mount(b'proc', b'p', b'proc', 0, None) == 0, os.strerror(ctypes.get_errno())\n"
        "print(open('p/{host_pid}/environ').read())"),
    "read the environment": "import os\nprint(os.environ[{secret_env!r}])",
    "ctypes: read the C-level environment": (
        "import ctypes\nlibc = ctypes.CDLL(None)\nenv = ctypes.POINTER(ctypes.c_char_p).in_dll(libc, 'environ')\n"
        "values = []\ni = 0\nwhile env[i]:\n    values.append(env[i]); i += 1\n"
        "assert any(v.startswith({secret_env!r}.encode()) for v in values), values"),
    "ctypes: new user namespace to regain capabilities": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.syscall({unshare}, 0x10000000) == 0, os.strerror(ctypes.get_errno())"),
    "ctypes: ptrace the sandbox's init": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.ptrace(16, 1, None, None) == 0, os.strerror(ctypes.get_errno())"),
    "ctypes: bpf, io_uring and keyrings": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for nr in ({bpf}, {io_uring_setup}, {keyctl}):\n"
        "    assert libc.syscall(nr, 0, 0, 0, 0) >= 0, os.strerror(ctypes.get_errno())"),
    "become root inside": "import os\nos.setuid(0)\nprint(open({secret!r}).read())",
    "chroot escape": "import os\nos.mkdir('d')\nos.chroot('d')\nos.chdir('../../..')\nprint(open({secret!r}).read())",
    "inherited descriptors": (
        "import os\nopen_fds = []\nfor fd in range(3, 1024):\n    try:\n        os.fstat(fd); open_fds.append(fd)\n"
        "    except OSError:\n        pass\nassert open_fds, 'no inherited descriptor'"),
    "TCP to a port on the host": "import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')",
    "DNS and the internet": "import socket\nprint(socket.getaddrinfo('pypi.org', 443))",
    "abstract unix socket on the host": (
        "import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect('\\0{abstract}')\nprint('connected')"),
    "10 GB allocation": "x = bytearray(10 * 2**30)",
    "busy loop": "while True:\n    pass",
    "sleep loop": "import time\nwhile True:\n    time.sleep(1)",
    "50 threads": (
        "import threading, time\nfor _ in range(50):\n    threading.Thread(target=time.sleep, args=(1,)).start()"),
    "5 MB of output": "print('x' * 5_000_000)",
    "fill the disk": "for i in range(64):\n    open(f'f{{i}}', 'wb').write(b'x' * (1 << 20))",
    "aio bomb: take the host's whole fs.aio-max-nr": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nctx = ctypes.c_ulong(0)\n"
        "assert libc.syscall({io_setup}, 65536, ctypes.byref(ctx)) == 0, os.strerror(ctypes.get_errno())"),
    "inode bomb: 300k empty files in the work dir": (
        "for i in range(300_000):\n    open(f'{{i}}', 'w').close()"),
    "thread bomb: 2000 small threads": (
        "import threading\nthreading.stack_size(32768)\nstop = threading.Event()\n"
        "try:\n    for _ in range(2000):\n        threading.Thread(target=stop.wait).start()\nfinally:\n    stop.set()"),
    "System V message queues of kernel memory": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.msgget(0, 0o1600) >= 0, os.strerror(ctypes.get_errno())"),
    "System V shared memory outside RLIMIT_AS": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.shmget(0, 64 << 20, 0o1600) >= 0, os.strerror(ctypes.get_errno())"),
    "inotify instances of the host's user": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "assert libc.inotify_init1(0) >= 0, os.strerror(ctypes.get_errno())"),
    "POSIX timer bomb": (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nt = ctypes.c_void_p()\n"
        "event = (ctypes.c_int * 16)(0, 0, 0, 1)  # sigevent: SIGEV_NONE\n"
        "for i in range(10_000):\n"
        "    assert libc.timer_create(1, event, ctypes.byref(t)) == 0, (i, os.strerror(ctypes.get_errno()))"),
}


@dataclass
class Host:
    """The host-side targets of the attacks, and the means to check they were not reached."""

    tmp: Path
    secret: Path
    token: str
    other_key: Path
    node_key: Path
    weights: Path
    outside: Path
    marker: str
    port: int
    abstract: str
    canary: subprocess.Popen
    accepted: list[str] = field(default_factory=list)
    signals: list[int] = field(default_factory=list)

    def values(self) -> dict[str, object]:
        return {"secret": str(self.secret), "other_key": str(self.other_key), "node_key": str(self.node_key),
                "weights": str(self.weights), "outside": str(self.outside), "marker": self.marker, "port": self.port,
                "abstract": self.abstract, "root": str(ROOT), "site": sysconfig.get_paths()["purelib"],
                "host_pid": os.getpid(), "canary_pid": self.canary.pid, "secret_env": SECRET_ENV, **SYS}


def _listen(server: socket.socket, accepted: list[str], name: str) -> None:
    server.settimeout(0.2)
    while server.fileno() >= 0:
        try:
            conn, _ = server.accept()
            accepted.append(name)
            conn.close()
        except (TimeoutError, socket.timeout):
            continue
        except OSError:
            return


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    tmp = tmp_path_factory.mktemp("host")
    home = tmp / "home"
    mp = pytest.MonkeyPatch()
    mp.setenv("SKILLSWARM_HOME", str(home))
    token = uuid.uuid4().hex
    mp.setenv(SECRET_ENV, token)  # the attacks know the name, never the value
    secret = tmp / "secret.txt"
    secret.write_text(f"TOP-SECRET-{token}")
    secret.chmod(0o600)
    other_key = tmp / "someone" / ".ssh" / "id_ed25519"
    other_key.parent.mkdir(parents=True)
    other_key.write_text(f"-----BEGIN OPENSSH PRIVATE KEY----- {token}")
    other_key.chmod(0o600)
    Identity.load_or_create(default_key_path())
    weights = cached_path() / "model.safetensors"
    weights.parent.mkdir(parents=True)
    weights.write_bytes(b"WEIGHTS-" + token.encode() * 100)
    accepted: list[str] = []
    tcp = socket.create_server(("127.0.0.1", 0))
    abstract = f"skillswarm-attack-{uuid.uuid4().hex}"
    unix = socket.socket(socket.AF_UNIX)
    unix.bind("\0" + abstract)
    unix.listen()
    for server, name in ((tcp, "tcp"), (unix, "unix")):
        threading.Thread(target=_listen, args=(server, accepted, name), daemon=True).start()
    canary = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    h = Host(tmp, secret, token, other_key, default_key_path(), weights, tmp / "escaped.txt",
             f"skillswarm-attack-{uuid.uuid4().hex}", tcp.getsockname()[1], abstract, canary, accepted)
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: h.signals.append(signum))
    try:
        yield h
    finally:
        signal.signal(signal.SIGUSR1, previous)
        canary.kill()
        canary.wait()
        tcp.close()
        unix.close()
        mp.undo()


class RecordingSandbox(PythonSandbox):
    """The real `python` tool, keeping the last run's result for the host-side checks."""

    last: SandboxResult | None = None

    def __call__(self, input: str) -> str:
        self.last = run_python(input, self.limits)
        return self.reply(self.last)


def _processes_with(marker: str) -> int:
    count = 0
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            count += marker.encode() in Path(path).read_bytes()
        except OSError:
            pass
    return count


def _gone(marker: str) -> bool:
    """No process carries `marker` within 5 s of the run's return: the planted daemons sleep 60 s, so one that
    escaped the namespace's end is still there (once, on a fresh clone, one was listed for an instant)."""
    wait_for(lambda: _processes_with(marker) == 0, 5.0, f"the processes marked {marker} to end", poll=0.05)
    return True


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_blocked_and_graded_as_a_tool_failure(name: str, host: Host) -> None:
    code = ATTACKS[name].format(**host.values())
    tool = RecordingSandbox(LIMITS)
    env = Environment(tools=[tool], max_turns=1)
    state = env.reset(Task("attack", name, "-"), 0)
    env.step(state, format_call("python", code))
    result = tool.last
    assert result is not None and not result.ok, f"{name}: got through\n{result}"
    assert state.done and state.outcome == "tool_error" and state.turns[0].tool_error, (state.outcome, state.error)
    episode = env.to_episode(state, "attack")
    assert episode.outcome == "tool_error" and episode.reward == 0.0  # kept and graded 0, never dropped as env_error
    key_body = max(host.node_key.read_text().splitlines(), key=len)
    for leaked in (host.token, key_body):
        assert leaked not in result.stdout + result.stderr, f"{name}: leaked a secret"
    # the host is untouched
    assert not host.outside.exists() and not Path("/dev/shm", host.marker).exists()
    assert not Path("/etc/ld.so.preload").exists() or "/sandbox/evil.so" not in Path("/etc/ld.so.preload").read_text()
    assert "# planted" not in (ROOT / "skills" / "__init__.py").read_text()
    assert "# planted" not in Path(os.__file__).read_text()[-200:]
    assert host.accepted == [] and host.signals == [] and host.canary.poll() is None
    assert _gone(host.marker), f"{name}: a process outlived the run"


def test_the_corpus_covers_the_issue() -> None:
    """At least 20 attacks, and every case the issue names is among them."""
    named = ["sys.modules", "/etc/passwd", "write outside", "socket", "run a program", "ctypes", "fork bomb",
             "10 GB", "busy loop", "sleep loop", "50 threads", "5 MB", "environment", "another user's key",
             "identity key", "/proc/<ppid>/environ", "signal the parent", "setsid", "/dev/shm", "symlink race",
             "LD_PRELOAD", "model weights", "import the project"]
    text = " | ".join(ATTACKS)
    assert len(ATTACKS) >= 20 and [n for n in named if n not in text] in ([], ["socket"])
    assert any("TCP" in a or "unix socket" in a for a in ATTACKS)


@pytest.mark.slow
def test_without_seccomp_the_namespace_still_kills_daemons_and_session_leaders() -> None:
    """The pid namespace alone ends everything a run started: a setsid double-forked daemon dies with the
    run, whether the program exits by itself or the wall clock kills it."""
    for tail, killed in (("", None), ("time.sleep(60)", "wall_clock")):
        marker = f"skillswarm-daemon-{uuid.uuid4().hex}"
        code = (
            "import os, sys, time\nr, w = os.pipe()\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.write(w, b'up')\n        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])\n"
            f"    os._exit(0)\nprint(os.read(r, 2).decode(), flush=True)\ntime.sleep(0.3)\n{tail}\n")
        result = run_python(code, SandboxLimits(wall_seconds=2.0), use_seccomp=False)
        assert result.stdout.startswith("up") and result.killed == killed, result
        assert _gone(marker)
        time.sleep(0.05)


# ------------------------------------------------------------ kernel memory and host-wide tables


def _sandbox_or_skip() -> None:
    try:
        bwrap_path()
    except SandboxError as e:
        pytest.skip(f"no sandbox on this machine: {e}")


def _aio(name: str) -> int:
    return int(Path("/proc/sys/fs", name).read_text())


@pytest.mark.skipif(not Path("/proc/sys/fs/aio-nr").exists(), reason="this kernel has no Linux AIO (fs.aio-nr): nothing to take")
def test_an_aio_bomb_is_refused_and_the_hosts_aio_table_is_untouched() -> None:
    """io_setup reserves from the host-wide fs.aio-max-nr: one run once held all 65,536 and the host's own
    io_setup failed. It is refused, and the host's aio-nr never moves while the run holds what it got."""
    _sandbox_or_skip()
    before = _aio("aio-nr")
    want = max(1, _aio("aio-max-nr") - before)
    code = ("import ctypes, errno, time\nlibc = ctypes.CDLL(None, use_errno=True)\nctx = ctypes.c_ulong(0)\n"
            f"got = libc.syscall({SYS['io_setup']}, {want}, ctypes.byref(ctx))\n"
            "print(got, errno.errorcode.get(ctypes.get_errno()), flush=True)\ntime.sleep(1.0)  # hold it, if it got one\n")
    done: list[SandboxResult] = []
    runner = threading.Thread(target=lambda: done.append(run_python(code, SandboxLimits(wall_seconds=30.0))))
    runner.start()
    seen = [before]
    while runner.is_alive():
        seen.append(_aio("aio-nr"))
        time.sleep(0.01)
    runner.join()
    (result,) = done
    got, err = result.stdout.split()
    assert result.ok and got == "-1" and err in ("EPERM", "ENOSYS"), result
    assert max(seen) < before + want, f"the run reserved {max(seen) - before} of the host's aio events"


def test_an_inode_bomb_stops_at_the_work_dirs_inode_limit() -> None:
    """Empty files cost no bytes, so a size-capped tmpfs alone let one run make ~290k of them (the host's
    slab grew by 350 MB). The work dir caps its inodes: files, directories, symlinks and hard links."""
    _sandbox_or_skip()
    if not launch.mount_mode(bwrap_path()):
        pytest.skip("the launcher cannot mount the work dir here (neither root with CAP_SYS_ADMIN nor a user "
                    "allowed a user namespace that may mount a tmpfs): it is bwrap's tmpfs, with no inode limit")
    limits = SandboxLimits(cpu_seconds=10, wall_seconds=60.0)
    code = (
        "import os\ndef bomb(make):\n    n = 0\n    try:\n        while n < 300_000:\n            make(n); n += 1\n"
        "    except OSError as e:\n        return n, e.errno\n    return n, None\n"
        "files = bomb(lambda i: open(f'f{i}', 'w').close())\n"
        "for i in range(1, files[0]):\n    os.unlink(f'f{i}')\n"
        "links = bomb(lambda i: os.link('f0', f'l{i}'))\n"
        "for i in range(links[0]):\n    os.unlink(f'l{i}')\n"
        "dirs = bomb(lambda i: os.mkdir(f'd{i}'))\n"
        "for i in range(dirs[0]):\n    os.rmdir(f'd{i}')\n"
        "symlinks = bomb(lambda i: os.symlink('f0', f's{i}'))\n"
        "print([files, links, dirs, symlinks])\n")
    result = run_python(code, limits)
    assert result.ok, result
    counts = ast.literal_eval(result.stdout)  # four (count, errno) pairs
    # the dir itself and main.py are two of the inodes; one file is kept for the links
    assert counts[0] == (limits.disk_files - 2, errno.ENOSPC), counts
    assert all(n <= limits.disk_files - 2 and e == errno.ENOSPC for n, e in counts[1:]), counts
    assert limits.disk_files < 290_000 // 10


def test_a_thread_bomb_stops_at_the_process_bound_even_for_root() -> None:
    """RLIMIT_NPROC is not enforced for root (one run made 780 threads in its memory limit): each run gets
    its own pids cgroup where one can be made; as another user RLIMIT_NPROC bounds it."""
    _sandbox_or_skip()
    if os.geteuid() == 0 and launch.pids_parent() is None:
        pytest.skip("the node runs as root but no pids cgroup hierarchy is writable here (a container without "
                    "one?): only the memory limit bounds its threads")
    limits = SandboxLimits(processes=8, memory_bytes=1 << 30, wall_seconds=60.0)
    code = ("import threading\nthreading.stack_size(32768)\nstop = threading.Event()\nn = 0\ntry:\n"
            "    while n < 2000:\n        threading.Thread(target=stop.wait).start(); n += 1\n"
            "except RuntimeError as e:\n    print(n, e)\nstop.set()\n")
    result = run_python(code, limits)
    assert result.ok and "can't start new thread" in result.stdout, result
    started = int(result.stdout.split()[0])
    assert 1 <= started < limits.processes, started  # the main thread is one of the run's tasks
    parent = launch.pids_parent()
    if parent is not None:  # each run's cgroup goes with it (at the latest when the kernel has released its tasks)
        launch.sweep()
        assert not list(parent.glob(f"run-{os.getpid()}-*"))
