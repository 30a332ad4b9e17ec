"""The end of a training run: the trained model as an HF directory, its delta against the starting
model (through the merge engine's codecs), a LoRA run's PEFT adapter (RUN_DIR/adapter), the run's
TrainStats and RUN_DIR/result.json."""

from __future__ import annotations

import copy
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from skillswarm.node.rl.rundir import ADAPTER, DELTA, MODEL, RESULT
from skillswarm.protocol.atomic import atomic_write_text
from skillswarm.protocol.hashing import weights_hash
from skillswarm.protocol.records import TrainStats

if TYPE_CHECKING:
    from skillswarm.node.rl.config import TrainConfig
    from skillswarm.node.rl.trainer import Trainer

log = logging.getLogger(__name__)


def save_model(trainer: "Trainer", tokenizer: Any, dtype: torch.dtype, run_dir: Path) -> Path:
    """Write the trained weights (LoRA merged) in the starting model's dtype, with its tokenizer, to
    RUN_DIR/model: written into a temp directory and renamed into place."""
    model = trainer.merged_model()
    if dtype != torch.float32:  # the trainer keeps fp32 master weights: save a cast copy
        model = copy.deepcopy(model).to(dtype)
    target = run_dir / MODEL
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=run_dir))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        old = run_dir / ".model-old"
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def save_adapter_file(cfg: "TrainConfig", trainer: "Trainer", dtype: torch.dtype, out: Path, base_hash: str) -> Any:
    """The trained LoRA adapter as a PEFT delta file (PEFT's adapter_model.safetensors with its config in the
    metadata): the factors exactly as trained, so the delta is what the run learned, not an approximation."""
    from skillswarm.merge import encode_delta

    factors, config = trainer.adapter()
    return encode_delta(factors, out, "lora", base_hash=base_hash, skill=cfg.skill, dtypes={k: dtype for k in factors},
                        peft_config=config, rank=float(config["r"]))


def save_delta(cfg: "TrainConfig", trainer: "Trainer", model_dir: Path, dtype: torch.dtype, run_dir: Path) -> Any:
    """RUN_DIR/delta.safetensors = trained - starting weights, encoded with `cfg.codec`: a LoRA run with the
    lora codec publishes its adapter; a full run with the lora codec the rank-r SVD adapter of its linear
    layers (both in PEFT's format); every other codec streams tuned - base."""
    from skillswarm.merge import compute_delta

    base_hash = weights_hash(cfg.model_dir)
    out = run_dir / DELTA
    if cfg.codec == "lora" and cfg.lora:
        return save_adapter_file(cfg, trainer, dtype, out, base_hash)
    params = dict(cfg.codec_params)
    targets = None
    if cfg.codec == "lora":
        from skillswarm.node.rl.adapter import linear_targets

        params.setdefault("rank", float(cfg.lora_rank))
        targets = linear_targets(trainer.model)
    return compute_delta(cfg.model_dir, model_dir, out, cfg.codec, base_hash=base_hash, skill=cfg.skill,
                         adapter_targets=targets, **params)


def save_outputs(cfg: "TrainConfig", trainer: "Trainer", tokenizer: Any, dtype: torch.dtype,
                 run_dir: Path) -> tuple[Path, Any, Path | None]:
    """The trained model directory, the delta (None when `cfg.codec` is None) and, for a LoRA run, its PEFT
    adapter directory RUN_DIR/adapter (loads with PeftModel.from_pretrained on the starting model)."""
    from skillswarm.merge.peft_format import write_adapter_dir

    model_dir = save_model(trainer, tokenizer, dtype, run_dir)
    delta = save_delta(cfg, trainer, model_dir, dtype, run_dir) if cfg.codec else None
    adapter_dir = None
    if cfg.lora:
        if delta is not None and cfg.codec == "lora":
            src, scratch = delta.path, None
        else:
            scratch = run_dir / f".{ADAPTER}.safetensors"
            src = save_adapter_file(cfg, trainer, dtype, scratch, weights_hash(cfg.model_dir)).path
        try:
            adapter_dir = write_adapter_dir(src, run_dir / ADAPTER, base_model=str(cfg.model_dir), overwrite=True)
        finally:
            if scratch is not None:
                scratch.unlink(missing_ok=True)
    return model_dir, delta, adapter_dir


def train_stats(cfg: "TrainConfig", state: Mapping[str, Any], counters: Mapping[str, Any],
                after: Mapping[str, Any] | None) -> TrainStats:
    """The run's TrainStats (cumulative over resumed segments)."""
    episodes = int(counters.get("episodes", 0))
    staleness_n = int(counters.get("staleness_n", 0))
    return TrainStats(
        steps=int(state["step"]), samples=int(counters.get("samples", 0)), tokens=int(counters.get("tokens", 0)),
        seconds=round(float(state["seconds"]), 3),
        mean_reward=round(float(counters.get("reward_sum", 0.0)) / episodes, 6) if episodes else 0.0,
        accuracy_before=state.get("accuracy_before"), accuracy_after=None if after is None else after["accuracy"],
        eval_n=cfg.eval_n if after is not None else 0,
        mean_staleness=round(float(counters.get("staleness_sum", 0)) / staleness_n, 6) if staleness_n else 0.0,
        dropped_groups=int(counters.get("env_error_groups", 0)) + int(counters.get("stale_groups", 0)),
        filtered_groups=int(counters.get("zero_variance_groups", 0)), engine=cfg.engine, lora=cfg.lora,  # type: ignore[arg-type]
    )


def write_result(run_dir: Path, model_dir: Path, delta: Any, stats: TrainStats) -> Path:
    """RUN_DIR/result.json: the stats and where the outputs are."""
    import msgspec

    body = {"model_dir": str(model_dir), "stats": msgspec.to_builtins(stats),
            "delta": None if delta is None else {"path": str(delta.path), "sha256": delta.sha256, "size": delta.size,
                                                  "codec": delta.codec, "norm": delta.norm}}
    return atomic_write_text(run_dir / RESULT, json.dumps(body, indent=2, sort_keys=True) + "\n")
