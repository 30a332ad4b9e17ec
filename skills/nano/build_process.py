"""The nano build's own process: it trains a recipe into a directory on pinned float kernels
(`skillswarm.skills.nano.kernels`, which must be set before torch loads, hence a process) and reports
progress, errors and the build record to its parent as JSON lines on a channel of its own.

Parent: `run_build(directory, recipe, progress)`. Child: `python -m skillswarm.skills.nano.build_process DIR`
with the recipe's JSON on stdin.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from skillswarm.protocol import errors
from skillswarm.protocol.errors import ModelError, SkillswarmError
from skillswarm.skills.nano.kernels import build_env
from skillswarm.skills.nano.recipe import NanoRecipe
from skillswarm.skills.nano.warmup import Progress

log = logging.getLogger(__name__)


def train_into(directory: Path, recipe: NanoRecipe, progress: Progress | None) -> dict[str, object]:
    """Warm up a fresh model of `recipe`, save it (weights and tokenizer) into `directory` and return the
    build record (without the completeness marker, which the caller writes last)."""
    import time

    import torch

    from skillswarm.protocol.hashing import weights_hash
    from skillswarm.skills.nano.tokenizer import build_tokenizer
    from skillswarm.skills.nano.warmup import make_model, warm_up
    from skillswarm.skills.registry import get_skill

    start = time.monotonic()
    tokenizer = build_tokenizer()
    skills = [get_skill(name) for name in recipe.skills]
    # One thread: the model is so small that more threads barely help on idle cores and slow it down many
    # times over on busy ones; it also keeps the arithmetic, hence the weights, the same on any core count.
    torch.set_num_threads(1)
    torch.manual_seed(recipe.seed)
    model = make_model(recipe, tokenizer)
    result = warm_up(model, tokenizer, skills, recipe, progress)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return {
        "recipe": recipe.as_dict(), "recipe_hash": recipe.hash(), "weights_hash": weights_hash(directory),
        "parameters": sum(p.numel() for p in model.parameters()), **result,
        "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "build_seconds": round(time.monotonic() - start, 2),
    }


def _error_class(name: object) -> type[SkillswarmError]:
    """The project's exception class a child named (ModelError for anything else)."""
    cls = getattr(errors, str(name), None)
    return cls if isinstance(cls, type) and issubclass(cls, SkillswarmError) else ModelError


def _tail(stream: IO[bytes], lines: int = 20) -> str:
    stream.seek(0)
    return "\n".join(stream.read().decode(errors="replace").splitlines()[-lines:])


def run_build(directory: Path, recipe: NanoRecipe, progress: Progress | None = None) -> dict[str, object]:
    """Train `recipe` into `directory` in a process of its own on pinned kernels; returns the build record
    (with `kernels`, what was pinned). The child's errors are raised here as the same SkillswarmError; a
    crash becomes a ModelError naming its last line. An interrupted build kills its process."""
    env, kernels = build_env(dict(os.environ))
    record: dict[str, Any] | None = None
    failure: dict[str, Any] | None = None
    with tempfile.TemporaryFile() as stderr:
        proc = subprocess.Popen([sys.executable, "-m", __name__, str(directory)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=stderr, env=env, text=True)
        try:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(json.dumps(recipe.as_dict()))
            proc.stdin.close()
            for line in proc.stdout:
                try:
                    message = json.loads(line)
                except ValueError:  # not a message: kept in the log, never a traceback
                    log.debug("nano build process: %s", line.rstrip())
                    continue
                if not isinstance(message, dict):
                    continue
                if "step" in message and progress is not None:
                    progress(message["step"], message["total"], message["info"])
                elif "error" in message:
                    failure = message
                elif "record" in message:
                    record = message["record"]
            code = proc.wait()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if failure is not None:
            raise _error_class(failure.get("type"))(str(failure["error"]))
        if code != 0 or record is None:
            detail = _tail(stderr)
            log.debug("the nano build process exited %s:\n%s", code, detail)
            last = detail.splitlines()[-1] if detail else "no output"
            raise ModelError(f"the nano build process failed (exit {code}): {last}; rerun with -v for its log, "
                             "or `skillswarm base build --force` to start over")
    return {**record, "kernels": kernels}


def main() -> None:
    """The child: recipe JSON on stdin, the directory as argv[1]; JSON lines on the original stdout (which
    is then pointed at stderr, so no library's print can corrupt the channel)."""
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(message: dict[str, object]) -> None:
        channel.write(json.dumps(message) + "\n")

    def report(step: int, total: int, info: dict[str, float]) -> None:
        send({"step": step, "total": total, "info": info})

    try:
        recipe = NanoRecipe.from_dict(json.loads(sys.stdin.read()))
        send({"record": train_into(Path(sys.argv[1]), recipe, report)})
    except SkillswarmError as e:
        send({"error": str(e), "type": type(e).__name__})
    channel.close()


if __name__ == "__main__":
    main()
