"""Experiment trackers (`--report-to tensorboard|wandb`): the records a run writes to metrics.jsonl, also
sent to TensorBoard or Weights & Biases as flat scalars (`train/reward`, `train/rubric/good_call`,
`eval/accuracy`, `round/accuracy/calc`, ...). Both are optional extras, imported only when asked for.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

from skillswarm.protocol.errors import TrainError

log = logging.getLogger(__name__)

TRACKERS: tuple[str, ...] = ("tensorboard", "wandb")
# metrics.jsonl record kinds and the namespace their scalars go under
NAMESPACES = {"step": "train", "eval": "eval", "round": "round"}
SKIP_KEYS = frozenset({"kind", "step", "time", "mode", "settings", "stats", "delta", "version_hash"})


class Tracker(Protocol):
    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def flatten(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a record as `a/b/c` keys (booleans as 0/1; strings, lists and non-finite values left out)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key in SKIP_KEYS:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[name] = float(value)
    return out


class TensorBoardTracker:
    """Scalars into RUN_DIR/tensorboard (`tensorboard --logdir RUN_DIR/tensorboard`)."""

    def __init__(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise TrainError(f"--report-to tensorboard needs the tensorboard package ({e}): "
                             "pip install 'skillswarm[tensorboard]'") from None
        self.dir = Path(run_dir) / "tensorboard"
        self.writer = SummaryWriter(str(self.dir))

    def log(self, scalars: dict[str, float], step: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run (project `skillswarm`; `WANDB_MODE=offline` keeps it on this machine)."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as e:
            raise TrainError(f"--report-to wandb needs the wandb package ({e}): pip install 'skillswarm[wandb]'") from None
        try:
            self.run = wandb.init(project="skillswarm", name=name, dir=str(run_dir), config=config, reinit=True)
        except Exception as e:  # not logged in, no network in online mode, ...
            raise TrainError(f"wandb could not start a run ({e}); `wandb login`, or set WANDB_MODE=offline") from None

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


def check_trackers(names: Iterable[str]) -> list[str]:
    """Problems with `--report-to` values (unknown names), for settings validation."""
    return [f"--report-to {n!r} is not a tracker; choose from {', '.join(TRACKERS)}" for n in names if n not in TRACKERS]


def open_trackers(names: Sequence[str], run_dir: Path, name: str, config: dict[str, Any]) -> list[Tracker]:
    """The trackers asked for, started (a clear TrainError when one's package is missing or it cannot start)."""
    problems = check_trackers(names)
    if problems:
        raise TrainError("; ".join(problems))
    out: list[Tracker] = []
    for n in dict.fromkeys(names):
        out.append(TensorBoardTracker(run_dir) if n == "tensorboard" else WandbTracker(run_dir, name, config))
    return out


def send(trackers: Sequence[Tracker], record: dict[str, Any]) -> None:
    """Send one metrics.jsonl record (a step, an eval, a round) to every tracker; other kinds are not scalars."""
    namespace = NAMESPACES.get(str(record.get("kind")))
    if namespace is None or not trackers:
        return
    scalars = {f"{namespace}/{k}": v for k, v in flatten(record).items()}
    step = int(record.get("step", record.get("version", 0)))
    for tracker in trackers:
        try:
            tracker.log(scalars, step)
        except Exception as e:  # a tracker's outage never stops training
            log.warning("tracker %s failed to log step %d: %s", type(tracker).__name__, step, e)
