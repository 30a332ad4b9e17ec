"""Merge benchmark: skillswarm's streaming merge against mergekit, on a random Llama of ~0.5B fp32 parameters.

    .venv/bin/python bench/merge.py                        # time and peak RSS of task_arithmetic and TIES
    .venv/bin/python bench/merge.py --mergekit /tmp/mkvenv/bin/mergekit-yaml --json
    .venv/bin/python bench/merge.py --memory --deltas 8 --size 1GB   # the 8-delta memory figure, two runs

It builds a base model and 4 fine-tuned variants (base + small random deltas of sparsity 0, 0.5, 0.9,
0.99), writes one mergekit-style YAML recipe per method and runs it through `skillswarm merge run --recipe`
and, where mergekit is found (importable here, on PATH as mergekit-yaml, or given with --mergekit), through
`mergekit-yaml`; then it prints wall time, peak RSS (each tool in its own process, measured by a small
wrapper process), their ratios, and the largest absolute difference between the two outputs. It also
encodes one variant's delta with every codec and prints wire size and reconstruction error. Files go to
a temp directory (~20 GB for the default size) that is deleted at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

from skillswarm.merge.checkpoint import Checkpoint
from skillswarm.merge.deltas import compute_delta, encode_delta
from skillswarm.merge.tensorfile import TensorFileWriter, row_chunks

ROOT = Path(__file__).resolve().parent.parent
SKILLSWARM = Path(sys.executable).with_name("skillswarm")
SPARSITY = (0.0, 0.5, 0.9, 0.99)
# a process that runs a command and reports its wall time and peak RSS (the wrapper itself is ~10 MB, so the
# children's ru_maxrss, which Linux carries over fork+exec, is the command's own)
WRAPPER = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
           "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True); "
           "print(json.dumps({'rc': r.returncode, 'seconds': time.perf_counter() - t, "
           "'peak_rss_mb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 'stderr': r.stderr[-2000:]}))")


def llama_config(size: str):
    """A Llama config of about `size` (0.5B parameters, or 1GB of fp32 weights)."""
    from transformers import LlamaConfig

    layers = {"0.5B": 26, "1GB": 12, "tiny": 2}[size]
    hidden, inter, vocab = (1024, 4096, 32000) if size != "tiny" else (64, 128, 256)
    return LlamaConfig(architectures=["LlamaForCausalLM"], vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                       num_attention_heads=16 if size != "tiny" else 4, num_key_value_heads=8 if size != "tiny" else 2,
                       tie_word_embeddings=False, torch_dtype="float32")


def shapes_of(cfg) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the model, without allocating it."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def build_models(root: Path, cfg, variants: int) -> tuple[Path, list[Path]]:
    """Base and fine-tuned variants, one tensor at a time (memory stays one tensor)."""
    shapes = shapes_of(cfg)
    names = sorted(shapes)
    dirs = [root / "base"] + [root / f"variant{i}" for i in range(variants)]
    files = []
    for d in dirs:
        d.mkdir(parents=True)
        cfg.to_json_file(d / "config.json")
        fh = open(d / "model.safetensors", "wb")
        files.append((fh, TensorFileWriter(fh, [(n, torch.float32, shapes[n]) for n in names], {"format": "pt"})))
    g = torch.Generator().manual_seed(0)
    for n in names:
        base = torch.ones(shapes[n]) if n.endswith("norm.weight") else torch.randn(shapes[n], generator=g) * 0.02
        files[0][1].write(n, base)
        for i in range(variants):
            d = torch.randn(shapes[n], generator=g) * 1e-3
            if SPARSITY[i % len(SPARSITY)]:
                d *= torch.rand(shapes[n], generator=g) >= SPARSITY[i % len(SPARSITY)]
            files[i + 1][1].write(n, base + d)
    for fh, w in files:
        w.close()
        fh.close()
    return dirs[0], dirs[1:]


def recipe(path: Path, method: str, base: Path, models: list[Path]) -> Path:
    """The same YAML for both tools."""
    lines = [f"merge_method: {method}", f"base_model: {base}", "models:"]
    for m in models:
        params = "{weight: 1.0, density: 0.2}" if method == "ties" else "{weight: 1.0}"
        lines += [f"  - model: {m}", f"    parameters: {params}"]
    lines += ["parameters: {normalize: true}" if method == "ties" else "parameters: {}", "dtype: float32"]
    path.write_text("\n".join(lines) + "\n")
    return path


def measure(cmd: list[str]) -> dict:
    """Wall time and peak RSS of one command, in its own process."""
    out = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout)
    if res["rc"] != 0:
        raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{res['stderr']}")
    return res


def compare(a: Path, b: Path) -> tuple[float, int]:
    """Largest |a - b| over every weight, and how many entries differ by more than 1e-6 (streamed)."""
    ca, cb = Checkpoint(a), Checkpoint(b)
    if ca.names() != cb.names():
        raise SystemExit(f"{a} and {b} hold different tensors")
    worst, count = 0.0, 0
    for n in ca.names():
        for r0, r1 in row_chunks(ca.entry(n).shape, 1 << 22):
            diff = (ca.read_rows(n, r0, r1).double() - cb.read_rows(n, r0, r1).double()).abs()
            if diff.numel():
                worst, count = max(worst, float(diff.max())), count + int((diff > 1e-6).sum())
    return worst, count


def find_mergekit(arg: str | None) -> list[str] | None:
    """How to run mergekit-yaml: --mergekit PATH, or mergekit-yaml beside this interpreter or on PATH."""
    if arg == "none":
        return None
    if arg:
        return [arg]
    found = shutil.which("mergekit-yaml") or shutil.which("mergekit-yaml", path=str(Path(sys.executable).parent))
    return [found] if found else None


def bench_methods(work: Path, args: argparse.Namespace, emit) -> None:
    cfg = llama_config(args.size)
    t = time.perf_counter()
    base, variants = build_models(work, cfg, args.variants)
    n_params = sum(math.prod(s) for s in shapes_of(cfg).values())
    print(f"# built a {n_params / 1e9:.2f}B-parameter fp32 Llama and {len(variants)} variants "
          f"in {time.perf_counter() - t:.0f} s under {work}", file=sys.stderr)
    mergekit = find_mergekit(args.mergekit)
    if mergekit is None:
        print("# mergekit not found: install it beside the project (see README) and pass --mergekit", file=sys.stderr)
    for method in ("task_arithmetic", "ties"):
        r = recipe(work / f"{method}.yaml", method, base, variants)
        ours = measure([str(SKILLSWARM), "merge", "run", "--recipe", str(r), "--out", str(work / f"ours-{method}"),
                        "--no-progress"])
        row = {"kind": "method", "method": method, "params": n_params, "seconds": round(ours["seconds"], 2),
               "peak_rss_mb": round(ours["peak_rss_mb"])}
        if mergekit:
            mk = measure([*mergekit, str(r), str(work / f"mergekit-{method}"), "--no-copy-tokenizer", "--quiet",
                          "--no-write-model-card"])
            row |= {"mergekit_seconds": round(mk["seconds"], 2), "mergekit_peak_rss_mb": round(mk["peak_rss_mb"]),
                    "speedup": round(mk["seconds"] / ours["seconds"], 2),
                    "rss_ratio": round(ours["peak_rss_mb"] / mk["peak_rss_mb"], 3)}
            # TIES: where several entries tie at the trim threshold, mergekit keeps an arbitrary subset (its
            # argsort is not stable) and skillswarm keeps all of them, so those few entries legitimately differ
            row["max_abs_diff"], row["entries_differing"] = compare(work / f"ours-{method}", work / f"mergekit-{method}")
            shutil.rmtree(work / f"mergekit-{method}")
        shutil.rmtree(work / f"ours-{method}")
        emit(row)
    if not args.skip_codecs:  # wire size and reconstruction error of the dense (sparsity 0) variant's delta
        for codec, params in (("dense_fp32", {}), ("dense_bf16", {}), ("dense_fp16", {}), ("topk", {"density": 0.1}),
                              ("int8", {}), ("lora", {"rank": 16})):
            t = time.perf_counter()
            info = compute_delta(base, variants[0], work / f"delta-{codec}.safetensors", codec, **params)
            emit({"kind": "codec", "codec": codec, "params": info.params, "bytes": info.size,
                  "bytes_per_param": round(info.size / n_params, 3), "rel_error": round(info.error or 0.0, 6),
                  "seconds": round(time.perf_counter() - t, 1)})
            (work / f"delta-{codec}.safetensors").unlink()


class _LazyDelta(dict):
    """A delta state dict whose tensors are generated when read (so 1 GB deltas never sit in memory)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
        super().__init__({k: None for k in shapes})
        self.shapes, self.seed = shapes, seed

    def __getitem__(self, name: str) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(f"{self.seed}/{name}".encode()))
        return torch.randn(self.shapes[name], generator=g) * 1e-3


def bench_memory(work: Path, args: argparse.Namespace, emit) -> None:
    cfg = llama_config(args.size)
    shapes = shapes_of(cfg)
    base, _ = build_models(work, cfg, 0)
    n_params = sum(math.prod(s) for s in shapes.values())
    deltas = [encode_delta(_LazyDelta(shapes, i), work / f"d{i}.safetensors", args.codec).path for i in range(args.deltas)]
    print(f"# {n_params * 4 / 1e9:.2f} GB of fp32 weights, {args.deltas} {args.codec} deltas", file=sys.stderr)
    hashes = []
    for run in range(2):
        out = work / f"out{run}"
        cmd = [str(SKILLSWARM), "merge", "run", "--base", str(base), *sum((["--delta", str(d)] for d in deltas), []),
               "--method", "ties", "--density", "0.2", "--out", str(out), "--no-progress"]
        res = measure(cmd)
        hashes.append(subprocess.run([sys.executable, "-c", "import sys; from skillswarm.protocol.hashing import "
                                      "sha256_file; print(sha256_file(sys.argv[1]))", str(out / "model.safetensors")],
                                     capture_output=True, text=True, check=True).stdout.strip())
        emit({"kind": "memory", "run": run, "method": "ties", "deltas": args.deltas, "weights_gb": round(n_params * 4 / 1e9, 2),
              "seconds": round(res["seconds"], 2), "peak_rss_mb": round(res["peak_rss_mb"]), "sha256": hashes[-1]})
        if run:
            shutil.rmtree(work / "out0")
            shutil.rmtree(out)
    print(f"# two runs {'agree' if hashes[0] == hashes[1] else 'DIFFER'} (sha256 {hashes[0][:16]})", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default=None, choices=["0.5B", "1GB", "tiny"], help="model size (default 0.5B; 1GB with --memory)")
    ap.add_argument("--variants", type=int, default=4)
    ap.add_argument("--mergekit", default=None, help="mergekit-yaml to compare with ('none' to skip)")
    ap.add_argument("--skip-codecs", action="store_true", help="do not print the per-codec table")
    ap.add_argument("--memory", action="store_true", help="the N-delta memory figure instead of the comparison")
    ap.add_argument("--deltas", type=int, default=8, help="--memory: number of deltas")
    ap.add_argument("--codec", default="dense_fp32", help="--memory: codec of the deltas")
    ap.add_argument("--workdir", type=Path, default=None, help="where to build (default: a temp dir under /tmp)")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    ap.add_argument("--json", action="store_true", help="one JSON object per line (per method, codec or run)")
    args = ap.parse_args()
    args.size = args.size or ("1GB" if args.memory else "0.5B")
    work = Path(tempfile.mkdtemp(prefix="skillswarm-bench-", dir=args.workdir))

    def emit(row: dict) -> None:
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    try:
        (bench_memory if args.memory else bench_methods)(work, args, emit)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
