"""`skillswarm merge ...`: merge models or deltas, make and apply deltas, and analyze them."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from skillswarm.node.cli.common import JsonOpt, console, err_console, fail, print_json, table
from skillswarm.node.rl.config import LOCAL_CODEC
from skillswarm.protocol.records import CODECS, MERGE_METHODS, MergePolicy

app = typer.Typer(help="Merge models and deltas, make and apply deltas, analyze them.", no_args_is_help=True)

NoProgress = Annotated[bool, typer.Option("--no-progress", help="Do not draw progress bars.")]
Force = Annotated[bool, typer.Option("--force", help="Replace the output if it exists.")]
ShardSize = Annotated[Optional[str], typer.Option("--shard-size", help="Largest weights file, e.g. 2GB, 500MB "
                                                   "(default 5GiB, as the library's, so merge and apply shard alike).")]
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | None) -> int:
    """'5GB' -> 5e9 bytes, '2GiB' -> 2 * 2**30, '1000' -> 1000; None -> the library default."""
    if text is None:
        from skillswarm.merge.checkpoint import DEFAULT_SHARD_BYTES

        return DEFAULT_SHARD_BYTES
    m = _SIZE.match(text)
    if not m:
        fail(f"cannot read size {text!r}; write it like 5GB, 500MB or 2GiB")
    scale = 1024 if (m.group(3) or "").upper() == "IB" else 1000
    return int(float(m.group(1)) * scale ** " KMGT".index((m.group(2) or " ").upper()))


def _dtype(name: str | None) -> Any:
    if name is None:
        return None
    from skillswarm.merge.recipe import DTYPES

    if name not in DTYPES:
        fail(f"--dtype must be one of {', '.join(DTYPES)}")
    return DTYPES[name]


def _report(result: Any, as_json: bool, extra: dict[str, Any] | None = None) -> None:
    data = {"out": str(result.out_dir), "weights_hash": result.weights_hash, "num_tensors": result.num_tensors,
            "seconds": round(result.seconds, 3), "files": [{"path": f.path, "sha256": f.sha256, "size": f.size}
                                                           for f in result.files], **(extra or {})}
    if result.delta is not None:
        data["delta"] = {"path": str(result.delta.path), "sha256": result.delta.sha256, "size": result.delta.size}
    if as_json:
        print_json(data)
        return
    rows = [[f.path, f"{f.size:,}", f.sha256[:16]] for f in result.files]
    console.print(table(f"wrote {result.out_dir} in {result.seconds:.1f} s", ["file", "bytes", "sha256"], rows))
    console.print(f"weights hash [bold]{result.weights_hash}[/]", highlight=False)


def policy_defaults(method: str) -> dict[str, float]:
    """The network merge policy's density and lambda, for the ones `method` takes: `merge run` with no options
    merges as a coordinator does (an unknown method is left to the merge to report)."""
    from skillswarm.merge.methods import get_method
    from skillswarm.protocol.errors import MergeError

    try:
        names = {f.name for f in dataclasses.fields(get_method(method).params)}
    except MergeError:
        return {}
    policy = MergePolicy()
    return {k: v for k, v in (("density", policy.density), ("scale", policy.scale)) if k in names}


@app.command("run")
def run(
    out: Annotated[Path, typer.Option(help="Output model directory (written atomically).")],
    base: Annotated[Optional[Path], typer.Option(help="Base model directory.")] = None,
    delta: Annotated[Optional[list[Path]], typer.Option(help="A delta file; repeat for each.")] = None,
    model: Annotated[Optional[list[Path]], typer.Option(help="A fine-tuned model directory; repeat for each.")] = None,
    weight: Annotated[Optional[list[float]], typer.Option(help="Weight of each input, in order (default 1).")] = None,
    method: Annotated[str, typer.Option(help=f"Merge method: {', '.join(MERGE_METHODS)}; also breadcrumbs_ties, "
                                        "della, della_linear, slerp (t 0.5; use a recipe for t), model_stock.")] = MergePolicy().method,
    density: Annotated[Optional[float], typer.Option(help="Fraction kept by ties/dare/breadcrumbs (default: the network "
                                                     f"merge policy's, {MergePolicy().density}).")] = None,
    scale: Annotated[Optional[float], typer.Option("--lambda", help="Scale of the merged task vector (default: the "
                                                   f"network merge policy's, {MergePolicy().scale:g}).")] = None,
    gamma: Annotated[Optional[float], typer.Option(help="breadcrumbs: fraction of largest entries dropped.")] = None,
    recipe: Annotated[Optional[Path], typer.Option(help="A mergekit YAML recipe (replaces the options above): "
                                                   "models or hub ids, gradients, filters, dtype, tokenizer_source.")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed of DARE's masks.")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Output dtype: float32, bfloat16, float16 (default: the base's).")] = None,
    delta_out: Annotated[Optional[Path], typer.Option(help="Also write the merged delta (base -> output) here.")] = None,
    shard_size: ShardSize = None,
    force: Force = False,
    no_progress: NoProgress = False,
    json: JsonOpt = False,
) -> None:
    """Merge fine-tuned models (--model) or deltas (--delta) onto a base, or follow a --recipe."""
    from skillswarm.merge.recipe import load_recipe, plan_recipe
    from skillswarm.merge.streaming import MergeInput, MergeSpec, merge_deltas
    from skillswarm.node.checkpoints.hub import resolve_model

    options: dict[str, Any] = {}
    if recipe is not None:
        if base or delta or model or weight or density is not None or scale is not None or gamma is not None:
            fail("--recipe replaces --base/--delta/--model/--weight/--density/--lambda/--gamma; give one or the other")
        plan = plan_recipe(load_recipe(recipe), resolve_model)
        base_dir, inputs, spec, out_dtype = plan.base, plan.inputs, plan.spec, plan.out_dtype
        options = {"tensor_params": plan.tensor_params, "tokenizer_from": plan.tokenizer_from}
        seed = plan.seed if seed is None else seed
        if dtype is not None:
            out_dtype = _dtype(dtype)
    else:
        paths = [*(delta or []), *(model or [])]
        if base is None or not paths:
            fail("give --base and at least one --delta or --model (or a --recipe)")
        if weight and len(weight) != len(paths):
            fail(f"{len(weight)} --weight values for {len(paths)} inputs; give one per input or none")
        inputs = [MergeInput(p, (weight or [1.0] * len(paths))[i]) for i, p in enumerate(paths)]
        given = {k: v for k, v in (("density", density), ("scale", scale), ("gamma", gamma)) if v is not None}
        params: dict[str, Any] = {**policy_defaults(method), **given}
        base_dir, spec, out_dtype = base, MergeSpec(method, params), _dtype(dtype)
    result = merge_deltas(base_dir, inputs, spec, out, seed=seed or 0, out_dtype=out_dtype, delta_out=delta_out,
                          max_shard_bytes=parse_size(shard_size), overwrite=force, progress=not no_progress and not json,
                          **options)
    method_name, params = (plan.method, plan.params) if recipe is not None else (spec.method, dict(spec.params))
    _report(result, json, {"method": method_name, "params": params, "inputs": [str(i.path) for i in inputs]})


@app.command("delta")
def make_delta(
    base: Annotated[Path, typer.Option(help="Base model directory.")],
    tuned: Annotated[Path, typer.Option(help="Fine-tuned model directory.")],
    out: Annotated[Path, typer.Option(help="Delta file to write (.safetensors).")],
    codec: Annotated[str, typer.Option(help=f"Codec: {', '.join(CODECS)}.")] = LOCAL_CODEC,
    density: Annotated[Optional[float], typer.Option(help="topk: fraction of entries kept (default 0.1).")] = None,
    value_bits: Annotated[Optional[int], typer.Option(help="topk: 8 (int8, one scale per tensor), 16 (bfloat16) or 32 bit values.")] = None,
    rank: Annotated[Optional[int], typer.Option(help="lora: rank of the factors (default 16).")] = None,
    adapter_out: Annotated[Optional[Path], typer.Option(help="lora: also write a PEFT adapter directory here "
                                                        "(PeftModel.from_pretrained(base_model, DIR)).")] = None,
    base_hash: Annotated[Optional[str], typer.Option(help="Record the base's weights hash in the delta.")] = None,
    skill: Annotated[Optional[str], typer.Option(help="Record the skill the delta was trained on.")] = None,
    force: Force = False,
    no_progress: NoProgress = False,
    json: JsonOpt = False,
) -> None:
    """Write tuned - base as a delta file; print its size and reconstruction error. With --codec lora the file
    is a PEFT adapter (adapter_model.safetensors, config in its metadata): rank-R SVD factors of each linear
    layer's change; norms and embeddings stay the base's (their change counts in rel_error)."""
    from skillswarm.merge.deltas import compute_delta

    if adapter_out is not None and codec != "lora":
        fail(f"--adapter-out writes a PEFT LoRA adapter; it needs --codec lora, not {codec}")
    params = {k: v for k, v in (("density", density), ("value_bits", value_bits), ("rank", rank)) if v is not None}
    targets = None
    if codec == "lora":
        from skillswarm.node.rl.adapter import model_targets
        from skillswarm.protocol.errors import ModelError

        try:
            targets = model_targets(base)
        except ModelError as e:  # not a transformers model: the lora codec's own layout, every matrix factored
            if adapter_out is not None:
                fail(f"{e}; a PEFT adapter needs the model's architecture")
            err_console.print(f"note: {e}; writing the lora codec's own layout (not a PEFT adapter)", highlight=False)
    info = compute_delta(base, tuned, out, codec, base_hash=base_hash, skill=skill, adapter_targets=targets,
                         progress=not no_progress and not json, **params)
    data = {"path": str(info.path), "sha256": info.sha256, "size": info.size, "codec": info.codec,
            "params": info.params, "norm": info.norm, "num_tensors": info.num_tensors, "rel_error": info.error}
    if adapter_out is not None:
        from skillswarm.merge.peft_format import write_adapter_dir

        data["adapter"] = str(write_adapter_dir(out, adapter_out, base_model=str(base), overwrite=force))
    if json:
        print_json(data)
        return
    console.print(table(f"delta {out}", ["field", "value"], [[k, v] for k, v in data.items()]))


@app.command("apply")
def apply(
    base: Annotated[Path, typer.Option(help="Base model directory.")],
    delta: Annotated[Path, typer.Option(help="Delta file.")],
    out: Annotated[Path, typer.Option(help="Output model directory (written atomically).")],
    shard_size: ShardSize = None,
    force: Force = False,
    no_progress: NoProgress = False,
    json: JsonOpt = False,
) -> None:
    """Write base + delta as a model directory (bit-identical to the merge that made the delta)."""
    from skillswarm.merge.pipeline import apply_delta

    result = apply_delta(base, delta, out, max_shard_bytes=parse_size(shard_size), overwrite=force,
                         progress=not no_progress and not json)
    _report(result, json)


@app.command("analyze")
def analyze(
    deltas: Annotated[list[Path], typer.Argument(help="Delta files.")],
    plot: Annotated[Optional[Path], typer.Option(help="Write a cosine-similarity heatmap PNG here.")] = None,
    tensors: Annotated[int, typer.Option(help="Tensors to list (largest first); 0 for none, -1 for all.")] = 20,
    no_progress: NoProgress = False,
    json: JsonOpt = False,
) -> None:
    """Norms, fraction of parameters changed and cosine similarity between deltas, globally and per tensor."""
    from skillswarm.merge.diagnostics import analyze_deltas, plot_report

    report = analyze_deltas(deltas, progress=not no_progress and not json)
    if plot is not None:
        plot_report(report, plot)
    if json:
        print_json(report.to_json() | ({"plot": str(plot)} if plot else {}))
        return
    names = [p.name for p in deltas]
    console.print(table("deltas", ["delta", "skill", "codec", "bytes", "norm", "changed"], [
        [n, s or "", c, f"{b:,}", f"{v:.4g}", f"{ch:.2%}"]
        for n, s, c, b, v, ch in zip(names, report.skills, report.codecs, report.sizes, report.norms, report.changed)]))
    if len(names) > 1:
        console.print(table("cosine similarity", ["", *names],
                            [[n, *(f"{v:+.3f}" for v in row)] for n, row in zip(names, report.cosine)]))
    shown = sorted(report.tensors, key=lambda t: -max(t.norms, default=0.0))
    shown = shown if tensors < 0 else shown[:tensors]
    if shown:
        pairs = [(i, j) for i in range(len(names)) for j in range(i + 1, len(names))]
        cols = ["tensor", "elements", *(f"norm {n}" for n in names), "changed (max)"] + (["mean cosine"] if pairs else [])
        rows = [[t.name, f"{t.numel:,}", *(f"{v:.3g}" for v in t.norms), f"{max(t.changed):.1%}"]
                + ([f"{sum(t.cosine[i][j] for i, j in pairs) / len(pairs):+.3f}"] if pairs else []) for t in shown]
        console.print(table(f"tensors ({len(shown)} of {len(report.tensors)}, largest norm first)", cols, rows))
    if plot is not None:
        console.print(f"wrote {plot}")
