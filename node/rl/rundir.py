"""A training run's directory and its checkpoints.

    RUN_DIR/run.json          the settings the run started with (a resume must match them)
    RUN_DIR/checkpoint.pt     the latest run checkpoint: trainable weights, AdamW state, step, counters
    RUN_DIR/metrics.jsonl     the metrics log (`MetricsLog`)
    RUN_DIR/model/            the trained model at the end (HF format)
    RUN_DIR/delta.safetensors the delta against the starting model
    RUN_DIR/result.json       the run's summary (TrainStats and paths)
    RUN_DIR/plots/            `skillswarm report` output

The checkpoint is one file written to a temp name and renamed: a run killed while saving keeps the
previous checkpoint whole. The metrics log holds one JSON object per line (`kind` = start | step | eval |
end), appended and flushed as they happen, so a killed run keeps everything up to its last step; a
half-written last line is ignored when reading, and on resume the log is cut back to the checkpoint's step.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from skillswarm.protocol.atomic import atomic_open, atomic_write_text
from skillswarm.protocol.errors import TrainError

log = logging.getLogger(__name__)

RUN_FILE = "run.json"
CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
MODEL = "model"
DELTA = "delta.safetensors"
ADAPTER = "adapter"  # a LoRA run's PEFT adapter directory
RESULT = "result.json"
FORMAT = 1

# Settings a resumed run must share with the run it continues (the others, e.g. steps, may change).
IDENTITY = ("model_dir", "skill", "lora", "lora_rank", "loss", "group_size", "batch", "seed", "temperature")


def save_checkpoint(run_dir: Path, step: int, trainer_state: Mapping[str, Any], progress: Mapping[str, Any]) -> Path:
    """Write RUN_DIR/checkpoint.pt atomically."""
    path = run_dir / CHECKPOINT
    with atomic_open(path, "wb") as f:
        torch.save({"format": FORMAT, "step": step, "trainer": dict(trainer_state), "progress": dict(progress)}, f)
    return path


def load_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The run's latest checkpoint, or None when it has none."""
    path = run_dir / CHECKPOINT
    if not path.exists():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise TrainError(f"cannot read the run checkpoint {path} ({e}); delete it to start over") from e
    if state.get("format") != FORMAT:
        raise TrainError(f"{path} was written by another version of skillswarm (format {state.get('format')}); "
                         "start a new run (another --out)")
    return state


def prepare_run_dir(run_dir: Path, settings: Mapping[str, Any], resume: bool) -> bool:
    """Check RUN_DIR against `resume` and record the settings; returns whether a checkpoint exists to resume."""
    run_file = run_dir / RUN_FILE
    has_run = run_file.exists()
    if has_run and not resume:
        raise TrainError(f"{run_dir} already holds a training run; pass --resume to continue it, or pick another --out")
    if resume and has_run:
        previous = json.loads(run_file.read_text())
        changed = [k for k in IDENTITY if str(previous.get(k)) != str(settings.get(k))]
        if changed:
            details = ", ".join(f"{k}: {previous.get(k)!r} -> {settings.get(k)!r}" for k in changed)
            raise TrainError(f"cannot resume {run_dir} with different settings ({details}); "
                             "use the run's settings or another --out")
    run_dir.mkdir(parents=True, exist_ok=True)
    if not has_run:
        atomic_write_text(run_file, json.dumps(dict(settings), indent=2, sort_keys=True, default=str) + "\n")
    return resume and (run_dir / CHECKPOINT).exists()

def _clean(value: Any) -> Any:
    """JSON-safe values: NaN/inf become null (JSON has no such numbers)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def read_metrics(path: Path | str) -> list[dict[str, Any]]:
    """Every complete record of a metrics file, in order (an unparseable line, e.g. the torn last line
    of a killed run, is skipped)."""
    out = []
    p = Path(path)
    if not p.exists():
        return out
    for line in p.read_text().splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            log.debug("skipping a torn metrics line in %s", p)
    return out


class MetricsLog:
    """Append-only JSONL writer; every record also goes to the run's trackers (`skillswarm.node.rl.tracking`)."""

    def __init__(self, path: Path | str, trackers: Sequence[Any] = ()) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = self.path.open("a")
        self.trackers = list(trackers)

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and flush it."""
        clean = _clean(record)
        self._f.write(json.dumps(clean, sort_keys=True) + "\n")
        self._f.flush()
        if self.trackers:
            from skillswarm.node.rl.tracking import send

            send(self.trackers, clean)

    def close(self) -> None:
        self._f.close()
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []

    @staticmethod
    def truncate(path: Path | str, step: int) -> list[dict[str, Any]]:
        """Keep the records up to `step` (a resumed run redoes what came after its checkpoint)."""
        kept = [r for r in read_metrics(path) if int(r.get("step", 0)) <= step and r.get("kind") != "end"]
        atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept))
        return kept


def last_eval(records: Iterable[dict[str, Any]], step: int | None = None) -> dict[str, Any] | None:
    """The latest eval record (at `step` exactly when given)."""
    evals = [r for r in records if r.get("kind") == "eval" and (step is None or r.get("step") == step)]
    return evals[-1] if evals else None
