"""A training run's directory and its checkpoints.

    RUN_DIR/run.json          the settings the run started with (a resume must match them)
    RUN_DIR/checkpoint.pt     the latest run checkpoint: trainable weights, AdamW state, step, counters
    RUN_DIR/metrics.jsonl     the metrics log (`skillswarm.node.metrics`)
    RUN_DIR/model/            the trained model at the end (HF format)
    RUN_DIR/delta.safetensors the delta against the starting model
    RUN_DIR/result.json       the run's summary (TrainStats and paths)
    RUN_DIR/plots/            `skillswarm report` output

The checkpoint is one file written to a temp name and renamed: a run killed while saving keeps the
previous checkpoint whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from skillswarm.protocol.atomic import atomic_open, atomic_write_text
from skillswarm.protocol.errors import TrainError

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
