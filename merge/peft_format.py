"""LoRA deltas in PEFT's adapter format: the delta file is PEFT's adapter_model.safetensors itself.

A PEFT delta is a skillswarm delta file (format version 2) whose LoRA parts carry PEFT's tensor names,
`base_model.model.<module>.lora_A.weight` [r, in] and `base_model.model.<module>.lora_B.weight` [out, r],
and whose `__metadata__` holds the adapter's adapter_config.json (`peft_config`) beside the usual delta
fields. So one content-addressed blob travels, PEFT reads it as it is (it ignores the metadata), and
anyone rebuilds the adapter directory from the blob alone (`write_adapter_dir`).

It decodes through the lora codec's exact product: delta = (B * scaling) @ A, with PEFT's scaling
(lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA, per-module values from rank_pattern / alpha_pattern)
applied to B elementwise first, then `exact.lora_product` (ordered rank-1 updates, never a matmul). A
fan_in_fan_out module (Conv1D, weight stored [in, out]) gets the transpose, whose rows are the same products
taken in the same order. This module reads no model and imports no PEFT: it is the file format only.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from skillswarm.merge.exact import lora_product
from skillswarm.merge.tensorfile import TensorFile, parse_json, shown
from skillswarm.protocol.errors import MergeError

PREFIX = "base_model.model."  # PEFT's key prefix for a causal LM's modules
CONFIG_NAME = "adapter_config.json"  # the two files of a PEFT adapter directory
WEIGHTS_NAME = "adapter_model.safetensors"
FORMAT_VERSION = "2"  # delta format version of files with PEFT parts (version 1 readers refuse them clearly)
UNSUPPORTED = ("use_dora", "lora_bias")  # PEFT options whose delta is not (B * scaling) @ A


def module_of(weight: str) -> str:
    """The module a weight belongs to ("model.layers.0.mlp.up_proj.weight" -> "model.layers.0.mlp.up_proj")."""
    if not weight.endswith(".weight") or weight == ".weight":
        raise MergeError(f"`{shown(weight)}` is not a module's weight (no `.weight` suffix); a LoRA adapter targets "
                         "the weight matrices of linear layers")
    return weight[: -len(".weight")]


def part_names(weight: str) -> tuple[str, str]:
    """PEFT's names of the (A, B) factors of the adapter on `weight`'s module."""
    module = PREFIX + module_of(weight)
    return module + ".lora_A.weight", module + ".lora_B.weight"


def adapter_config(ranks: Mapping[str, int]) -> dict[str, Any]:
    """An adapter_config.json for LoRA factors of the given per-weight ranks whose B @ A is the delta: each
    module's alpha equals its rank, so PEFT's scaling is 1. Modules whose rank differs from the most common
    one are listed by full module name in rank_pattern and alpha_pattern."""
    if not ranks:
        raise MergeError("an adapter needs at least one LoRA factor pair")
    counts: dict[int, int] = {}
    for r in ranks.values():
        counts[r] = counts.get(r, 0) + 1
    r0 = max(sorted(counts), key=lambda r: counts[r])
    modules = {module_of(w): r for w, r in ranks.items()}
    other = {m: r for m, r in sorted(modules.items()) if r != r0}
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r0, "lora_alpha": r0, "target_modules": sorted(modules),
        "rank_pattern": other, "alpha_pattern": dict(other), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": None,
    }


def json_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """A PEFT config (e.g. LoraConfig.to_dict()) as plain JSON values: sets as sorted lists, enums as values."""
    def plain(v: Any) -> Any:
        if isinstance(v, (set, frozenset)):
            return sorted(plain(x) for x in v)
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, Mapping):
            return {str(k): plain(x) for k, x in v.items()}
        if hasattr(v, "value") and isinstance(getattr(v, "value"), (str, int)):
            return v.value
        return v
    out = plain(dict(config))
    json.dumps(out)  # raise here, not in a writer, on what JSON cannot hold
    return out


def check_config(config: Mapping[str, Any], where: str) -> None:
    """Refuse adapter configs whose delta is not (B * scaling) @ A (DoRA, LoRA biases, other PEFT types)."""
    if config.get("peft_type") != "LORA":
        raise MergeError(f"{where}: peft_type is {str(config.get('peft_type'))[:32]!r}; only LoRA adapters are deltas "
                         "here")
    on = [k for k in UNSUPPORTED if config.get(k)]
    if on:
        raise MergeError(f"{where}: the adapter uses {', '.join(on)}, whose update is not a plain LoRA product; "
                         "train or export it without")
    if config.get("modules_to_save"):
        raise MergeError(f"{where}: the adapter replaces whole modules (modules_to_save), which a delta cannot hold")
    if not _rank_ok(config.get("r")) or not _alpha_ok(config.get("lora_alpha")):
        raise MergeError(f"{where}: adapter config needs an integer r >= 1 and a finite numeric lora_alpha")
    for field, ok in (("rank_pattern", _rank_ok), ("alpha_pattern", _alpha_ok)):
        patterns = config.get(field) or {}
        if not isinstance(patterns, dict) or not all(isinstance(k, str) and _NAME.fullmatch(k) and ok(v)
                                                     for k, v in patterns.items()):
            raise MergeError(f"{where}: {field} must map module names (letters, digits, `_`, `.`) to "
                             f"{'integer ranks >= 1' if field == 'rank_pattern' else 'finite numbers'}")


_NAME = re.compile(r"[A-Za-z0-9_.]{1,512}")  # module names only: a pattern from a hostile file is no regex


def _rank_ok(r: Any) -> bool:
    return isinstance(r, int) and not isinstance(r, bool) and 1 <= r <= 1 << 20


def _alpha_ok(a: Any) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a)


def _pattern(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's per-module lookup (peft.utils.other.get_pattern_key): the first key that matches the name's end."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


def scaling(config: Mapping[str, Any], module: str) -> tuple[int, float]:
    """(rank, scaling) PEFT gives the adapter on `module`: lora_alpha / r, or lora_alpha / sqrt(r) (rsLoRA)."""
    r = int(_pattern(config.get("rank_pattern") or {}, module, config["r"]))
    alpha = float(_pattern(config.get("alpha_pattern") or {}, module, config["lora_alpha"]))
    return r, alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def scaled(b: torch.Tensor, scale: float) -> torch.Tensor:
    """B * scaling as float32: the scaling rounded once to float32, one IEEE product per element (exact
    everywhere); the writer's norm and every reader use this same step."""
    b = b.to(torch.float32)
    return b if scale == 1.0 else b * torch.tensor(scale, dtype=torch.float32)


@dataclass(frozen=True)
class PeftParts:
    """Where one weight's adapter lies in a file, and how it decodes."""

    a: str
    b: str
    scale: float
    transposed: bool  # fan_in_fan_out: the weight is [in, out] and its delta (B @ A)^T


def locate(f: TensorFile, config: Mapping[str, Any], weight: str, shape: tuple[int, ...]) -> PeftParts:
    """The parts of `weight`'s adapter in `f`, checked against the declared shape and the config's rank."""
    a_name, b_name = part_names(weight)
    bad = f"{f.path}: adapter of `{shown(weight)}` (shape {list(shape)})"
    if a_name not in f or b_name not in f:
        raise MergeError(f"{bad} has no {shown(a_name)} / {shown(b_name)} tensors; the file is corrupt")
    a, b = f.entry(a_name), f.entry(b_name)
    transposed = bool(config.get("fan_in_fan_out"))
    rows, cols = ((shape[1], shape[0]) if transposed else shape) if len(shape) == 2 else (-1, -1)
    if (len(shape) != 2 or len(a.shape) != 2 or len(b.shape) != 2 or a.shape[0] != b.shape[1]
            or b.shape[0] != rows or a.shape[1] != cols or not a.dtype.is_floating_point or not b.dtype.is_floating_point):
        raise MergeError(f"{bad}: LoRA parts are A {list(a.shape)} and B {list(b.shape)}, expected A [r, {cols}] and "
                         f"B [{rows}, r]")
    r, scale = scaling(config, module_of(weight))
    if a.shape[0] != r:
        raise MergeError(f"{bad}: the factors have rank {a.shape[0]} but the adapter config says {r}")
    return PeftParts(a_name, b_name, scale, transposed)


def decode_rows(f: TensorFile, p: PeftParts, shape: tuple[int, ...], r0: int, r1: int) -> torch.Tensor:
    """Rows [r0, r1) of the delta (B * scale) @ A (its transpose for fan_in_fan_out) as float32, bit-identical
    to the same rows of the whole product on every machine."""
    if not p.transposed:
        return lora_product(scaled(f.read_rows(p.b, r0, r1), p.scale), f.read(p.a).to(torch.float32))
    # rows i of (B @ A)^T are A[:, i]^T against B^T: the products (B[j, k] * scale) * A[k, i], summed in order k
    # exactly as the untransposed product does (IEEE products commute)
    b = scaled(f.read(p.b), p.scale)
    a_cols = f.read(p.a).to(torch.float32)[:, max(0, r0):min(r1, shape[0])]
    return lora_product(a_cols.T.contiguous(), b.T.contiguous())


def write_adapter_dir(delta_path: Path | str, out_dir: Path | str, *, base_model: str | None = None,
                      overwrite: bool = False) -> Path:
    """Rebuild a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) from a PEFT delta
    file alone, written into a temp directory and renamed into place. The weights file is the delta file
    itself (hard-linked when possible). `base_model` fills in the config's base_model_name_or_path."""
    src, out = Path(delta_path), Path(out_dir)
    with TensorFile(src) as f:
        raw = f.metadata.get("peft_config")
    if raw is None:
        raise MergeError(f"{src} is not a PEFT adapter (no `peft_config` metadata); write one with "
                         "`skillswarm merge delta --codec lora` or `skillswarm train --lora`")
    config = parse_json(raw, f"{src}: its `peft_config` metadata")
    if not isinstance(config, dict):
        raise MergeError(f"{src}: its `peft_config` metadata is not a JSON object; the file is corrupt")
    check_config(config, str(src))
    if base_model is not None:
        config["base_model_name_or_path"] = base_model
    if out.exists() and not overwrite:
        raise MergeError(f"{out} exists; pass --force (overwrite=True) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        try:
            os.link(src, tmp / WEIGHTS_NAME)
        except OSError:
            shutil.copyfile(src, tmp / WEIGHTS_NAME)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
