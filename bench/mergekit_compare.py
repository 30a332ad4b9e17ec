"""The same mergekit recipes through `skillswarm merge run --recipe` and mergekit's `mergekit-yaml`, compared
tensor by tensor, on a small random Llama (float32, 4 layers) and fine-tuned variants of it.

    .venv/bin/python bench/mergekit_compare.py --mergekit /tmp/mkvenv/bin/mergekit-yaml [--json] [--tensors]

mergekit runs in its own venv (see README: its pins stay out of ours). Per recipe it prints the largest
absolute difference, the largest relative difference (per tensor: max |ours - mergekit| / max |mergekit|)
and the fraction of entries that are bit-identical; `--tensors` adds one line per tensor. The randomized
methods (dare, della) draw different masks in the two tools, so they are compared where deterministic
(density 1) and by statistics of one model's trimmed task vector otherwise: the fraction of entries
kept, the L1 norm after / before, and (della) the keep rate of the larger- vs the smaller-magnitude half.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from skillswarm.merge.checkpoint import Checkpoint

HERE = Path(__file__).resolve().parent
SKILLSWARM = Path(sys.executable).with_name("skillswarm")
_spec = importlib.util.spec_from_file_location("bench_merge", HERE / "merge.py")
bench_merge = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(bench_merge)  # type: ignore[union-attr]


def llama(work: Path) -> tuple[Path, list[Path], Path]:
    """Base, 3 fine-tuned variants (dense, 50% and 90% sparse deltas) and an independent random model."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                      torch_dtype="float32")
    base, variants = bench_merge.build_models(work / "m", cfg, 3)
    far, _ = bench_merge.build_models(work / "far", cfg, 0)  # same generator seed: perturb it below
    ck = Checkpoint(far)
    sd = {n: ck.read(n) for n in ck.names()}
    ck.close()
    g = torch.Generator().manual_seed(7)
    from safetensors.torch import save_file

    save_file({n: v + torch.randn(v.shape, generator=g) * 0.02 for n, v in sd.items()}, str(far / "model.safetensors"),
              metadata={"format": "pt"})
    return base, variants, far


def recipes(base: Path, v: list[Path], far: Path) -> dict[str, str]:
    """name -> YAML, the same text for both tools."""
    def models(params: list[str], paths: list[Path] | None = None) -> str:
        return "models:\n" + "".join(f"  - model: {p}\n    parameters: {q}\n" for p, q in zip(paths or v, params))

    head = f"base_model: {base}\ndtype: float32\n"
    w3 = ["{weight: 1.0}", "{weight: 0.5}", "{weight: 2.0}"]
    half = ["{weight: 1.0, density: 0.5}"] * 3
    crumbs = ["{weight: 1.0, density: 0.5, gamma: 0.05}"] * 3
    grad = ("{weight: [{filter: self_attn, value: [0.2, 1.0]}, {value: 0.6}], density: [0.3, 0.8]}")
    pair = f"models:\n  - model: {base}\n  - model: {{}}\n"
    return {
        "linear": f"merge_method: linear\ndtype: float32\n{models(w3)}",  # mergekit's linear takes no base
        "task_arithmetic": f"merge_method: task_arithmetic\n{head}{models(w3)}parameters: {{lambda: 0.7}}\n",
        "ties": f"merge_method: ties\n{head}{models(half)}parameters: {{normalize: true}}\n",
        "ties_gradient_filter": f"merge_method: ties\n{head}{models([grad, half[0], grad])}",
        "breadcrumbs": f"merge_method: breadcrumbs\n{head}{models(crumbs)}",
        "breadcrumbs_ties": f"merge_method: breadcrumbs_ties\n{head}{models(crumbs)}",
        "dare_linear_density1": f"merge_method: dare_linear\n{head}{models(w3)}",
        "dare_ties_density1": f"merge_method: dare_ties\n{head}{models(w3)}",
        "della_density1": f"merge_method: della\n{head}{models(w3)}parameters: {{epsilon: 0.1}}\n",
        "slerp_far_gradient": (f"merge_method: slerp\n{head}{pair.format(far)}parameters:\n"
                               "  t:\n    - {filter: self_attn, value: [0, 0.5, 0.3, 0.7, 1]}\n"
                               "    - {filter: mlp, value: [1, 0.5, 0.7, 0.3, 0]}\n    - value: 0.5\n"),
        "slerp_finetune": f"merge_method: slerp\n{head}{pair.format(v[0])}parameters: {{t: 0.3}}\n",
        "model_stock": f"merge_method: model_stock\n{head}models:\n" + "".join(f"  - model: {p}\n" for p in v),
        "breadcrumbs_default_gamma": f"merge_method: breadcrumbs\n{head}{models(half)}",
        "ties_out_bfloat16": f"merge_method: ties\n{head}out_dtype: bfloat16\n{models(half)}",
        "ties_float16": f"merge_method: ties\nbase_model: {base}\ndtype: float16\n{models(half)}",
        "ties_bfloat16": f"merge_method: ties\nbase_model: {base}\ndtype: bfloat16\n{models(half)}",
        # randomized: one model, so its trimmed task vector is out - base
        "dare_linear_stats": f"merge_method: dare_linear\n{head}{models(['{weight: 1.0, density: 0.5}'], v[:1])}",
        "dare_ties_norescale_stats": (f"merge_method: dare_ties\n{head}{models(['{weight: 1.0, density: 0.3}'], v[:1])}"
                                      "parameters: {rescale: false}\n"),
        "della_stats": f"merge_method: della\n{head}{models(['{weight: 1.0, density: 0.4, epsilon: 0.3}'], v[:1])}",
        "della_linear_stats": (f"merge_method: della_linear\n{head}"
                               f"{models(['{weight: 1.0, density: 0.5, epsilon: 0.2}'], v[:1])}"),
    }


def run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd[:4])} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")


def compare(ours: Path, theirs: Path) -> tuple[dict, list[dict]]:
    """Per-tensor and overall: max abs diff, max relative diff, fraction of bit-identical entries."""
    a, b = Checkpoint(ours), Checkpoint(theirs)
    rows, same, total = [], 0, 0
    for n in b.names():
        x, y = a.read(n), b.read(n)
        if x.dtype != y.dtype:
            raise SystemExit(f"{n}: dtype {x.dtype} here, {y.dtype} in mergekit's output")
        d = (x.double() - y.double()).abs()
        scale = float(y.double().abs().max()) or 1.0
        eq = int((x == y).sum())
        rows.append({"tensor": n, "max_abs": float(d.max()), "max_rel": float(d.max()) / scale, "exact": eq / x.numel()})
        same, total = same + eq, total + x.numel()
    a.close(), b.close()
    return {"max_abs": max(r["max_abs"] for r in rows), "max_rel": max(r["max_rel"] for r in rows),
            "exact_fraction": same / total, "tensors": len(rows)}, rows


def stats(out: Path, base: Path, model: Path) -> dict:
    """One model's trimmed task vector (out - base) against its own (model - base)."""
    o, b, m = Checkpoint(out), Checkpoint(base), Checkpoint(model)
    kept = nonzero = 0
    l1_before = l1_after = 0.0
    top_kept = top_n = bot_kept = bot_n = 0
    for n in b.names():
        x = m.read(n).double() - b.read(n).double()
        y = o.read(n).double() - b.read(n).double()
        live = x != 0
        kept, nonzero = kept + int((y[live] != 0).sum()), nonzero + int(live.sum())
        l1_before, l1_after = l1_before + float(x.abs().sum()), l1_after + float(y.abs().sum())
        rows = x.abs().reshape(x.shape[0], -1) if x.dim() > 1 else x.abs().reshape(1, -1)
        ky = (y != 0).reshape(rows.shape)
        med = rows.median(dim=1, keepdim=True).values
        for sel, big in ((rows > med, True), ((rows < med) & (rows > 0), False)):
            if big:
                top_kept, top_n = top_kept + int(ky[sel].sum()), top_n + int(sel.sum())
            else:
                bot_kept, bot_n = bot_kept + int(ky[sel].sum()), bot_n + int(sel.sum())
    for c in (o, b, m):
        c.close()
    return {"kept": round(kept / nonzero, 4), "l1_ratio": round(l1_after / l1_before, 4),
            "kept_top_half": round(top_kept / max(1, top_n), 4), "kept_bottom_half": round(bot_kept / max(1, bot_n), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mergekit", default="/tmp/mkvenv/bin/mergekit-yaml", help="mergekit-yaml of mergekit's venv")
    ap.add_argument("--only", nargs="*", help="run only these recipes")
    ap.add_argument("--tensors", action="store_true", help="also one line per tensor")
    ap.add_argument("--json", action="store_true", help="one JSON object per line")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    args = ap.parse_args()
    if not Path(args.mergekit).exists() and not shutil.which(args.mergekit):
        raise SystemExit(f"{args.mergekit} not found: install mergekit in its own venv (see README) and pass --mergekit")
    work = Path(tempfile.mkdtemp(prefix="skillswarm-mkcmp-"))

    def emit(row: dict) -> None:
        print(json.dumps(row) if args.json else "  ".join(
            f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)

    try:
        base, variants, far = llama(work)
        for name, text in recipes(base, variants, far).items():
            if args.only and name not in args.only:
                continue
            r = work / f"{name}.yaml"
            r.write_text(text)
            run([str(SKILLSWARM), "merge", "run", "--recipe", str(r), "--out", str(work / f"ours-{name}"), "--no-progress"])
            run([args.mergekit, str(r), str(work / f"mk-{name}"), "--no-copy-tokenizer", "--quiet",
                 "--no-write-model-card", "--random-seed", "0"])
            if name.endswith("_stats"):
                emit({"recipe": name, "ours": stats(work / f"ours-{name}", base, variants[0]),
                      "mergekit": stats(work / f"mk-{name}", base, variants[0])})
            else:
                summary, rows = compare(work / f"ours-{name}", work / f"mk-{name}")
                emit({"recipe": name, **summary})
                for row in rows if args.tensors else []:
                    emit({"recipe": name, **row})
            if not args.keep:
                shutil.rmtree(work / f"ours-{name}"), shutil.rmtree(work / f"mk-{name}")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"# files kept under {work}", file=sys.stderr)


if __name__ == "__main__":
    main()
