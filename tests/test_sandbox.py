"""The sandboxed python tool: each limit and each denial, proven by code that tries."""

from __future__ import annotations

from pathlib import Path

import pytest

from skillswarm.skills.environment import Environment
from skillswarm.skills.rubric import Rubric
from skillswarm.skills.sandbox import PythonSandbox, SandboxLimits, run_python
from skillswarm.skills.skill import Skill
from skillswarm.skills.taskbank import Task, TaskBank
from skillswarm.skills.toolcall import format_answer, format_call
from skillswarm.skills.tools import ToolInputError

# A generous wall clock, so that on a loaded machine the CPU limit (not the clock) is what stops a busy loop.
FAST = SandboxLimits(cpu_seconds=1, wall_seconds=60.0, memory_bytes=256 << 20, output_bytes=200)


def test_runs_code_and_returns_stdout() -> None:
    r = run_python("import math\nprint(math.factorial(10))", FAST)
    assert r.ok and r.stdout == "3628800\n"
    assert PythonSandbox(FAST)("print(sum(range(5)))") == "10"


def test_files_inside_its_own_dir_work_and_the_dir_is_removed() -> None:
    r = run_python("import os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), os.getcwd())", FAST)
    assert r.ok and r.stdout.startswith("hi ")
    assert not Path(r.stdout.split()[1]).exists()


@pytest.mark.slow
def test_infinite_loop_hits_the_cpu_limit() -> None:
    r = run_python("while True:\n    pass", FAST)
    assert r.killed == "cpu_time"
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


def test_reading_files_outside_is_denied(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET")
    for code in (f"print(open({str(secret)!r}).read())", f"import os\nprint(os.open({str(secret)!r}, os.O_RDONLY))",
                 f"import pathlib\nprint(pathlib.Path({str(secret)!r}).read_text())", "print(open('../x').read())",
                 "print(open('/etc/passwd').read())", f"import os\nprint(os.listdir({str(tmp_path)!r}))"):
        r = run_python(code, FAST)
        assert not r.ok and "PermissionError: sandbox" in r.stderr and "TOP-SECRET" not in r.stdout, code
    r = run_python("import os\nopen(os.__file__, 'a')", FAST)
    assert "PermissionError: sandbox" in r.stderr  # the stdlib is readable (imports), never writable


@pytest.mark.parametrize("code", [
    "import socket\nsocket.socket()",
    "import _socket",
    "import os\nos.system('echo hi')",
    "import os\nos.fork()",
    "import os\nos.execv('/bin/echo', ['echo', 'hi'])",
    "import os\nos.posix_spawn('/bin/echo', ['echo', 'hi'], {})",
    "import subprocess\nsubprocess.run(['echo', 'hi'])",
    "import _posixsubprocess",
    "import ctypes",
    "import os\nos.kill(1, 9)",
])
def test_sockets_processes_and_ctypes_are_denied(code: str) -> None:
    r = run_python(code, FAST)
    assert r.returncode == 1 and "PermissionError: sandbox" in r.stderr and "hi" not in r.stdout, r


def test_environment_is_stripped_and_interpreter_isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKILLSWARM_SECRET_TOKEN", "abc")
    r = run_python("import os, sys\nprint(sorted(os.environ))\nprint(sys.flags.isolated, sys.flags.no_site)", FAST)
    assert r.ok and r.stdout.splitlines() == ["['HOME', 'LANG', 'PATH', 'TMPDIR']", "1 1"]


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
    assert ep.messages[2].content.startswith("<error>PermissionError: sandbox") and ep.messages[4].content == "<result>42</result>"
