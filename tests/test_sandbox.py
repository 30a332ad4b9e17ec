"""The sandboxed python tool: what runs, each limit, what the sandbox sees, its seccomp filter, its errors
when it cannot start, a non-root caller, and `skillswarm sandbox`. The attacks are in test_sandbox_escapes."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from skillswarm.protocol.errors import SkillswarmError
from skillswarm.skills.environment import Environment
from skillswarm.skills.rubric import Rubric
from skillswarm.skills.sandbox import PythonSandbox, SandboxError, SandboxLimits, run_python, runtime_view
from skillswarm.skills.sandbox import bwrap, seccomp
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task, TaskBank
from skillswarm.skills.toolcall import format_answer, format_call
from skillswarm.skills.tools import ToolInputError
from tests.conftest import ROOT, run_cli

# A generous wall clock, so that on a loaded machine the CPU limit (not the clock) is what stops a busy loop.
FAST = SandboxLimits(cpu_seconds=1, wall_seconds=60.0, memory_bytes=256 << 20, output_bytes=200)


def test_runs_code_and_returns_stdout() -> None:
    r = run_python("import math\nprint(math.factorial(10))", FAST)
    assert r.ok and r.stdout == "3628800\n" and r.killed is None
    assert PythonSandbox(FAST)("print(sum(range(5)))") == "10"
    with pytest.raises(ToolInputError, match="ZeroDivisionError"):
        PythonSandbox(FAST)("1/0")


def test_each_run_gets_a_fresh_empty_work_dir() -> None:
    r = run_python("import os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), os.getcwd(), sorted(os.listdir()))", FAST)
    assert r.ok and r.stdout.split(" ", 2) == ["hi", "/sandbox", "['a.txt', 'main.py']\n"]
    again = run_python("import os\nprint(sorted(os.listdir()))", FAST)
    assert again.ok and again.stdout == "['main.py']\n"


def test_tracebacks_show_the_program_not_the_guard() -> None:
    r = run_python("def f():\n    raise ValueError('boom')\nf()", FAST)
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == "ValueError: boom"
    assert 'File "main.py", line 2, in f' in r.stderr and "<string>" not in r.stderr
    assert run_python("import sys\nsys.exit(7)", FAST).returncode == 7


@pytest.mark.slow
def test_infinite_loop_hits_the_cpu_limit() -> None:
    r = run_python("while True:\n    pass", FAST)
    assert r.killed == "cpu_time" and not r.ok
    with pytest.raises(ToolInputError, match="CPU time"):
        PythonSandbox(FAST)("while True: pass")


@pytest.mark.slow
def test_sleeping_forever_hits_the_wall_clock_limit() -> None:
    r = run_python("import time\ntime.sleep(60)", SandboxLimits(wall_seconds=1.0))
    assert r.killed == "wall_clock" and r.seconds < 5


@pytest.mark.parametrize("code", ["x = bytearray(1 << 34)", "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))"])
def test_memory_bomb_hits_the_memory_limit(code: str) -> None:
    r = run_python(code, FAST)
    assert r.killed == "memory" and "MemoryError" in r.stderr
    with pytest.raises(ToolInputError, match="memory limit"):
        PythonSandbox(FAST)(code)


def test_output_is_capped() -> None:
    r = run_python("print('x' * 5000)", FAST)
    assert r.ok and r.truncated and len(r.stdout) == 200
    flood = run_python("while True:\n    print('y' * 1000)", SandboxLimits(cpu_seconds=5, wall_seconds=60.0, file_bytes=1 << 16))
    assert flood.killed == "output_size"


def test_the_work_dir_is_size_capped() -> None:
    r = run_python("for i in range(40):\n    open(f'f{i}', 'wb').write(b'x' * (1 << 20))", SandboxLimits(disk_bytes=8 << 20))
    assert not r.ok and "No space left on device" in r.stderr


def test_threads_are_capped_by_the_process_limit_or_memory() -> None:
    code = "import threading, time\nfor _ in range(50):\n    threading.Thread(target=time.sleep, args=(0.2,)).start()"
    r = run_python(code, FAST)
    assert not r.ok and "can't start new thread" in r.stderr
    assert run_python(code.replace("50", "3"), FAST).ok


def test_environment_is_stripped_and_interpreter_isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKILLSWARM_SECRET_TOKEN", "abc")
    r = run_python("import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated, sys.flags.no_site, os.getuid())", FAST)
    assert r.ok and r.stdout.splitlines() == ["['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']", "1 1 65534"]


def test_the_view_is_the_runtime_only() -> None:
    view = runtime_view()
    visible = [*view.dirs, *view.files]
    assert view.interpreter in visible and os.path.isfile(view.interpreter)
    def under(path: str, root: str) -> bool:
        return path == root or path.startswith(root.rstrip("/") + "/")

    for private in (str(ROOT), sys.prefix, os.environ["SKILLSWARM_HOME"], str(Path.home() / ".ssh")):
        assert not any(under(p, os.path.realpath(private)) for p in visible), private
    # under the home directory, at most the interpreter's own installation (pyenv puts it there)
    home = os.path.realpath(Path.home())
    assert all(under(p, os.path.realpath(sys.base_prefix)) for p in visible if under(p, home) and home != "/")
    # the base interpreter's own site-packages, where installed packages live, is hidden behind an empty tmpfs
    r = run_python("import sysconfig, os\np = sysconfig.get_paths()['purelib']\nprint(os.path.isdir(p) and os.listdir(p))", FAST)
    assert r.ok and r.stdout.strip() in ("[]", "False")


# ------------------------------------------------------------------------------------------ seccomp


def _bpf(prog: bytes, arch: int, nr: int, arg0: int = 0) -> int:
    """Run a classic-BPF seccomp program on one syscall (the instructions the filter uses)."""
    data = struct.pack("=IIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    ins = [struct.unpack("=HBBI", prog[i:i + 8]) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = ins[pc]
        if code == 0x20:
            acc, pc = struct.unpack_from("=I", data, k)[0], pc + 1
        elif code == 0x06:
            return k
        else:
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if hit else jf)


@pytest.mark.parametrize("arch", ["x86_64", "aarch64"])
def test_seccomp_filter_decisions(arch: str) -> None:
    prog = seccomp.program(arch)
    audit, clone, clone3, sock = seccomp._ARCHES[arch]
    allow, eperm = 0x7FFF0000, 0x00050000 | 1
    assert _bpf(prog, audit, {"x86_64": 0, "aarch64": 63}[arch]) == allow  # read: ordinary calls pass
    assert _bpf(prog, audit, clone, seccomp.CLONE_THREAD | 0x3D0F00) == allow  # a thread
    assert _bpf(prog, audit, clone, 0x01200011) == eperm  # fork's flags
    assert _bpf(prog, audit, clone3) == 0x00050000 | 38  # ENOSYS: libc falls back to clone
    assert _bpf(prog, audit, sock, 1) == allow and _bpf(prog, audit, sock, 2) == 0x00050000 | 97  # AF_UNIX / AF_INET
    for name, nr in seccomp.DENIED[arch].items():
        assert _bpf(prog, audit, nr) == eperm, name
    assert _bpf(prog, 0x40000003, 0) == 0x80000000  # another ABI (i386): killed
    if arch == "x86_64":
        assert _bpf(prog, audit, 0x40000000 + 57) == 0x80000000  # x32


def test_seccomp_numbers_match_the_kernel_headers() -> None:
    headers = {"x86_64": Path("/usr/include/x86_64-linux-gnu/asm/unistd_64.h"), "aarch64": Path("/usr/include/asm-generic/unistd.h")}
    if not all(p.exists() for p in headers.values()):
        pytest.skip("kernel headers (linux-libc-dev) not installed")
    for arch, path in headers.items():
        defined = {m[0]: int(m[1]) for m in re.findall(r"#define __NR(?:3264)?_(\w+)\s+(\d+)", path.read_text())}
        assert {k: defined.get(k) for k in seccomp.DENIED[arch]} == seccomp.DENIED[arch], arch
        audit, clone, clone3, sock = seccomp._ARCHES[arch]
        assert (defined["clone"], defined["clone3"], defined["socket"]) == (clone, clone3, sock)


# ------------------------------------------------------------------------------- when it cannot start


@pytest.fixture
def bwrap_at(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    """Point the sandbox at another bwrap binary for one test."""
    def use(path: str) -> None:
        monkeypatch.setenv("SKILLSWARM_BWRAP", path)
        bwrap.bwrap_path.cache_clear()
        bwrap.bwrap_version.cache_clear()
    yield use
    monkeypatch.delenv("SKILLSWARM_BWRAP", raising=False)
    bwrap.bwrap_path.cache_clear()
    bwrap.bwrap_version.cache_clear()


def test_a_missing_bwrap_is_a_clear_error_never_a_run_without_isolation(bwrap_at, tmp_path: Path) -> None:  # noqa: ANN001
    bwrap_at(str(tmp_path / "no-such-bwrap"))
    with pytest.raises(SandboxError, match=r"needs bubblewrap.*apt-get install bubblewrap") as e:
        run_python("print(1)", FAST)
    assert isinstance(e.value, SkillswarmError)
    # in an episode it is the machine's fault (env_error, dropped by the trainer), not the model's
    env = Environment(tools=[PythonSandbox(FAST)], max_turns=2)
    state = env.reset(Task("t", "p", "a"), 0)
    env.step(state, format_call("python", "print(1)"))
    assert state.outcome == "env_error" and "bubblewrap" in state.error


def test_a_bwrap_that_fails_to_start_is_an_error_not_a_failed_program(bwrap_at, tmp_path: Path) -> None:  # noqa: ANN001
    fails = tmp_path / "bwrap"
    fails.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'bubblewrap 0.8.0' && exit 0\n"
                     "echo 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")
    fails.chmod(0o755)
    bwrap_at(str(fails))
    with pytest.raises(SandboxError, match="did not start.*uid map.*user namespaces must be enabled"):
        run_python("print(1)", FAST)


def test_a_bwrap_too_old_for_the_sandbox_is_a_clear_error(bwrap_at, tmp_path: Path) -> None:  # noqa: ANN001
    old = tmp_path / "bwrap"
    old.write_text("#!/bin/sh\necho 'bubblewrap 0.6.1'\n")
    old.chmod(0o755)
    bwrap_at(str(old))
    with pytest.raises(SandboxError, match="bubblewrap 0.6.1; the sandbox needs 0.7 or newer"):
        run_python("print(1)", FAST)


@pytest.mark.slow
def test_cli_reports_a_missing_bwrap_cleanly(tmp_path: Path) -> None:
    program = tmp_path / "p.py"
    program.write_text("print(1)\n")
    proc = run_cli("sandbox", "run", str(program), check=False, env={"SKILLSWARM_BWRAP": str(tmp_path / "nope")})
    assert proc.returncode == 1 and "apt-get install bubblewrap" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists("/usr/bin/python3"),
                    reason="needs root (to become uid 65534), setpriv and a system python3")
def test_a_non_root_caller_gets_the_same_sandbox() -> None:
    """As uid 65534 with the system interpreter: bwrap runs unprivileged, RLIMIT_NPROC caps threads."""
    layout = Path(tempfile.mkdtemp(prefix="skillswarm-nonroot-"))
    try:
        layout.chmod(0o755)
        (layout / "skillswarm").mkdir()
        for pkg in ("skills", "protocol"):
            (layout / "skillswarm" / pkg).symlink_to(ROOT / pkg)
        script = (
            "import json, sys\nsys.path.insert(0, sys.argv[1])\n"
            "from skillswarm.skills.sandbox import SandboxLimits, run_python\n"
            "lim = SandboxLimits(processes=4, memory_bytes=1 << 30)\n"
            "codes = ['import os\\nprint(os.getuid())', 'open(\"/etc/passwd\")', 'import os\\nos.fork()',\n"
            "         'import threading, time\\nfor _ in range(8): threading.Thread(target=time.sleep, args=(0.2,)).start()']\n"
            "print(json.dumps([run_python(c, lim).as_dict() for c in codes]))\n")
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I", "-c",
                               script, str(layout)], capture_output=True, text=True, timeout=120, cwd="/")
        assert proc.returncode == 0, proc.stderr
        uid, passwd, fork, threads = json.loads(proc.stdout)
        assert uid["ok"] and uid["stdout"] == "65534\n"
        assert "FileNotFoundError" in passwd["stderr"] and "PermissionError" in fork["stderr"]
        assert "can't start new thread" in threads["stderr"]  # 8 threads against RLIMIT_NPROC 4, memory plentiful
    finally:
        shutil.rmtree(layout, ignore_errors=True)


# ------------------------------------------------------------------------------------ the tool and CLI


class _Code(TaskBank):
    def draw(self, rng):  # noqa: ANN001, ANN201
        return Task(id="py:1", prompt="print 6*7 with python", answer="42")


def test_a_skill_can_offer_the_sandbox_as_a_tool() -> None:
    skill = Skill("pycode", "1", "use python", _Code(), Environment(tools=[PythonSandbox(FAST)], max_turns=3),
                  Rubric([lambda answer, task: float(answer == task.answer)]))
    turns = iter([format_call("python", "print(open('/etc/hostname').read())"), format_call("python", "print(6*7)"),
                  format_answer("42")])
    ep = skill.run_episode(Task("py:1", "print 6*7", "42"), 0, lambda m: next(turns))
    assert ep.outcome == "ok" and ep.reward == 1.0
    assert ep.messages[2].content.startswith("<error>FileNotFoundError") and ep.messages[4].content == "<result>42</result>"


@pytest.mark.slow
def test_sandbox_cli_runs_a_file_and_checks_the_machine(tmp_path: Path) -> None:
    program = tmp_path / "p.py"
    program.write_text("print('hello')\nimport sys\nprint('oops', file=sys.stderr)\nopen('/etc/passwd')\n")
    proc = run_cli("sandbox", "run", str(program), "--json", check=False)
    out = json.loads(proc.stdout)
    assert proc.returncode == 3 and out["ok"] is False and out["stdout"] == "hello\n" and "FileNotFoundError" in out["stderr"]
    assert out["killed"] is None and out["limits"]["wall_seconds"] == 5.0
    program.write_text("import time\ntime.sleep(30)\n")
    out = json.loads(run_cli("sandbox", "run", str(program), "--timeout", "0.5", "--json", check=False).stdout)
    assert out["killed"] == "wall_clock"
    program.write_text("print(6 * 7)\n")
    text = run_cli("sandbox", "run", str(program)).stdout
    assert "ok" in text and "42" in text
    assert "does not exist" in run_cli("sandbox", "run", str(tmp_path / "nope.py"), check=False).stderr
    check = json.loads(run_cli("sandbox", "check", "--json").stdout)
    assert check["inside"]["fork"].startswith("denied") and check["inside"]["inet_socket"].startswith("denied")
    assert check["inside"]["uid"] == 65534 and check["inside"]["proc_mounted"] is False and check["view"]["dirs"]
