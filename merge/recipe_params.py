"""mergekit's parameter settings, resolved per tensor: a value is a scalar, a gradient (a list of numbers
interpolated piecewise-linearly over the layer index: layer i of L gets t = i / (L - 1); tensors outside
the layers, the embeddings, final norm and head, get t = 0, as in mergekit), or a list of
`{filter: SUBSTRING, value: ...}` conditions (the first whose filter is in the tensor's name, `*` or
absent, wins). Settings are looked up from the most specific place to the least: the model's own
`parameters`, the slice's, then the recipe's; the first that gives a value wins, else the default."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from skillswarm.protocol.errors import MergeError

_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block|layer)\.(\d+)\.")
_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor belongs to (model.layers.3.mlp... -> 3), None outside the layers."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def in_first_layers(name: str, layers: int) -> bool:
    """Whether tensor `name` lies in the model's first `layers` decoder layers (embeddings, final norm and head do not)."""
    i = layer_index(name)
    return i is not None and i < layers


def num_layers(model_dir: Path, names: Sequence[str]) -> int:
    """The model's layer count: its config.json's, else one more than the largest layer index of its tensors."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        config = config.get("text_config", config) if isinstance(config, dict) else {}
        for key in _LAYER_KEYS:
            if isinstance(config.get(key), int):
                return int(config[key])
    except (OSError, ValueError):
        pass
    found = [i for i in map(layer_index, names) if i is not None]
    return max(found) + 1 if found else 0


def layer_t(name: str, layers: int) -> float:
    """mergekit's position of a tensor for gradients: i / (layers - 1) in layer i, 0 outside the layers."""
    i = layer_index(name)
    if i is None:
        return 0.0
    return i / (layers - 1) if layers > 1 else 1.0


def _is_scalar(v: Any) -> bool:
    return isinstance(v, (int, float, bool)) and not isinstance(v, type(None))


def check_setting(value: Any, kind: type, where: str) -> None:
    """Validate one setting's shape and leaf types (`kind`: float or bool), naming `where` on error."""
    if isinstance(value, dict):
        value = [value]
    if _is_scalar(value):
        ok = isinstance(value, bool) if kind is bool else not isinstance(value, bool)
        if not ok:
            raise MergeError(f"{where}: expected {'true or false' if kind is bool else 'a number'}, got {value!r}")
        return
    if not isinstance(value, list) or not value:
        raise MergeError(f"{where}: expected a value, a list of values (a gradient over the layers) or a list "
                         f"of {{filter, value}} conditions, got {value!r}")
    if all(_is_scalar(v) for v in value):
        for i, v in enumerate(value):
            check_setting(v, kind, f"{where}[{i}]")
        return
    for i, cond in enumerate(value):
        if not isinstance(cond, dict) or "value" not in cond or set(cond) - {"filter", "value"}:
            raise MergeError(f"{where}[{i}]: a condition is {{filter: SUBSTRING, value: ...}} (filter optional), "
                             f"got {cond!r}")
        if cond.get("filter") is not None and not isinstance(cond["filter"], str):
            raise MergeError(f"{where}[{i}].filter: expected a string, got {cond['filter']!r}")
        if isinstance(cond["value"], (dict, type(None))) or (
                isinstance(cond["value"], list) and not all(_is_scalar(v) for v in cond["value"])):
            raise MergeError(f"{where}[{i}].value: expected a value or a gradient, got {cond['value']!r}")
        check_setting(cond["value"], kind, f"{where}[{i}].value")


def evaluate(setting: Any, name: str, t: float) -> Any:
    """One setting's value for tensor `name` at layer position `t` (None: no condition matched)."""
    if isinstance(setting, dict):
        setting = [setting]
    if _is_scalar(setting):
        return setting
    if all(_is_scalar(v) for v in setting):
        if any(isinstance(v, bool) for v in setting):
            return setting[int(t * (len(setting) - 1))]
        scaled = t * (len(setting) - 1)
        i0 = int(scaled)
        i1 = min(len(setting) - 1, i0 + 1)
        frac = scaled - i0
        return (1 - frac) * setting[i0] + frac * setting[i1]
    for cond in setting:
        f = cond.get("filter")
        if f is None or f == "*" or (name and f in name):
            return evaluate(cond["value"], name, t)
    return None


def resolve(key: str, sources: Sequence[Mapping[str, Any] | None], name: str, t: float, default: Any) -> Any:
    """The value of parameter `key` for tensor `name`: the first source (most specific first) that gives one."""
    for src in sources:
        if src and key in src:
            v = evaluate(src[key], name, t)
            if v is not None:
                return v
    return default


def is_constant(settings: Mapping[str, Any]) -> bool:
    """Whether every setting is a plain scalar (the same for every tensor)."""
    return all(_is_scalar(v) for v in settings.values())
