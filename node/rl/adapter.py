"""LoRA adapters in PEFT's format out of full weights: which weights an adapter targets (the linear layers,
as PEFT's "all-linear" picks them), and the rank-r SVD adapter of a checkpoint against its base, written as
a PEFT adapter directory (what `pull --adapter` and `merge delta --codec lora --adapter-out` give)."""

from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def linear_targets(model: Any) -> list[str]:
    """Weight names of the model's linear layers, the output layer excluded: the modules PEFT's
    target_modules="all-linear" (the trainer's LoRA targets) puts adapters on."""
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted(f"{name}.weight" for name, m in model.named_modules()
                  if isinstance(m, torch.nn.Linear) and m is not output)


def model_targets(model_dir: Path | str) -> list[str]:
    """`linear_targets` of the architecture in a model directory (built on the meta device: no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from skillswarm.protocol.errors import ModelError

    try:
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"cannot read the architecture of {model_dir} (config.json): {e}") from None
    return linear_targets(model)


def export_adapter(base_dir: Path | str, tuned_dir: Path | str, out_dir: Path | str, rank: int, *,
                   base_model: str | None = None, base_hash: str | None = None, skill: str | None = None,
                   overwrite: bool = False, progress: bool = False) -> Any:
    """Write tuned - base as a PEFT adapter directory: rank-`rank` SVD factors of every linear layer's change
    (norms, embeddings and the output layer stay the base's; their change counts in the DeltaInfo's error).
    Returns the DeltaInfo of adapter_model.safetensors, which is also a lora delta file."""
    from skillswarm.merge.deltas import compute_delta
    from skillswarm.merge.peft_format import WEIGHTS_NAME, write_adapter_dir

    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}-", suffix=".safetensors", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        info = compute_delta(base_dir, tuned_dir, tmp, "lora", base_hash=base_hash, skill=skill, progress=progress,
                             adapter_targets=model_targets(base_dir), rank=float(rank))
        write_adapter_dir(tmp, out, base_model=base_model, overwrite=overwrite)
    finally:
        tmp.unlink(missing_ok=True)
    log.info("adapter of rank %d written to %s (relative error %.3g)", rank, out, info.error or 0.0)
    return replace(info, path=out / WEIGHTS_NAME)


def export_checkpoint_adapter(store: Any, spec: Any, version: int, out_dir: Path | str, rank: int, *,
                              progress: bool = False) -> Any:
    """A local checkpoint as a PEFT adapter on the network's base model (v0, which must be local too): the
    rank-`rank` adapter of version - v0 (`export_adapter`), with the signed manifest beside it
    (manifest.msgpack) so the adapter says which checkpoint it stands for."""
    from skillswarm.protocol.atomic import atomic_write_bytes
    from skillswarm.protocol.codec import encode_record
    from skillswarm.protocol.errors import SkillswarmError

    if version == 0:
        raise SkillswarmError("v0 is the base model itself; an adapter on it would be empty (pull a later version)")
    manifest = store.manifest(version)
    info = export_adapter(store.path(0), store.path(version), out_dir, rank, base_model=spec.base_model,
                          base_hash=spec.base_hash, overwrite=True, progress=progress)
    atomic_write_bytes(Path(out_dir) / "manifest.msgpack", encode_record(manifest))
    return info
