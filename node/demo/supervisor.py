"""The demo's processes: each node a `skillswarm` process with its own SKILLSWARM_HOME and log, every one stopped on
the way out (an error, Ctrl-C, or a SIGTERM to the demo itself)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

from skillswarm.protocol.errors import SkillswarmError

class Swarm:
    """The demo's processes; every one of them is stopped on exit, whatever happens."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.procs: dict[str, subprocess.Popen] = {}
        (out / "logs").mkdir(parents=True, exist_ok=True)

    def home(self, name: str) -> Path:
        path = self.out / "nodes" / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        env = {**os.environ, "SKILLSWARM_HOME": str(self.home(name)), "COLUMNS": "160"}
        log_file = open(self.out / "logs" / f"{name}.log", "w")
        exe = Path(sys.executable).with_name("skillswarm")
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "skillswarm.node.cli.app"]
        p = subprocess.Popen([*cmd, *args], stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs[name] = p
        return p

    def log_tail(self, name: str, lines: int = 15) -> str:
        text = (self.out / "logs" / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def check_alive(self, names: list[str]) -> None:
        for name in names:
            p = self.procs[name]
            if p.poll() is not None and p.returncode != 0:
                raise SkillswarmError(f"the demo's {name} process exited with {p.returncode}:\n{self.log_tail(name)}")

    def stop(self, name: str, timeout: float = 60.0) -> None:
        p = self.procs.get(name)
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)

    def close(self) -> None:
        for name in list(self.procs):
            self.stop(name, timeout=30)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def swarm(out: Path) -> Iterator[Swarm]:
    """The demo's processes, stopped on the way out: on an error, Ctrl-C or a SIGTERM to the demo itself
    (whose default action would end it at once and leave the swarm running)."""
    s = Swarm(out)
    main = threading.current_thread() is threading.main_thread()  # signal handlers belong to the main thread
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm) if main else None
    try:
        yield s
    finally:
        s.close()
        if previous is not None:  # None: the handler was not Python's, and cannot be put back from here
            signal.signal(signal.SIGTERM, previous)


def bootstrap_address(s: Swarm, timeout: float = 90.0) -> str:
    """The multiaddr the bootstrap peer printed (its `net serve --json` line), within `timeout` seconds."""
    path = s.out / "logs" / "bootstrap.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s.check_alive(["bootstrap"])
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{") and "maddrs" in line:
                return json.loads(line)["maddrs"][0]
        time.sleep(0.2)
    raise SkillswarmError(f"the bootstrap peer printed no address within {timeout:.0f} s:\n{s.log_tail('bootstrap')}")
