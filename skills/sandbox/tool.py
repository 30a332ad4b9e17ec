"""`python`: the tool that runs model-written code in the sandbox and returns its stdout."""

from __future__ import annotations

import threading
from collections import OrderedDict

from skillswarm.skills.sandbox.run import SandboxLimits, SandboxResult, run_python
from skillswarm.skills.tools import ToolInputError

_KILLED = {
    "cpu_time": "killed: CPU time limit exceeded",
    "wall_clock": "killed: wall-clock limit exceeded",
    "output_size": "killed: output size limit exceeded",
    "memory": "MemoryError: memory limit exceeded",
}


class PythonSandbox:
    """`python`: run the input as a Python program in the sandbox; its stdout is the result.

    A program that fails or is killed is the model's doing (`ToolInputError`, shown to it as an error);
    a sandbox that cannot start is the machine's (`SandboxError` propagates: the episode is env_error).
    With `memo` > 0 the results of the last `memo` distinct programs are kept and a repeated program is
    answered from them (in RL a group of samples of one task often writes the same program): for a
    deterministic program that is what a fresh run would print. A wall-clock kill is never kept."""

    name = "python"
    description = "run a Python program (stdlib only, an empty dir, no network, no processes); returns its stdout"

    def __init__(self, limits: SandboxLimits = SandboxLimits(), memo: int = 0) -> None:
        self.limits, self.memo = limits, memo
        self._results: OrderedDict[str, SandboxResult] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, input: str) -> str:
        with self._lock:
            result = self._results.get(input)
            if result is not None:
                self._results.move_to_end(input)
        if result is None:
            result = run_python(input, self.limits)
            if self.memo and result.killed != "wall_clock":
                with self._lock:
                    self._results[input] = result
                    while len(self._results) > self.memo:
                        self._results.popitem(last=False)
        return self.reply(result)

    @staticmethod
    def reply(result: SandboxResult) -> str:
        """The tool's reply to a finished run: its stdout, or a `ToolInputError` saying why it failed."""
        if result.killed:
            raise ToolInputError(_KILLED.get(result.killed, f"killed: {result.killed}"))
        if result.returncode != 0:
            last = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.returncode}"]
            raise ToolInputError(last[0])
        return result.stdout.rstrip("\n") + (" ...[truncated]" if result.truncated else "")
