"""mergekit's YAML merge recipes, as mergekit documents them, so its users' recipes run here:

```yaml
merge_method: ties            # linear, task_arithmetic, ties, dare_linear, dare_ties, breadcrumbs,
                              # breadcrumbs_ties, della, della_linear, slerp, model_stock
base_model: ./base            # a model directory or a Hugging Face hub id (org/name[@revision])
models:
  - model: ./math-tuned       # a fine-tuned model (directory or hub id) ...
    parameters:
      weight: 1.0
      density: [0.2, 0.5, 0.8] # a gradient: interpolated over the layers
  - delta: ./code.safetensors # ... or a skillswarm delta file
    parameters: {weight: 0.5}
parameters:                   # the method's; also defaults for the per-model ones
  lambda: 1.0
  normalize: true
  t:                          # (slerp) per-tensor values: the first matching filter wins
    - {filter: self_attn, value: [0, 0.5, 1]}
    - value: 0.5
dtype: bfloat16               # written as the output's dtype, and recorded in its config.json
out_dtype: float16            # (optional) the output dtype when it differs from `dtype`
tokenizer_source: base        # base, union or a model: only when every model shares the base's vocabulary
seed: 0                       # (skillswarm) the seed of DARE's and DELLA's masks
```

`slices:` with one slice whose sources each span all of their model's layers means the same as
`models:` and is accepted (mergekit's slerp example is written that way). Defaults are mergekit's (density
1, gamma 0.01, epsilon 0.15, each method's normalize and rescale). dare_* run as mergekit's: a random drop,
then the L1 rescale (`rescale`, on by default). Differences: a missing `weight` counts as 1 (mergekit
requires it); merges compute in float32 and round once to `dtype` (mergekit computes in `dtype`); random
masks (dare, della) come from skillswarm's seeded generator, so they match mergekit's in distribution only;
magnitudes tied at a trim threshold are all kept (mergekit keeps an arbitrary subset).
Anything without a sound meaning here (layer stacking, LoRA `+` references, tokenizer surgery, a parameter
a method does not take, rescale for ties or breadcrumbs) is refused with a message naming the key, never
ignored. Paths are taken relative to the current directory, as mergekit does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from skillswarm.merge.checkpoint import Checkpoint
from skillswarm.merge.methods import get_method
from skillswarm.merge.recipe_params import check_setting, layer_t, num_layers, resolve
from skillswarm.merge.streaming import MergeInput, MergeSpec, TensorParams
from skillswarm.protocol.errors import MergeError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
TOP_KEYS = ("merge_method", "base_model", "models", "slices", "parameters", "dtype", "out_dtype",
            "tokenizer_source", "tokenizer", "seed")
REFUSED = {
    "modules": "per-module merges (`modules`) are not supported; give `models`",
    "chat_template": "`chat_template` is not supported; the output keeps its tokenizer's chat template",
}
_GTA_SHARED = {"lambda": float, "normalize": bool, "rescale": bool, "int8_mask": bool}
# mergekit's DARE keeps each entry with probability `density` and, with `rescale` (its default), restores the
# task vector's L1 norm, else leaves the survivors as they are: DELLA's sparsifier with epsilon 0. So recipes
# run dare_* on it, with mergekit's defaults (skillswarm's own dare_* rescale by 1 / density, as the paper).
_RUN_AS = {"dare_linear": ("della_linear", {"epsilon": 0.0, "normalize": False, "rescale": True}),
           "dare_ties": ("della", {"epsilon": 0.0, "normalize": False, "rescale": True})}


def method_parameters(name: str) -> tuple[dict[str, type], dict[str, type]]:
    """mergekit's parameters of a method: (shared ones, per-model ones), each name -> float or bool."""
    if name == "linear":
        return {"normalize": bool}, {"weight": float}
    if name == "slerp":
        return {"t": float}, {}
    if name == "model_stock":
        return {"filter_wise": bool}, {}
    per_input = {"weight": float, "density": float}
    if name.startswith("breadcrumbs"):
        per_input["gamma"] = float
    if name.startswith("della"):
        per_input["epsilon"] = float
    return dict(_GTA_SHARED), per_input


@dataclass(frozen=True)
class RecipePlan:
    """What a recipe asks for, ready for merge_deltas: inputs, spec, per-tensor parameters, output options.
    `method` is the recipe's merge_method (the spec may name the skillswarm method that runs it)."""

    method: str
    base: Path
    inputs: list[MergeInput]
    spec: MergeSpec
    out_dtype: torch.dtype | None
    seed: int
    tensor_params: Callable[[str], TensorParams]
    tokenizer_from: Path | None = None
    params: dict[str, Any] | None = None  # the recipe's top-level parameters, for reports


def load_recipe(path: Path | str) -> dict[str, Any]:
    """Parse a recipe file and check its top-level keys (MergeError says which key is wrong)."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise MergeError(f"cannot read recipe {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise MergeError(f"recipe {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise MergeError(f"recipe {path} must be a mapping with merge_method, base_model and models")
    for key in raw:
        if key in REFUSED:
            raise MergeError(f"recipe {path}: {REFUSED[key]}")
        if key not in TOP_KEYS:
            raise MergeError(f"recipe {path}: unknown key `{key}` (a recipe has: {', '.join(TOP_KEYS)})")
    if not isinstance(raw.get("merge_method"), str):
        raise MergeError(f"recipe {path}: `merge_method` must name a method")
    return raw


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise MergeError(f"{where}: expected a mapping, got {value!r}")
    return value


def _check_params(settings: dict[str, Any], where: str, method: str, shared: dict[str, type],
                  per_input: dict[str, type], model_level: bool) -> None:
    for key, value in settings.items():
        if model_level and key in shared:
            raise MergeError(f"{where}.{key}: `{key}` applies to the whole merge (mergekit reads it only from the "
                             "recipe's or the slice's `parameters` and ignores it per model); move it there")
        kind = per_input.get(key) or (None if model_level else shared.get(key))
        if kind is None:
            allowed = sorted(per_input if model_level else {**shared, **per_input})
            raise MergeError(f"{where}.{key}: {method} has no parameter `{key}`"
                             f"{' per model' if model_level else ''} (it takes: {', '.join(allowed) or 'none'})")
        check_setting(value, kind, f"{where}.{key}")


def _model_ref(entry: Any, where: str) -> tuple[str, str]:
    """('model' or 'delta', reference) of a models[] / sources[] entry."""
    entry = _mapping(entry, where)
    extra = set(entry) - {"model", "delta", "parameters", "layer_range"}
    if extra:
        raise MergeError(f"{where}: unknown key `{sorted(extra)[0]}` (an input has model or delta, and parameters)")
    if ("model" in entry) == ("delta" in entry):
        raise MergeError(f"{where}: give exactly one of `model` (a model directory or hub id) or `delta` (a file)")
    kind = "model" if "model" in entry else "delta"
    ref = entry[kind]
    if not isinstance(ref, str):
        raise MergeError(f"{where}.{kind}: expected a path or hub id, got {ref!r}")
    if kind == "model" and "+" in ref and not Path(ref).exists():
        raise MergeError(f"{where}.model: `{ref}` applies a LoRA to a model (mergekit's `model+lora`), which is not "
                         "supported; merge the adapter first or give its delta")
    return kind, ref


def _entries(raw: dict[str, Any]) -> tuple[list[tuple[str, dict[str, Any]]], dict[str, Any], Any]:
    """[(where, entry)], the slice's parameters and its base_model, from `models` or one full-range slice."""
    if ("models" in raw) == ("slices" in raw):
        raise MergeError("recipe: give exactly one of `models` or `slices`")
    if "models" in raw:
        models = raw["models"]
        if not isinstance(models, list):
            raise MergeError("models: expected a list of {model: ..., parameters: ...}")
        return [(f"models[{i}]", _mapping(m, f"models[{i}]")) for i, m in enumerate(models)], {}, None
    slices = raw["slices"]
    if not isinstance(slices, list) or len(slices) != 1:
        raise MergeError("slices: only one slice whose sources span every layer of their models (the same as "
                         "`models`) is supported; stacking or splicing layer ranges is not")
    sl = _mapping(slices[0], "slices[0]")
    extra = set(sl) - {"sources", "parameters", "base_model"}
    if extra:
        raise MergeError(f"slices[0].{sorted(extra)[0]}: not supported (a slice has sources, parameters, base_model)")
    if not isinstance(sl.get("sources"), list):
        raise MergeError("slices[0].sources: expected a list of {model, layer_range}")
    out = []
    for i, src in enumerate(sl["sources"]):
        where = f"slices[0].sources[{i}]"
        src = _mapping(src, where)
        if "layer_range" not in src:
            raise MergeError(f"{where}.layer_range: missing")
        out.append((where, src))
    return out, _mapping(sl.get("parameters"), "slices[0].parameters"), sl.get("base_model")


def _check_layer_range(where: str, entry: dict[str, Any], path: Path) -> None:
    if "layer_range" not in entry:
        return
    r = entry["layer_range"]
    ck = Checkpoint(path)
    try:
        layers = num_layers(path, ck.names())
    finally:
        ck.close()
    if r != [0, layers]:
        raise MergeError(f"{where}.layer_range: {r} is not all of the model's layers [0, {layers}]; only whole "
                         "models can be merged (layer stacking is not supported)")


def _dtype(raw: dict[str, Any], key: str) -> torch.dtype | None:
    name = raw.get(key)
    if name is None:
        return None
    name = str(name).removeprefix("torch.")
    if name not in DTYPES:
        raise MergeError(f"{key}: {raw[key]!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _vocabulary(model_dir: Path) -> Any:
    """What identifies a model's vocabulary: tokenizer.json's token -> id map, else its tokenizer files' bytes."""
    from skillswarm.merge.checkpoint import aux_files, is_tokenizer_file

    tj = model_dir / "tokenizer.json"
    if tj.is_file():
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(tj)).get_vocab(with_added_tokens=True)
    files = {p.name: p.read_bytes() for p in aux_files(model_dir)
             if is_tokenizer_file(p.name) and not p.name.startswith(("tokenizer_config", "chat_template"))}
    return files or None


Resolve = Callable[[str, str], Path]


def local_model(ref: str, key: str) -> Path:
    """A recipe's model reference as a local directory (what plan_recipe resolves with unless given another
    resolver: skillswarm.merge has no network code; the CLI passes one that fetches hub ids)."""
    path = Path(ref).expanduser()
    if not path.is_dir():
        raise MergeError(f"{key}: {ref!r} is not a local model directory" + (
            "" if path.exists() else " (a Hugging Face hub id is fetched by `skillswarm merge run --recipe`)"))
    return path


def _tokenizer(raw: dict[str, Any], base: Path, models: list[Path], resolve: Resolve) -> Path | None:
    """The directory whose tokenizer the output takes (None: the base's), refusing what needs vocabulary surgery."""
    key, source = "tokenizer_source", raw.get("tokenizer_source")
    if "tokenizer" in raw:
        tok = _mapping(raw["tokenizer"], "tokenizer")
        for k in tok:
            if k != "source":
                raise MergeError(f"tokenizer.{k}: not supported (adding tokens or padding the vocabulary needs "
                                 "embedding surgery); only tokenizer.source is")
        if source is not None:
            raise MergeError("tokenizer_source and tokenizer: give one of them, as mergekit requires")
        key, source = "tokenizer.source", tok.get("source")
    if source is None:
        return None
    if not isinstance(source, str):
        raise MergeError(f"{key}: expected base, union or a model, got {source!r}")
    chosen = None if source in ("base", "union") else resolve(source, key)
    ref = _vocabulary(base)
    for m in [*models, *([chosen] if chosen else [])]:
        v = _vocabulary(m)
        if v is not None and ref is not None and v != ref:
            raise MergeError(f"{key}: {source}: {m} has a different vocabulary from the base {base}; skillswarm merge "
                             "cannot remap embedding rows between tokenizers (mergekit's tokenizer merging), so it "
                             "only takes tokenizer_source when every model shares the base's vocabulary")
    if chosen is not None and _vocabulary(chosen) is None:
        raise MergeError(f"{key}: {chosen} has no tokenizer files")
    vocab, rows = _vocabulary(chosen or base), _embedding_rows(base)
    if not isinstance(vocab, dict) or rows != len(vocab):
        have = f"{len(vocab)} tokens" if isinstance(vocab, dict) else "no tokenizer.json to count its tokens"
        raise MergeError(f"{key}: {source}: mergekit resizes the embeddings to the tokenizer's vocabulary ({have}, "
                         f"the base's config.json says vocab_size {rows}), which skillswarm merge does not; drop "
                         f"{key} (the output keeps the base's tokenizer)")
    return chosen


def _embedding_rows(model_dir: Path) -> int | None:
    """The vocab_size in a model's config.json (None when it has none)."""
    import json

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    rows = config.get("vocab_size") if isinstance(config, dict) else None
    return rows if isinstance(rows, int) else None


def plan_recipe(raw: dict[str, Any], resolve: Resolve = local_model) -> RecipePlan:
    """Resolve a recipe (from load_recipe): models (`resolve(ref, key)` -> a local directory), per-tensor
    parameters, output options."""
    name = raw["merge_method"]
    try:
        get_method(name)
    except MergeError as e:
        raise MergeError(f"merge_method: {e}") from None
    run_as, fixed = _RUN_AS.get(name, (name, {}))
    method = get_method(run_as)
    shared_kinds, input_kinds = method_parameters(name)
    entries, slice_params, slice_base = _entries(raw)
    top = _mapping(raw.get("parameters"), "parameters")
    _check_params(top, "parameters", method.name, shared_kinds, input_kinds, False)
    _check_params(slice_params, "slices[0].parameters", method.name, shared_kinds, input_kinds, False)
    base_ref = slice_base if slice_base is not None else raw.get("base_model")
    base_key = "slices[0].base_model" if slice_base is not None else "base_model"
    if base_ref is not None and not isinstance(base_ref, str):
        raise MergeError(f"{base_key}: expected a path or hub id, got {base_ref!r}")
    resolved: list[tuple[str, str, Path, dict[str, Any], dict[str, Any]]] = []
    for where, entry in entries:
        kind, ref = _model_ref(entry, where)
        params = _mapping(entry.get("parameters"), f"{where}.parameters")
        _check_params(params, f"{where}.parameters", method.name, shared_kinds, input_kinds, True)
        path = resolve(ref, f"{where}.model") if kind == "model" else Path(ref)
        if kind == "model":
            _check_layer_range(where, entry, path)
        resolved.append((where, kind, path, params, entry))
    if base_ref is None:
        if method.name != "linear" or not resolved or resolved[0][1] != "model":
            raise MergeError(f"base_model: {method.name} needs a base model")
        base = resolved[0][2]
    else:
        base = resolve(base_ref, base_key)
    inputs, sources, models = [], [], []
    for where, kind, path, params, _ in resolved:
        if kind == "model" and path.resolve() == base.resolve() and method.name != "linear":
            continue  # mergekit's base entry: the other methods merge task vectors against it
        inputs.append(MergeInput(path, 1.0))
        sources.append([params, slice_params, top])
        if kind == "model":
            models.append(path)
    if not inputs:
        raise MergeError("models: nothing to merge besides the base")
    if method.kind == "slerp" and len(inputs) != 1:
        raise MergeError(f"models: slerp interpolates between the base and exactly one other model, got {len(inputs)}")
    if method.kind == "model_stock" and len(inputs) < 2:
        raise MergeError(f"models: model_stock needs at least two models besides the base, got {len(inputs)}")
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise MergeError(f"seed: expected an integer, got {seed!r}")
    out_dtype = _dtype(raw, "out_dtype") or _dtype(raw, "dtype")
    tokenizer_from = _tokenizer(raw, base, models, resolve)
    ck = Checkpoint(base)
    try:
        names, layers = ck.names(), num_layers(base, ck.names())
    finally:
        ck.close()
    tensor_params = _resolver(name, method, fixed, shared_kinds, input_kinds, [slice_params, top], sources, layers)
    if method.kind == "slerp" and not any("t" in s for s in (slice_params, top)):
        raise MergeError("parameters.t: slerp needs t (0: the base, 1: the other model)")
    for tensor in names:  # every tensor's parameters are checked before anything is written
        tp = tensor_params(tensor)
        if getattr(method.make_params(tp.shared), "filter_wise", False):
            raise MergeError("parameters.filter_wise: model_stock's per-row variant is not supported; leave it false")
        for own in tp.inputs:
            method.make_params({**tp.shared, **{k: v for k, v in own.items() if k != "weight"}})
    return RecipePlan(name, base, inputs, MergeSpec(method.name, fixed), out_dtype, seed, tensor_params,
                      tokenizer_from, dict(top))


def _resolver(name: str, method: Any, fixed: dict[str, Any], shared_kinds: dict[str, type],
              input_kinds: dict[str, type], shared_sources: list, input_sources: list[list],
              layers: int) -> Callable[[str], TensorParams]:
    """name -> TensorParams, evaluating gradients and filters at the tensor's layer position."""
    has_density = "density" in method.params.__dataclass_fields__
    defaults = {"weight": 1.0, "density": 1.0 if has_density else None, "gamma": 0.01, "epsilon": 0.15}

    def tensor_params(tensor: str) -> TensorParams:
        t = layer_t(tensor, layers)
        shared: dict[str, Any] = dict(fixed)
        for key in shared_kinds:
            v = resolve(key, shared_sources, tensor, t, None)
            if v is None or key == "int8_mask":  # int8_mask only changes the dtype mergekit holds a mask in
                continue
            if key == "rescale" and "rescale" not in method.params.__dataclass_fields__:
                if v:
                    raise MergeError(f"parameters.rescale: {name} with rescale: true (restoring each trimmed task "
                                     f"vector's L1 norm) is not supported; leave it false, mergekit's default")
                continue
            shared[key] = v
        inputs = []
        for srcs in input_sources:
            own = {}
            for key in input_kinds:
                v = resolve(key, srcs, tensor, t, defaults.get(key))
                if v is not None:
                    own[key] = v
            inputs.append(own)
        return TensorParams(shared, inputs)

    return tensor_params
