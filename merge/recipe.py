"""YAML merge recipes in the spirit of mergekit's, so its users feel at home:

```yaml
merge_method: ties            # linear, task_arithmetic, ties, dare_linear, dare_ties, breadcrumbs
base_model: ./base            # a Hugging Face model directory
models:
  - model: ./math-tuned       # a fine-tuned model directory ...
    parameters: {weight: 1.0, density: 0.5}
  - delta: ./code.safetensors # ... or a skillswarm delta file
    parameters: {weight: 0.5}
parameters: {lambda: 1.0, density: 0.2, normalize: true}   # the method's; `weight` sets a default weight
dtype: bfloat16               # output dtype of floating-point weights (default: the base's)
seed: 0                       # DARE's masks
```

Paths are taken relative to the current directory, as mergekit does. A `models` entry naming the base
model is skipped (mergekit recipes often list it). mergekit features that have no meaning here (slices,
per-layer gradients, tokenizer surgery) are refused with a message rather than ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import torch
import yaml

from skillswarm.merge.methods import get_method
from skillswarm.merge.streaming import MergeInput, MergeSpec
from skillswarm.protocol.errors import MergeError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
IGNORED_PARAMS = ("int8_mask",)  # a mergekit memory knob; harmless to accept


class RecipeModel(msgspec.Struct, forbid_unknown_fields=True):
    """One input: `model` (a directory) or `delta` (a file), with weight/density."""

    model: str | None = None
    delta: str | None = None
    parameters: dict[str, float] = {}


class Recipe(msgspec.Struct, forbid_unknown_fields=True):
    """A parsed recipe file."""

    merge_method: str
    base_model: str
    models: list[RecipeModel]
    parameters: dict[str, float | bool] = {}
    dtype: str | None = None
    seed: int = 0


@dataclass(frozen=True)
class RecipePlan:
    """What a recipe asks for, ready for merge_models / merge_deltas."""

    base: Path
    inputs: list[MergeInput]
    spec: MergeSpec
    out_dtype: torch.dtype | None
    seed: int


def load_recipe(path: Path | str) -> Recipe:
    """Parse and validate a recipe file (MergeError says which key is wrong)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise MergeError(f"cannot read recipe {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise MergeError(f"recipe {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise MergeError(f"recipe {path} must be a mapping with merge_method, base_model and models")
    for key in ("slices", "tokenizer_source", "tokenizer", "chat_template"):
        if key in raw:
            raise MergeError(f"recipe {path}: `{key}` (a mergekit feature) is not supported by skillswarm merge")
    try:
        return msgspec.convert(raw, Recipe)
    except msgspec.ValidationError as e:
        raise MergeError(f"recipe {path}: {e} (per-layer gradients and filters are not supported; "
                         "parameter values must be plain numbers)") from None


def plan_recipe(recipe: Recipe) -> RecipePlan:
    """Resolve a recipe into inputs, a merge spec and an output dtype."""
    method = get_method(recipe.merge_method)
    params: dict[str, Any] = {k: v for k, v in recipe.parameters.items() if k not in IGNORED_PARAMS}
    default_weight = float(params.pop("weight", 1.0))
    spec = MergeSpec(method.name, params)
    spec.resolve()
    base = Path(recipe.base_model)
    inputs = []
    for i, m in enumerate(recipe.models):
        if (m.model is None) == (m.delta is None):
            raise MergeError(f"recipe models[{i}]: give exactly one of `model` (a directory) or `delta` (a file)")
        path = Path(m.model or m.delta or "")
        if m.model is not None and path.resolve() == base.resolve():
            continue
        extra = set(m.parameters) - {"weight", "density", *IGNORED_PARAMS}
        if extra:
            raise MergeError(f"recipe models[{i}]: unknown parameters {sorted(extra)} (per-input: weight, density)")
        density = m.parameters.get("density")
        if density is not None and "density" not in method.params.__dataclass_fields__:
            raise MergeError(f"recipe models[{i}]: {method.name} takes no density")
        inputs.append(MergeInput(path, float(m.parameters.get("weight", default_weight)),
                                 None if density is None else float(density)))
    if not inputs:
        raise MergeError("recipe lists no models or deltas to merge besides the base")
    if recipe.dtype is not None and recipe.dtype not in DTYPES:
        raise MergeError(f"recipe dtype {recipe.dtype!r} is not one of {', '.join(DTYPES)}")
    return RecipePlan(base, inputs, spec, DTYPES[recipe.dtype] if recipe.dtype else None, recipe.seed)
