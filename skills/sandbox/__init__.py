"""The sandbox for model-written code: every run is a fresh process confined by the operating system.

- `view`: what a run sees of the host (the Python runtime, read-only) and `SandboxError`;
- `seccomp`: the system-call filter (no new processes, no sockets but AF_UNIX, no kernel escape hatches);
- `bwrap`: the bubblewrap command line (namespaces, mounts, no capabilities) and its error messages;
- `launch`: what bwrap cannot set: each run's own pids cgroup and an inode-capped work dir;
- `run`: `run_python`, `SandboxLimits`, `SandboxResult` (rlimits, wall clock, capped output);
- `tool`: `PythonSandbox`, the `python` tool skills offer to models.

The guarantee rests on Linux namespaces, rlimits and seccomp, not on the interpreter: code that
rewrites its own interpreter (sys.modules, ctypes, audit hooks) is still inside all of them.
"""

from skillswarm.skills.sandbox.run import SandboxLimits, SandboxResult, run_python
from skillswarm.skills.sandbox.tool import PythonSandbox
from skillswarm.skills.sandbox.view import SandboxError, runtime_view

__all__ = ["PythonSandbox", "SandboxError", "SandboxLimits", "SandboxResult", "run_python", "runtime_view"]
